//! State slots: snapshots of a hybrid model's recurrent state, kept on the index beside the pages.
//!
//! A recurrent layer (Mamba, Gated DeltaNet, short convolution) folds its whole prefix into one
//! state that cannot be cut back, so a prefix hit is usable only where a snapshot of every
//! recurrent layer's state was kept. The tensors live in Python; the core hands out their slot
//! ids (`0..state_slots`) and decides which snapshot each slot holds:
//!
//! ```text
//!   prefix pages   [ p0 | p1 | p2 | p3 | p4 | p5 ]        (the index's device pages)
//!   snapshots                   ^ slot 3       ^ slot 0   (anchored at the page they end on)
//!   admit of a prompt whose KV matches p0..p5: the hit ends at p5's snapshot;
//!   with slot 0 evicted, at p2's (the pages past it are recomputed, not used as cached)
//! ```
//!
//! A snapshot ends on a page boundary (token-exact at `page_size=1`) and is anchored at the page
//! that ends its prefix. A published page's id names its whole prefix and namespace while it is
//! cached, so the anchor is all a lookup needs; the snapshot also keeps the pages it needs (its
//! chain) and its prefix tokens, so that `check()` can find them again. The index reports every
//! device page that stops holding cached KV (evicted, offloaded to the host tier, reset) through
//! [`Drops`], and every snapshot that needs such a page goes with it: a snapshot never outlives
//! its pages, on either tier (snapshots are not offloaded in this version).
//!
//! Snapshots have their own eviction order, separate from the pages': a slot is taken from the
//! free list, else from an unpinned snapshot evicted. A hit pins the snapshot it ends at until
//! the request has copied it (or closes), and refreshes it, and only it, when unpinned.
//!
//! The order has a cold end, evicted first, each part in the order snapshots went there, and a
//! hot end, evicted last:
//!
//! ```text
//!   lru:  [ cold ][ cool ][ warm: lowest priority first ][ hot: likewise ]
//!           ^ the next slot taken (the least recent hot one while more than a quarter are hot)
//! ```
//!
//! A snapshot is superseded when a request that went past it finishes with a later snapshot of
//! its own on the same path, and no other request has gone past it: the request's own earlier
//! snapshots (its prompt-end one, once its request-end one exists) go cold; the snapshot its hit
//! continued from goes cool, after the cold ones, so that a second request branching from it
//! soon after still finds it. A snapshot two requests went past (a shared system prompt's
//! junction, a turn sub-agents branched from) stays warm: that is where the next requests will
//! branch again. A superseded snapshot still serves a hit; the hit makes it warm again. A
//! snapshot [`HOT`] requests went past is a hub (a system prompt many sessions start from): it
//! is evicted after the warm ones, but for the least recent hot one while more than a quarter of
//! the slots are hot, so that hubs never crowd out the running sessions' latest turns.
//!
//! Among the warm (or the hot) ones, what a snapshot saves decides, aged by a level
//! (GreedyDual-Size, every snapshot one slot in size): its saving is its tokens past its parent,
//! the deepest other snapshot on its prefix, where a hit would fall back to without it; its
//! priority is that plus its base, the level when it was published or last used; the lowest
//! goes, and raises the level to its priority. A sub-agent's end, a few hundred tokens past the
//! turn it branched from, goes before a session's latest turn that only the system prompt's
//! snapshot is below; a big saving nobody uses goes once the level has risen past it.
//!
//! ```text
//!   system prompt (hub) -+- session A's turn 3 end (saves 9k)   parent links (the tree of
//!                        +- session B's turn 2 end (saves 6k)   snapshots) kept up to date as
//!                             +- a sub-agent's end (saves 400)  snapshots are published and
//!                                                               removed
//! ```

use crate::arena::ids::PageId;
use crate::cache::digest::StateDigest;
use crate::error::{corrupt, try_vec, Result};
use crate::wire::hash::Namespace;
use std::collections::BTreeMap;

/// No snapshot anchored at a page.
const NONE: u32 = u32::MAX;

/// The device pages an index stopped caching since the last drain, recorded only when `on`
/// (a cache with state slots); free otherwise but for one branch an eviction.
#[derive(Debug, Default)]
pub struct Drops {
    /// Whether drops are recorded.
    pub on: bool,
    /// The pages dropped since the last drain.
    pub pages: Vec<PageId>,
}

impl Drops {
    /// Records that `pages` no longer hold cached KV.
    #[inline]
    pub fn note(&mut self, pages: &[PageId]) {
        if self.on {
            self.pages.extend_from_slice(pages);
        }
    }
}

/// A live request's part of the state slots.
#[derive(Debug, Clone, Default)]
pub struct StateRefs {
    /// The snapshot its admission hit ended at, pinned until [`States::unpin`].
    pub hit: Option<u32>,
    /// Tokens its KV match ran to at admission (at least `num_cached`).
    pub kv_matched: usize,
    /// Snapshots taken and not published yet: `(position, slot)`, in the order taken.
    pub pending: Vec<(usize, u32)>,
    /// The snapshot its hit continued from, then the ones it published: `(position, slot,
    /// serial)`, superseded by its deepest at `finish`; a slot whose snapshot has another
    /// serial was evicted meanwhile.
    pub from: Option<(usize, u32, u64)>,
    /// See `from`.
    pub own: Vec<(usize, u32, u64)>,
}

/// Requests gone past a snapshot that make it hot (a hub).
pub const HOT: u32 = 4;

/// A snapshot's part of the LRU: cold (a request's own earlier snapshot, superseded), cool (the
/// one a hit continued from, superseded), hot (a hub: [`HOT`] requests went past it), else warm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Temp {
    /// Evicted first.
    Cold,
    /// Evicted after the cold ones.
    Cool,
    /// The least recently used first.
    Warm,
    /// Evicted last, but for the least recent one while more than a quarter of slots are hot.
    Hot,
}

impl Temp {
    /// An unsuperseded snapshot's part, by how many requests went past it.
    fn of(continued: u32) -> Temp {
        if continued >= HOT {
            Temp::Hot
        } else {
            Temp::Warm
        }
    }
}

/// One slot's snapshot.
#[derive(Debug)]
struct Snap {
    /// Its prefix's tokens (a whole number of pages) and namespace.
    tokens: Vec<u32>,
    namespace: Namespace,
    /// The index's device pages of the prefix, in order; empty while pending.
    chain: Vec<PageId>,
    /// Live requests that hit it and have not copied it yet.
    pins: u32,
    /// Its key in the LRU while published and unpinned.
    key: (Temp, u64),
    /// Which take made it (`taken` then): tells a slot's snapshot from a later one in it.
    serial: u64,
    /// Requests that continued past it (computed tokens after it): a junction snapshot starts
    /// at one, the request whose KV its taker matched.
    continued: u32,
    /// The slot of the deepest other published snapshot on its prefix (its parent in the tree
    /// of snapshots), or `NONE`; set while published.
    parent: u32,
    /// The level when it was published or last unpinned: its priority is this plus its saving.
    base: u64,
}

impl Snap {
    fn published(&self) -> bool {
        !self.chain.is_empty()
    }
}

/// The state slots of a cache (no slots: hybrid off).
#[derive(Debug, Default)]
pub struct States {
    snaps: Vec<Option<Snap>>,
    /// Free slot ids, the next one taken at the back (lowest ids first at the start).
    free: Vec<u32>,
    /// Of each device page: the slot of the published snapshot anchored at it, or `NONE`.
    anchor: Vec<u32>,
    /// Of each device page: how many published snapshots need it.
    needed: Vec<u32>,
    /// Published unpinned snapshots by part and last use: the cold ones by when they went
    /// cold, then the cool ones; the warm and hot ones are chosen from by priority.
    lru: BTreeMap<(Temp, u64), u32>,
    clock: u64,
    /// The priority of the last snapshot evicted by priority (warm or hot): what a snapshot
    /// published or used now starts from, so that an old one's saving is worth less.
    level: u64,
    /// Slots that went back to the free list since the last drain.
    freed: Vec<u32>,
    /// Whether [`States::changes`] are recorded (the cache records KV events).
    pub record: bool,
    /// Snapshots published (true) and removed once published (false) since the last drain:
    /// their prefix tokens and namespace, for the cache's event log.
    changes: Vec<(bool, Vec<u32>, Namespace)>,
    /// Tokens admissions took from the cache through a snapshot.
    pub hit_tokens: u64,
    /// Snapshots taken so far (slots handed out).
    pub taken: u64,
    /// Snapshots evicted so far: for a slot, or with a page they needed.
    pub evicted: u64,
}

/// The state-slot counters of [`crate::CacheStats`]: `(slots, free, pinned, hit tokens, taken,
/// evicted)`.
pub type StateCounts = (usize, usize, usize, u64, u64, u64);

impl States {
    /// `slots` state slots over a pool of `num_pages` device pages.
    pub fn new(slots: usize, num_pages: usize) -> Result<Self> {
        let mut snaps = crate::error::try_with_capacity(slots)?;
        snaps.resize_with(slots, || None);
        Ok(States {
            snaps,
            free: (0..slots as u32).rev().collect(),
            anchor: try_vec(num_pages, NONE)?,
            needed: try_vec(num_pages, 0)?,
            ..States::default()
        })
    }

    /// Whether the cache keeps snapshots (`state_slots > 0`).
    #[inline]
    pub fn on(&self) -> bool {
        !self.snaps.is_empty()
    }

    /// The counters for the stats.
    pub fn counts(&self) -> StateCounts {
        let pinned = self.snaps.iter().flatten().filter(|s| s.pins > 0).count();
        (
            self.snaps.len(),
            self.free.len(),
            pinned,
            self.hit_tokens,
            self.taken,
            self.evicted,
        )
    }

    /// The longest prefix of `pages` (a lookup's pages, in order) that ends where a published
    /// snapshot is: its page count and the snapshot's slot (`(0, None)` when none is).
    pub fn cut(&self, pages: &[PageId]) -> (usize, Option<u32>) {
        for k in (1..=pages.len()).rev() {
            let s = match self.anchor.get(pages[k - 1].0 as usize) {
                Some(&s) if s != NONE => s,
                _ => continue,
            };
            return (k, Some(s));
        }
        (0, None)
    }

    /// Whether a published snapshot is anchored at `page`.
    pub fn anchored(&self, page: PageId) -> bool {
        self.anchor.get(page.0 as usize).is_some_and(|&s| s != NONE)
    }

    /// One more pin of the snapshot in `slot` (a hit); a pinned snapshot is never evicted.
    pub fn pin(&mut self, slot: u32) {
        let s = self.snaps[slot as usize]
            .as_mut()
            .expect("a hit's snapshot");
        if s.pins == 0 {
            self.lru.remove(&s.key);
        }
        s.pins += 1;
    }

    /// Drops a pin; the last one makes the snapshot the most recently used.
    pub fn unpin(&mut self, slot: u32) {
        self.clock += 1;
        let s = self.snaps[slot as usize]
            .as_mut()
            .expect("a pinned snapshot");
        s.pins -= 1;
        if s.pins == 0 {
            s.base = self.level;
            s.key = (Temp::of(s.continued), self.clock);
            self.lru.insert(s.key, slot);
        }
    }

    /// The serial of the snapshot in `slot` (`None` when free).
    pub fn serial(&self, slot: u32) -> Option<u64> {
        self.snaps[slot as usize].as_ref().map(|s| s.serial)
    }

    /// A finished request went past the snapshot `(slot, serial)` (gone: nothing) to a later
    /// one of its own; with that request the only one, the snapshot goes `to` the cold or cool
    /// part of the LRU; with [`HOT`] of them, to the hot part (keeping its last use).
    pub fn superseded(&mut self, slot: u32, serial: u64, to: Temp) {
        self.clock += 1;
        let Some(s) = self.snaps[slot as usize]
            .as_mut()
            .filter(|s| s.serial == serial && s.published())
        else {
            return;
        };
        s.continued += 1;
        if s.pins > 0 || s.key.0 != Temp::Warm {
            return;
        }
        let key = match Temp::of(s.continued) {
            _ if s.continued == 1 => (to, self.clock),
            Temp::Hot => (Temp::Hot, s.key.1),
            _ => return,
        };
        self.lru.remove(&s.key);
        s.key = key;
        self.lru.insert(key, slot);
    }

    /// Evicts the published, unpinned snapshot in `slot`; false, changing nothing, when the
    /// slot is free, pending or pinned.
    pub fn evict(&mut self, slot: u32) -> bool {
        match &self.snaps[slot as usize] {
            Some(s) if s.published() && s.pins == 0 => {
                self.remove(slot);
                self.evicted += 1;
                true
            }
            _ => false,
        }
    }

    /// The number of state slots.
    pub fn slots(&self) -> usize {
        self.snaps.len()
    }

    /// A slot for a new snapshot of `tokens` in `namespace`, pending (not findable) until
    /// [`States::publish`]: a free one, else the first unpinned snapshot's in the LRU (evicted);
    /// `None` when every slot is pinned or pending. `junction`: the taker's KV match ran over
    /// the prefix, so another request continued past it already.
    pub fn take(&mut self, tokens: &[u32], namespace: &Namespace, junction: bool) -> Option<u32> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let s = self.victim()?;
                self.remove(s);
                self.evicted += 1;
                self.free.pop().expect("just freed")
            }
        };
        self.snaps[slot as usize] = Some(Snap {
            tokens: tokens.to_vec(),
            namespace: namespace.clone(),
            chain: Vec::new(),
            pins: 0,
            key: (Temp::Warm, 0),
            serial: self.taken,
            continued: junction as u32,
            parent: NONE,
            base: 0,
        });
        self.taken += 1;
        Some(slot)
    }

    /// Makes the pending snapshot in `slot` findable at the end of `chain` (the index's device
    /// pages of its prefix). A snapshot anchored there already wins: this one is discarded and
    /// false returned.
    pub fn publish(&mut self, slot: u32, chain: Vec<PageId>) -> bool {
        let last = chain.last().expect("a snapshot covers at least one page");
        if self.anchor[last.0 as usize] != NONE {
            self.remove(slot);
            return false;
        }
        let (last, len) = (*last, chain.len());
        let parent = self.nearest(&chain[..len - 1]);
        self.anchor[last.0 as usize] = slot;
        for p in &chain {
            self.needed[p.0 as usize] += 1;
        }
        // The new snapshot sits between its parent and the parent's children that go past it.
        for (i, x) in self.snaps.iter_mut().enumerate() {
            if let Some(x) = x.as_mut().filter(|x| x.published() && i as u32 != slot) {
                if x.parent == parent && x.chain.len() > len && x.chain[len - 1] == last {
                    x.parent = slot;
                }
            }
        }
        self.clock += 1;
        let s = self.snaps[slot as usize]
            .as_mut()
            .expect("a pending snapshot");
        s.chain = chain;
        s.parent = parent;
        s.base = self.level;
        s.key = (Temp::Warm, self.clock);
        self.lru.insert(s.key, slot);
        if self.record {
            self.changes
                .push((true, s.tokens.clone(), s.namespace.clone()));
        }
        true
    }

    /// The slot of the published snapshot anchored at the last page of `pages` that has one
    /// (the deepest snapshot on that prefix), or `NONE`.
    fn nearest(&self, pages: &[PageId]) -> u32 {
        pages
            .iter()
            .rev()
            .map(|p| self.anchor[p.0 as usize])
            .find(|&a| a != NONE)
            .unwrap_or(NONE)
    }

    /// What keeping the snapshot in `slot` saves a hit on its path: its tokens past its parent
    /// (all of them without one), where the hit would fall back to. (When a warm one is evicted
    /// no superseded one is left unpinned, so a parent is never on its way out.)
    fn saving(&self, slot: u32) -> u64 {
        let s = self.snaps[slot as usize].as_ref().expect("a snapshot");
        let below = match s.parent {
            NONE => 0,
            up => self.snaps[up as usize]
                .as_ref()
                .expect("a parent")
                .tokens
                .len(),
        };
        (s.tokens.len() - below) as u64
    }

    /// The snapshot a take evicts (none when every slot is pinned or pending): the least recent
    /// hub while more than a quarter of the slots are hubs; else the first cold, else the first
    /// cool one; else the warm one (the hot one when none is warm) of the lowest priority, its
    /// base level plus its saving (the earlier used on a tie), which raises the level to it.
    fn victim(&mut self) -> Option<u32> {
        let quarter = (self.snaps.len() / 4).max(1);
        if self.lru.range((Temp::Hot, 0)..).nth(quarter).is_some() {
            return self.lru.range((Temp::Hot, 0)..).next().map(|(_, &s)| s);
        }
        let (&(temp, _), &first) = self.lru.iter().next()?;
        if temp < Temp::Warm {
            return Some(first);
        }
        let tier = if temp == Temp::Warm {
            Temp::Warm
        } else {
            Temp::Hot
        };
        let (prio, slot) = self
            .lru
            .range((tier, 0)..=(tier, u64::MAX))
            .map(|(_, &s)| {
                let base = self.snaps[s as usize].as_ref().expect("listed").base;
                (base + self.saving(s), s)
            })
            .min_by_key(|&(prio, _)| prio)?;
        self.level = prio;
        Some(slot)
    }

    /// Frees `slot` (a pending snapshot discarded, or a published one evicted).
    pub fn remove(&mut self, slot: u32) {
        let s = self.snaps[slot as usize].take().expect("a live snapshot");
        if s.published() {
            for x in self.snaps.iter_mut().flatten() {
                if x.parent == slot && x.published() {
                    x.parent = s.parent;
                }
            }
            self.anchor[s.chain.last().expect("published").0 as usize] = NONE;
            for p in &s.chain {
                self.needed[p.0 as usize] -= 1;
            }
            if s.pins == 0 {
                self.lru.remove(&s.key);
            }
            if self.record {
                self.changes.push((false, s.tokens, s.namespace));
            }
        }
        self.free.push(slot);
        self.freed.push(slot);
    }

    /// The snapshots published (true) and removed (false) since the last call, while
    /// [`States::record`]: `(stored, prefix tokens, namespace)`, in order.
    pub fn drain_changes(&mut self) -> Vec<(bool, Vec<u32>, Namespace)> {
        std::mem::take(&mut self.changes)
    }

    /// Evicts every snapshot that needs one of `pages` (device pages the index just stopped
    /// caching).
    ///
    /// An index drops a page only with or after every cached page below it (leaves first, a
    /// chain's tail before its head), so a snapshot that needs a dropped page is anchored at one
    /// of the dropped pages: those are looked up by page, with no scan of the snapshots. A page
    /// still needed after that (dropped from under a snapshot some other way) falls back to the
    /// scan of every snapshot's chain.
    pub fn dropped(&mut self, pages: &[PageId]) {
        let needed = |s: &Self, p: &PageId| s.needed.get(p.0 as usize).is_some_and(|&n| n > 0);
        if !pages.iter().any(|p| needed(self, p)) {
            return;
        }
        for p in pages {
            let slot = self.anchor.get(p.0 as usize).copied().unwrap_or(NONE);
            if slot != NONE {
                debug_assert_eq!(self.snaps[slot as usize].as_ref().map(|s| s.pins), Some(0));
                self.remove(slot);
                self.evicted += 1;
            }
        }
        let gone: std::collections::HashSet<PageId> =
            pages.iter().copied().filter(|p| needed(self, p)).collect();
        if gone.is_empty() {
            return;
        }
        let victims: Vec<u32> = self
            .snaps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                s.chain.iter().any(|p| gone.contains(p)).then_some(i as u32)
            })
            .collect();
        for slot in victims {
            debug_assert_eq!(self.snaps[slot as usize].as_ref().map(|s| s.pins), Some(0));
            self.remove(slot);
            self.evicted += 1;
        }
    }

    /// The slots that went back to the free list since the last call and are still free, each
    /// once, in the order freed.
    pub fn drain_freed(&mut self) -> Vec<u32> {
        let mut seen = std::collections::HashSet::new();
        let freed = std::mem::take(&mut self.freed);
        freed
            .into_iter()
            .filter(|&s| self.snaps[s as usize].is_none() && seen.insert(s))
            .collect()
    }

    /// Every published snapshot: `(slot, prefix tokens, namespace)`, by slot (tests, `check`).
    pub fn published(&self) -> impl Iterator<Item = (u32, &[u32], &Namespace)> + '_ {
        self.snaps.iter().enumerate().filter_map(|(i, s)| {
            let s = s.as_ref().filter(|s| s.published())?;
            Some((i as u32, s.tokens.as_slice(), &s.namespace))
        })
    }

    /// The chain of the published snapshot in `slot`.
    pub fn chain(&self, slot: u32) -> &[PageId] {
        self.snaps[slot as usize].as_ref().map_or(&[], |s| &s.chain)
    }

    /// Recomputes the slots' own invariants from scratch: every slot free or holding one
    /// snapshot; anchors, page counts and the LRU agree with the snapshots; `pins` and `pending`
    /// (each live request's pinned hit and pending slots) agree with the snapshots'. Whether each
    /// snapshot's pages are in the index is the cache's check.
    pub fn check<'a>(
        &self,
        page_size: usize,
        mut requests: impl Iterator<Item = &'a StateRefs>,
    ) -> Result<()> {
        let n = self.snaps.len();
        let mut free = vec![false; n];
        for &s in &self.free {
            if s as usize >= n || std::mem::replace(&mut free[s as usize], true) {
                return corrupt(format!("state slot {s} is free twice, or past the slots"));
            }
            if self.snaps[s as usize].is_some() {
                return corrupt(format!("state slot {s} is free and holds a snapshot"));
            }
        }
        let mut pins = vec![0u32; n];
        let mut pending = vec![false; n];
        requests.try_for_each(|r| {
            if let Some(h) = r.hit {
                match self.snaps.get(h as usize) {
                    Some(Some(s)) if s.published() => pins[h as usize] += 1,
                    _ => return corrupt(format!("a request pins state slot {h}, not a snapshot")),
                }
            }
            for &(_, s) in &r.pending {
                match self.snaps.get(s as usize) {
                    Some(Some(snap)) if !snap.published() => {
                        if std::mem::replace(&mut pending[s as usize], true) {
                            return corrupt(format!("state slot {s} is pending twice"));
                        }
                    }
                    _ => return corrupt(format!("a request's pending state slot {s} is not")),
                }
            }
            Ok(())
        })?;
        let mut needed = vec![0u32; self.needed.len()];
        let mut anchors = 0;
        let mut in_lru = 0;
        for (i, s) in self.snaps.iter().enumerate() {
            let Some(s) = s else {
                if !free[i] {
                    return corrupt(format!("state slot {i} is neither free nor held"));
                }
                continue;
            };
            if s.pins != pins[i] {
                return corrupt(format!(
                    "state slot {i} has {} pins, live requests hold {}",
                    s.pins, pins[i]
                ));
            }
            if !s.published() {
                if !pending[i] || s.pins > 0 {
                    return corrupt(format!("state slot {i} is pending for no request"));
                }
                continue;
            }
            if pending[i] {
                return corrupt(format!("state slot {i} is published and pending"));
            }
            if s.chain.len() * page_size != s.tokens.len() {
                return corrupt(format!(
                    "state slot {i}: {} pages for {} tokens",
                    s.chain.len(),
                    s.tokens.len()
                ));
            }
            for p in &s.chain {
                match needed.get_mut(p.0 as usize) {
                    Some(c) => *c += 1,
                    None => {
                        return corrupt(format!("state slot {i} needs page {p}, past the pool"))
                    }
                }
            }
            let last = s.chain.last().expect("published");
            if self.anchor[last.0 as usize] != i as u32 {
                return corrupt(format!(
                    "state slot {i} is not anchored at its last page {last}"
                ));
            }
            anchors += 1;
            let parent = self.nearest(&s.chain[..s.chain.len() - 1]);
            if s.parent != parent {
                return corrupt(format!(
                    "state slot {i}: its parent is slot {}, the deepest snapshot on its prefix {parent}",
                    s.parent
                ));
            }
            let listed = self.lru.get(&s.key) == Some(&(i as u32));
            if listed != (s.pins == 0) {
                return corrupt(format!("state slot {i}: in the LRU iff unpinned, broken"));
            }
            in_lru += listed as usize;
        }
        if needed != self.needed {
            return corrupt("the pages' snapshot counts disagree with the snapshots");
        }
        if self.anchor.iter().filter(|&&a| a != NONE).count() != anchors {
            return corrupt("a page is anchored to no snapshot");
        }
        if self.lru.len() != in_lru {
            return corrupt("the snapshots' LRU holds a slot that is not an unpinned snapshot");
        }
        Ok(())
    }

    /// Feeds the slots' decision-relevant state into `d`.
    pub fn digest(&self, d: &mut StateDigest) {
        d.word(self.snaps.len() as u64);
        d.word(self.level);
        for s in &self.snaps {
            match s {
                None => d.word(u64::MAX),
                Some(s) => {
                    d.word(s.pins as u64);
                    d.word(s.continued as u64);
                    d.word(s.base);
                    d.pages(&s.chain);
                }
            }
        }
        for (&(temp, _), &slot) in &self.lru {
            d.word(slot as u64);
            d.word(temp as u64);
        }
        d.word(self.free.len() as u64);
        for &s in &self.free {
            d.word(s as u64);
        }
    }

    /// Heap bytes of the slots' bookkeeping.
    pub fn heap_bytes(&self) -> usize {
        let snaps: usize = self
            .snaps
            .iter()
            .flatten()
            .map(|s| s.tokens.capacity() * 4 + s.chain.capacity() * 4)
            .sum();
        snaps
            + self.snaps.capacity() * std::mem::size_of::<Option<Snap>>()
            + (self.anchor.capacity() + self.needed.capacity() + self.free.capacity()) * 4
            + self.lru.len() * 40
    }
}
