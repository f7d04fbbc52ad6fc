//! The request life cycle, written once: [`Cache`] over any [`Index`], and [`PrefixCache`], the
//! object-safe interface the scheduler and the Python boundary use.

use crate::arena::ids::PageId;
use crate::cache::index::{Cursor, Index};
use crate::cache::request::{new_cache_id, Request, RequestId, RequestView, Requests};
use crate::cache::stats::{CacheStats, Counters};
use crate::cache::tier::PageCopy;
use crate::error::{invalid, Error, Result};
use crate::wire::events::CacheEvent;
use crate::wire::hash::{BlockHash, Namespace};
use std::borrow::Cow;

pub(crate) mod digest;
pub(crate) mod disk;
pub(crate) mod index;
mod prefix_cache;
pub(crate) mod request;
pub(crate) mod retention;
mod state_ops;
pub(crate) mod states;
pub(crate) mod stats;
pub(crate) mod tier;
mod window;
mod window_host;

use digest::StateDigest;
pub use prefix_cache::PrefixCache;
use window::hold_from;

/// A prefix cache: the life cycle of requests over the index `I`, a pool of `num_pages` pages,
/// and the counters. [`crate::RadixCache`] and [`crate::BlockCache`] are its two instances.
#[derive(Debug)]
pub struct Cache<I: Index> {
    index: I,
    num_pages: usize,
    requests: Requests<I::Ext>,
    counters: Counters,
    /// The clock retentions expire by, advanced by the owner (`set_time`).
    now: f64,
    /// Prefetches from disk in progress, by id.
    fetches: std::collections::BTreeMap<u64, Fetch>,
    next_fetch: u64,
    /// Advanced by `reset`: a prefetch started before a reset enters nothing.
    epoch: u64,
    /// The sliding-window layer group (no pages: none).
    window: window::Window,
    /// The state slots (none: hybrid off).
    states: states::States,
}

/// A prefetch from disk the owner is performing: read `slots[i]` (holding the page whose block
/// key is `keys[i]`) into host page `host[i]`; the pages are those of the prompt from token
/// `from` on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskFetch {
    /// Its id, for [`PrefixCache::disk_confirm`].
    pub id: u64,
    /// The first token of the first page read.
    pub from: usize,
    /// Disk slots to read, in prefix order.
    pub slots: Vec<u32>,
    /// The block key each slot must hold.
    pub keys: Vec<BlockHash>,
    /// Host pages (per tier) to read them into.
    pub host: Vec<u32>,
}

/// What a cache keeps of a prefetch in progress.
#[derive(Debug)]
struct Fetch {
    tokens: Vec<u32>,
    namespace: Namespace,
    from: usize,
    slots: Vec<u32>,
    keys: Vec<BlockHash>,
    host: Vec<PageId>,
    epoch: u64,
}

impl<I: Index> Cache<I> {
    /// A cache over `num_pages` pages of `page_size` tokens.
    pub fn new(num_pages: usize, page_size: usize) -> Result<Self> {
        Self::with_host(num_pages, page_size, 0)
    }

    /// A cache over `num_pages` device pages of `page_size` tokens and a host tier of
    /// `host_pages` pages (0: none), where evicted pages go and come back from on a hit.
    pub fn with_host(num_pages: usize, page_size: usize, host_pages: usize) -> Result<Self> {
        Self::with_tiers(num_pages, page_size, host_pages, 0)
    }

    /// A cache with a host tier of `host_pages` pages and, behind it, a disk tier of
    /// `disk_pages` slots (0: none; a disk tier needs a host tier: pages come back from disk
    /// into host pages).
    pub fn with_tiers(
        num_pages: usize,
        page_size: usize,
        host_pages: usize,
        disk_pages: usize,
    ) -> Result<Self> {
        check_pool_args(num_pages, page_size)?;
        check_host_args(num_pages, page_size, host_pages)?;
        if disk_pages > 0 && host_pages == 0 {
            return Err(invalid(format!(
                "disk_pages={disk_pages} needs a host tier: pages come back from disk through \
                 host pages, so pass host_pages > 0 as well"
            )));
        }
        if disk_pages > i32::MAX as usize {
            return Err(invalid(format!(
                "disk_pages must be below 2**31, got {disk_pages}"
            )));
        }
        let too_large = |e| {
            invalid(format!(
                "num_pages={num_pages} with page_size={page_size}, host_pages={host_pages} and \
                 disk_pages={disk_pages} is too large for this machine: {e}"
            ))
        };
        let mut index = I::new(num_pages, page_size, host_pages).map_err(too_large)?;
        index.tier_mut().disk = disk::Disk::new(disk_pages).map_err(too_large)?;
        Ok(Cache {
            index,
            num_pages,
            requests: Requests::new(new_cache_id()),
            counters: Counters::default(),
            now: 0.0,
            fetches: Default::default(),
            next_fetch: 1,
            epoch: 0,
            window: window::Window::new(0, 0, page_size, 0).map_err(too_large)?,
            states: states::States::default(),
        })
    }

    /// [`Cache::with_tiers`], and a window group of `window_pages` pages for layers with a
    /// sliding window of `window` tokens where both are above 0 (see [`Cache::with_window`]),
    /// whose cached pages go to a window host tier of `window_host_pages` pages when the pool
    /// needs room (0: none; it needs the full group's host tier). No disk tier with a window
    /// group in this version.
    pub fn with_groups(
        num_pages: usize,
        page_size: usize,
        host_pages: usize,
        disk_pages: usize,
        window: usize,
        window_pages: usize,
        window_host_pages: usize,
    ) -> Result<Self> {
        if window == 0 && window_pages == 0 {
            if window_host_pages > 0 {
                return Err(invalid(format!(
                    "window_host_pages={window_host_pages} needs a window group: pass window= \
                     and window_pages= as well"
                )));
            }
            return Self::with_tiers(num_pages, page_size, host_pages, disk_pages);
        }
        if disk_pages > 0 {
            return Err(invalid(format!(
                "a window group (window={window}) with a disk tier (disk_pages={disk_pages}) is \
                 not supported in this version: window pages do not reach the disk"
            )));
        }
        let c = Self::with_tiers(num_pages, page_size, host_pages, 0)?;
        Self::windowed(c, window, window_pages, window_host_pages)
    }

    /// The index, for the indexes' own unit tests.
    #[cfg(test)]
    pub(crate) fn index(&self) -> &I {
        &self.index
    }

    /// The index, mutably, for the indexes' own unit tests.
    #[cfg(test)]
    pub(crate) fn index_mut(&mut self) -> &mut I {
        &mut self.index
    }

    /// Admission of borrowed or owned tokens (see [`PrefixCache::admit`]).
    fn open(&mut self, tokens: Cow<'_, [u32]>, namespace: Namespace) -> Result<RequestId> {
        check_prompt(&tokens)?;
        let (p, n) = (self.index.page_size(), tokens.len());
        let (found, keys, cut, kv, hit) = if self.states.on() {
            let (found, kv, hit) = self.find_state(&tokens[..match_limit(n, p)], &namespace);
            (found, Vec::new(), 0, kv, hit)
        } else {
            let (found, keys, cut) = self.find(&tokens[..match_limit(n, p)], &namespace);
            (found, keys, cut, 0, None)
        };
        let (matched, host) = (found.matched, found.host);
        let needed = n.div_ceil(p) - matched / p;
        self.reserve(needed + host, found.evictable)?;
        if self.window.on() {
            let (pinned, loads) = self.window.hit_pages(&keys, matched / p);
            self.window.reserve(needed + loads, pinned)?;
        }
        // Nothing below can fail.
        let mut pages = Vec::with_capacity(n.div_ceil(p));
        let mut ext = self.index.pin(found, &namespace, &mut pages);
        if host == 0 {
            self.counters.evicted_pages += self.index.allocate(needed, &mut pages) as u64;
        } else {
            // One allocation: the matched host pages come back into its first pages.
            let mut fresh = Vec::with_capacity(host + needed);
            self.counters.evicted_pages += self.index.allocate(host + needed, &mut fresh) as u64;
            self.index.load(&mut ext, &mut pages, &fresh[..host]);
            pages.extend_from_slice(&fresh[host..]);
            self.counters.host_hit_tokens += (host * p) as u64;
        }
        self.counters.record_query(n, matched);
        let mut refs = states::StateRefs::default();
        if self.states.on() {
            self.sweep_states();
            if let Some(slot) = hit.filter(|_| matched > 0) {
                self.states.pin(slot);
                self.states.hit_tokens += matched as u64;
                refs.hit = Some(slot);
                refs.from = Some((matched, slot, self.states.serial(slot).expect("a hit")));
            }
            refs.kv_matched = kv;
        }
        let mut win = request::WindowPages::default();
        if self.window.on() {
            win = self
                .window
                .open(keys, matched / p, n.div_ceil(p), self.index.events());
            if cut > 0 {
                self.window.cut_hits += 1;
                self.window.cut_tokens += (cut * p) as u64;
            }
        }
        Ok(self.requests.insert(Request {
            tokens: tokens.into_owned(),
            namespace,
            pages,
            num_cached: matched,
            num_computed: matched,
            published: matched,
            ext,
            win,
            states: refs,
        }))
    }

    /// Closes `id`, publishing what it computed first when `publish`.
    fn release(&mut self, id: RequestId, publish: bool) -> Result<()> {
        let mut r = self.requests.remove(id)?;
        if publish {
            let upto = r.num_computed / self.index.page_size() * self.index.page_size();
            self.index.publish(&mut r, upto);
        }
        self.close_window(&mut r, publish);
        self.close_states(&mut r, publish);
        self.index.release(&r);
        Ok(())
    }

    /// The disk tier's own invariants, and that the prefetches in progress account for exactly
    /// the host pages taken and the slot pins.
    fn check_disk(&self) -> Result<()> {
        let tier = self.index.tier();
        tier.disk.check()?;
        let mut taken: Vec<PageId> = self.fetches.values().flat_map(|f| f.host.clone()).collect();
        taken.sort_unstable();
        let mut reserved = tier.reserved.clone();
        reserved.sort_unstable();
        if taken != reserved {
            return crate::error::corrupt(format!(
                "prefetches hold {} host pages, {} are taken for them",
                taken.len(),
                reserved.len()
            ));
        }
        if let Some(h) = reserved.iter().find(|h| h.0 as usize >= tier.host_pages) {
            return crate::error::corrupt(format!("prefetch host page {} is past the tier", h.0));
        }
        if reserved.windows(2).any(|w| w[0] == w[1]) {
            return crate::error::corrupt("a host page is taken by two prefetches");
        }
        Ok(())
    }

    /// Refuses an eviction class or a retention time out of range, or either one on an index
    /// that keeps none.
    fn check_keep(&self, class: u8, retain: f64) -> Result<()> {
        if class >= crate::cache::index::CLASSES {
            return Err(invalid(format!(
                "priority must be an eviction class from 0 to {}, got {class}",
                crate::cache::index::CLASSES - 1
            )));
        }
        if retain.is_nan() || retain < 0.0 {
            return Err(invalid(format!(
                "retain must be seconds >= 0 (or infinite), got {retain}"
            )));
        }
        if !self.index.retains() && (class != 0 || retain > 0.0) {
            return Err(invalid(
                "eviction classes and retention are kept by RadixCache only in this version"
                    .to_string(),
            ));
        }
        Ok(())
    }

    /// Fails with `OutOfPages` unless `needed` pages are free or evictable, not counting
    /// `pinned` evictable pages the call itself is about to pin.
    fn reserve(&self, needed: usize, pinned: usize) -> Result<()> {
        let available = self.index.free_pages() + self.index.evictable_pages() - pinned;
        if needed > available {
            return Err(Error::OutOfPages { needed, available });
        }
        Ok(())
    }
}

impl<I: Index> PrefixCache for Cache<I> {
    fn admit(&mut self, tokens: &[u32], namespace: Namespace) -> Result<RequestId> {
        self.open(Cow::Borrowed(tokens), namespace)
    }

    fn admit_owned(&mut self, tokens: Vec<u32>, namespace: Namespace) -> Result<RequestId> {
        self.open(Cow::Owned(tokens), namespace)
    }

    fn extend(&mut self, id: RequestId, tokens: &[u32]) -> Result<()> {
        let p = self.index.page_size();
        let r = self.requests.get(id)?;
        let needed = (r.tokens.len() + tokens.len()).div_ceil(p) - r.pages.len();
        self.reserve(needed, 0)?;
        if self.window.on() {
            self.window.reserve(needed, 0)?;
        }
        let r = self.requests.get_mut(id)?;
        self.counters.evicted_pages += self.index.allocate(needed, &mut r.pages) as u64;
        r.tokens.extend_from_slice(tokens);
        if self.window.on() {
            let log = self.index.events();
            self.window.grow(&mut r.win, r.pages.len(), log);
            Self::advance_window(&mut self.window, r, p, log);
        }
        self.sweep_states();
        Ok(())
    }

    fn commit(&mut self, id: RequestId, num_computed: usize) -> Result<()> {
        let p = self.index.page_size();
        let r = self.requests.get_mut(id)?;
        check_commit(num_computed, r.num_computed, r.tokens.len())?;
        r.num_computed = num_computed;
        self.index.publish(r, num_computed / p * p);
        Self::advance_window(&mut self.window, r, p, self.index.events());
        Self::publish_states(&mut self.states, &self.index, r);
        self.log_states();
        Ok(())
    }

    fn truncate(&mut self, id: RequestId, num_tokens: usize) -> Result<()> {
        let p = self.index.page_size();
        let r = self.requests.get_mut(id)?;
        if num_tokens < r.num_computed || num_tokens > r.tokens.len() {
            return Err(invalid(format!(
                "truncate: num_tokens must be from num_computed ({}) to num_tokens ({}), got \
                 {num_tokens}",
                r.num_computed,
                r.tokens.len()
            )));
        }
        if self.window.on() {
            // The window pages a request holds start where a hit at its last computed page
            // boundary below its last token reads; fewer tokens may move that boundary back, to
            // pages an earlier commit released (a commit up to the new length, then a truncate
            // to it): refused, nothing changed. A truncate before that commit keeps them.
            if num_tokens == 0 {
                return Err(invalid(
                    "truncate: a request of a cache with a window group keeps at least one token, \
                     got num_tokens 0"
                        .to_string(),
                ));
            }
            let from = hold_from(r.num_computed, num_tokens, p);
            let lo = self.window.first_needed(from).min(num_tokens.div_ceil(p));
            if lo < r.win.lo {
                return Err(invalid(format!(
                    "truncate: with a window group, num_tokens {num_tokens} would need window \
                     page {lo} again, which the commit to {} released: truncate before that \
                     commit",
                    r.num_computed
                )));
            }
        }
        r.tokens.truncate(num_tokens);
        let keep = num_tokens.div_ceil(p);
        let tail = r.pages.split_off(keep);
        self.index.free_private(&tail);
        if self.window.on() {
            self.window.truncate(&mut r.win, keep);
        }
        let gone: Vec<u32> = r
            .states
            .pending
            .iter()
            .filter(|&&(pos, _)| pos > num_tokens)
            .map(|&(_, s)| s)
            .collect();
        r.states.pending.retain(|&(pos, _)| pos <= num_tokens);
        for slot in gone {
            self.states.remove(slot);
        }
        self.log_states();
        Ok(())
    }

    fn continuation(&self, tokens: &[u32], namespace: &Namespace, max: usize) -> Vec<u32> {
        self.index.continuation(tokens, namespace, max)
    }

    fn finish(&mut self, id: RequestId) -> Result<()> {
        self.release(id, true)
    }

    fn abort(&mut self, id: RequestId) -> Result<()> {
        self.release(id, false)
    }

    fn finish_retained(&mut self, id: RequestId, class: u8, retain: f64) -> Result<u64> {
        self.check_keep(class, retain)?;
        self.requests.get(id)?;
        let mut r = self.requests.remove(id)?;
        let upto = r.num_computed / self.index.page_size() * self.index.page_size();
        self.index.publish(&mut r, upto);
        let until = (retain > 0.0).then_some(self.now + retain);
        let rid = self.index.retain(&r, class, until);
        self.close_window(&mut r, true);
        self.close_states(&mut r, true);
        self.index.release(&r);
        Ok(rid)
    }

    fn retain_prefix(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        class: u8,
        retain: f64,
    ) -> Result<(u64, usize)> {
        check_prompt(tokens)?;
        self.check_keep(class, retain)?;
        if class == 0 && retain == 0.0 {
            return Ok((0, 0));
        }
        let p = self.index.page_size();
        let whole = &tokens[..tokens.len() / p * p];
        let until = (retain > 0.0).then_some(self.now + retain);
        Ok(self.index.retain_prefix(whole, namespace, class, until))
    }

    fn release_retention(&mut self, retention: u64) -> bool {
        self.index.release_retention(retention)
    }

    fn set_time(&mut self, now: f64) -> Result<usize> {
        if now.is_nan() || now < self.now {
            return Err(invalid(format!(
                "now must not go back: the cache's clock is at {}, got {now}",
                self.now
            )));
        }
        self.now = now;
        Ok(self.index.expire(now))
    }

    fn now(&self) -> f64 {
        self.now
    }

    fn match_prefix(&self, tokens: &[u32], namespace: &Namespace) -> Result<usize> {
        check_prompt(tokens)?;
        let limit = match_limit(tokens.len(), self.index.page_size());
        if self.states.on() {
            return Ok(self.find_state(&tokens[..limit], namespace).0.matched);
        }
        Ok(self.find(&tokens[..limit], namespace).0.matched)
    }

    fn evict(&mut self, num_pages: usize) -> usize {
        let done = self.index.evict(num_pages);
        self.counters.evicted_pages += done as u64;
        self.sweep_states();
        done
    }

    fn reset(&mut self) -> usize {
        let mark = self.index.events().len();
        let host_before = self.index.tier().dropped;
        self.epoch += 1;
        self.index.tier_mut().disk.clear();
        let done = self.index.reset();
        self.counters.evicted_pages += done as u64;
        self.sweep_states();
        self.window.reset(self.index.events());
        let done = done + (self.index.tier().dropped - host_before) as usize;
        // With no live request nothing is pinned: the index is empty now.
        if done > 0 && self.index.events().on && self.requests.is_empty() {
            self.index.events().cleared_since(mark);
        }
        done
    }

    fn drain_copies(&mut self) -> Vec<PageCopy> {
        let mut copies = self.index.tier_mut().drain();
        copies.extend(self.window.host.drain());
        copies
    }

    fn drain_copies_keyed(&mut self) -> (Vec<PageCopy>, Vec<BlockHash>) {
        let (mut copies, keys) = self.index.tier_mut().drain_keyed();
        copies.extend(self.window.host.drain());
        (copies, keys)
    }

    fn host_pages(&self) -> usize {
        self.index.tier().host_pages
    }

    fn disk_pages(&self) -> usize {
        self.index.tier().disk.pages
    }

    fn window_host_pages(&self) -> usize {
        self.window.host.slots
    }

    fn window(&self) -> (usize, usize) {
        (self.window.window, self.window.pages)
    }

    fn disk_prefetch(&mut self, tokens: &[u32], namespace: Namespace) -> Result<Option<DiskFetch>> {
        check_prompt(tokens)?;
        if !self.index.tier().disk.on() {
            return Err(invalid(
                "the cache has no disk tier (disk_pages=0): nothing to prefetch",
            ));
        }
        if self.index.tier().disk.held() == 0 {
            return Ok(None); // nothing to find: no lookup, no hashing
        }
        let p = self.index.page_size();
        let limit = match_limit(tokens.len(), p);
        let found = self.index.lookup(&tokens[..limit], &namespace);
        let (from, on_host) = (found.matched, found.host);
        // The match's own host pages stay on the host while the rest comes back beside them
        // (an admission loads them all at once): at most this many pages can come back.
        let room = self.index.tier().host_pages.saturating_sub(on_host);
        if from == limit || room == 0 {
            return Ok(None);
        }
        let keys = crate::wire::hash::block_hashes(&tokens[..limit], p, &namespace);
        let disk = &self.index.tier().disk;
        let mut slots = Vec::new();
        for key in &keys[from / p..] {
            match disk.find(key) {
                Some(s) if slots.len() < room => slots.push(s),
                _ => break,
            }
        }
        if slots.is_empty() {
            return Ok(None);
        }
        // Pinned before host pages are taken: the host pages dropped to make room go to disk,
        // and must not take these slots.
        for &s in &slots {
            self.index.tier_mut().disk.pin(s);
        }
        // Made the most recently used, the match's host pages are the last the host tier
        // would drop, and `room` leaves enough others to drop before them.
        self.index.touch_host(&tokens[..from], &namespace);
        let mut host = Vec::with_capacity(slots.len());
        self.index.take_host(slots.len(), &mut host);
        for &s in &slots[host.len()..] {
            self.index.tier_mut().disk.unpin(s);
        }
        slots.truncate(host.len());
        if slots.is_empty() {
            return Ok(None);
        }
        let end = from / p + slots.len();
        let keys = keys[from / p..end].to_vec();
        self.index.tier_mut().reserved.extend_from_slice(&host);
        let id = self.next_fetch;
        self.next_fetch += 1;
        let view = DiskFetch {
            id,
            from,
            slots: slots.clone(),
            keys: keys.clone(),
            host: host.iter().map(|h| h.0).collect(),
        };
        self.fetches.insert(
            id,
            Fetch {
                tokens: tokens[..end * p].to_vec(),
                namespace,
                from,
                slots,
                keys,
                host,
                epoch: self.epoch,
            },
        );
        Ok(Some(view))
    }

    fn disk_confirm(&mut self, id: u64, good: usize, bad: bool) -> Result<usize> {
        let Some(f) = self.fetches.get(&id) else {
            return Err(invalid(format!("no prefetch {id} is in progress")));
        };
        if good > f.slots.len() || (bad && good == f.slots.len()) {
            return Err(invalid(format!(
                "good must be at most the prefetch's {} pages (and below it with bad=True), got \
                 {good}",
                f.slots.len()
            )));
        }
        let f = self.fetches.remove(&id).expect("checked above");
        let tier = self.index.tier_mut();
        tier.reserved.retain(|h| !f.host.contains(h));
        if bad {
            tier.disk.drop_bad(f.slots[good], &f.keys[good]);
        }
        for &s in &f.slots {
            tier.disk.unpin(s);
        }
        if f.epoch != self.epoch {
            self.index.free_host(&f.host);
            return Ok(0);
        }
        let used = self
            .index
            .adopt(&f.tokens, &f.namespace, f.from, &f.host[..good]);
        self.index.free_host(&f.host[good..]);
        self.index.tier_mut().disk.fetched += used as u64;
        Ok(used)
    }

    fn disk_persist(&mut self) -> usize {
        if !self.index.tier().disk.on() {
            return 0;
        }
        let before = self.index.tier().pending();
        self.index.persist();
        self.index.tier().pending() - before
    }

    fn disk_entries(&self) -> Vec<(BlockHash, u32)> {
        self.index.tier().disk.entries()
    }

    fn disk_restore(&mut self, entries: &[(BlockHash, u32)]) -> Result<()> {
        if !self.index.tier().disk.on() && !entries.is_empty() {
            return Err(invalid(
                "the cache has no disk tier (disk_pages=0) to restore entries into",
            ));
        }
        self.index.tier_mut().disk.restore(entries)
    }

    fn evicted_pages(&self) -> u64 {
        self.counters.evicted_pages
    }

    fn take_state(&mut self, id: RequestId, pos: usize) -> Result<Option<u32>> {
        self.take_state_at(id, pos)
    }

    fn release_state(&mut self, id: RequestId) -> Result<bool> {
        self.release_state_of(id)
    }

    fn evict_state(&mut self, slot: u32) -> Result<bool> {
        self.evict_state_at(slot)
    }

    fn drain_freed_states(&mut self) -> Vec<u32> {
        self.states.drain_freed()
    }

    fn state_snapshots(&self) -> Vec<(u32, Vec<u32>, Namespace)> {
        self.states
            .published()
            .map(|(s, t, ns)| (s, t.to_vec(), ns.clone()))
            .collect()
    }

    fn stats(&self) -> CacheStats {
        let (free, evictable) = (self.index.free_pages(), self.index.evictable_pages());
        let (retentions, forced_evictions, expired_retentions) = self.index.retention_counts();
        let tier = self.index.tier();
        let (state_slots, state_free_slots, state_pinned_slots, state_hit_tokens, taken, evicted) =
            self.states.counts();
        CacheStats {
            state_slots,
            state_free_slots,
            state_pinned_slots,
            state_hit_tokens,
            taken_states: taken,
            evicted_states: evicted,
            host_pages: tier.host_pages,
            host_free_pages: self.index.host_free_pages(),
            offloaded_pages: tier.offloaded,
            loaded_pages: tier.loaded,
            host_evicted_pages: tier.dropped,
            disk_pages: tier.disk.pages,
            disk_free_pages: tier.disk.free_slots(),
            disk_written_pages: tier.disk.written,
            disk_fetched_pages: tier.disk.fetched,
            disk_evicted_pages: tier.disk.dropped,
            disk_bad_pages: tier.disk.bad,
            window: self.window.window,
            window_pages: self.window.pages,
            window_free_pages: self.window.free_pages(),
            window_evictable_pages: self.window.evictable_pages(),
            window_cut_hits: self.window.cut_hits,
            window_cut_tokens: self.window.cut_tokens,
            window_evicted_pages: self.window.evicted,
            window_host_used_pages: self.window.host.len(),
            window_offloaded_pages: self.window.host.offloaded,
            window_loaded_pages: self.window.host.loaded,
            retentions,
            forced_evictions,
            expired_retentions,
            ..self
                .counters
                .snapshot(self.num_pages, self.index.page_size(), free, evictable)
        }
    }

    fn check(&self) -> Result<()> {
        let p = self.index.page_size();
        for r in self.requests.iter() {
            if r.pages.len() != r.tokens.len().div_ceil(p)
                || r.published % p != 0
                || r.published > r.num_computed
                || r.num_computed > r.tokens.len()
            {
                return crate::error::corrupt(
                    "a request's page table or published count is malformed",
                );
            }
        }
        self.index.check(&self.requests, self.num_pages)?;
        self.check_disk()?;
        self.check_states()?;
        if self.window.on() {
            self.window.check(self.requests.iter().map(|r| {
                let from = hold_from(r.num_computed, r.tokens.len(), p);
                (&r.win, r.pages.len(), r.published / p, from)
            }))?;
        } else if self.requests.iter().any(|r| !r.win.pages.is_empty()) {
            return crate::error::corrupt("a request holds window pages without a window group");
        }
        if self.counters.hit_tokens > self.counters.query_tokens
            || self.counters.host_hit_tokens > self.counters.hit_tokens
        {
            return crate::error::corrupt(
                "more hit tokens than query tokens, or host hits than hits",
            );
        }
        Ok(())
    }

    fn request(&self, id: RequestId) -> Result<RequestView<'_>> {
        Ok(self.requests.get(id)?.view(self.index.page_size()))
    }

    fn metadata_bytes(&self) -> usize {
        self.index.metadata_bytes()
            + self.index.tier().heap_bytes()
            + self.window.heap_bytes()
            + self.states.heap_bytes()
    }

    fn page_size(&self) -> usize {
        self.index.page_size()
    }

    fn cursor(&self, namespace: &Namespace) -> Cursor {
        self.index.cursor(namespace)
    }

    fn advance(&self, cursor: &mut Cursor, tokens: &[u32]) -> bool {
        self.index.advance(cursor, tokens)
    }

    fn record_events(&mut self, on: bool) {
        self.index.events().set(on);
        self.states.record = on && self.states.on();
        self.states.drain_changes();
    }

    fn drain_events(&mut self) -> Vec<CacheEvent> {
        self.index.events().drain()
    }

    fn state_digest(&self) -> u64 {
        let mut d = StateDigest::default();
        d.word(self.num_pages as u64);
        d.word(self.index.page_size() as u64);
        if self.index.tier().on() {
            // Without a tier the digest is what it was before tiers existed.
            d.word(self.index.tier().host_pages as u64);
            d.word(self.index.host_free_pages() as u64);
        }
        if self.index.tier().disk.on() {
            self.index.tier().disk.digest(&mut d);
            d.word(self.fetches.len() as u64);
            for (id, f) in &self.fetches {
                d.word(*id);
                d.pages(&f.host);
            }
        }
        if self.window.on() {
            // Without a window group the digest is what it was before groups existed.
            self.window.digest(&mut d);
        }
        if self.states.on() {
            // Without state slots the digest is what it was before them.
            self.states.digest(&mut d);
        }
        d.word(self.index.free_pages() as u64);
        d.word(self.index.evictable_pages() as u64);
        self.index.digest(&mut d);
        // Live requests in slot order (slots are reused last freed first, the same everywhere).
        d.word(self.requests.len() as u64);
        for r in self.requests.iter() {
            d.namespace(&r.namespace);
            d.word(r.tokens.len() as u64);
            d.word(r.num_cached as u64);
            d.word(r.num_computed as u64);
            d.word(r.published as u64);
            d.pages(&r.pages);
            if self.window.on() {
                d.word(r.win.lo as u64);
                for &w in &r.win.pages[r.win.lo..] {
                    d.word(w as u64);
                }
            }
        }
        d.finish()
    }
}

/// Checks the pool arguments shared by both caches.
pub(crate) fn check_pool_args(num_pages: usize, page_size: usize) -> Result<()> {
    if num_pages == 0 {
        return Err(invalid("num_pages must be at least 1, got 0"));
    }
    if num_pages > i32::MAX as usize {
        return Err(invalid(format!(
            "num_pages must be below 2**31, got {num_pages}"
        )));
    }
    if page_size == 0 {
        return Err(invalid("page_size must be at least 1, got 0"));
    }
    if page_size > 1 << 16 {
        return Err(invalid(format!(
            "page_size must be at most 65536, got {page_size}"
        )));
    }
    // Slots are `page * page_size + offset`, handed out as int64.
    let slots = num_pages.checked_mul(page_size);
    if !matches!(slots, Some(s) if s <= i64::MAX as usize) {
        return Err(invalid(format!(
            "num_pages * page_size must fit in int64, got {num_pages} * {page_size}"
        )));
    }
    Ok(())
}

/// Checks the host tier's size against the pool's.
fn check_host_args(num_pages: usize, page_size: usize, host_pages: usize) -> Result<()> {
    if num_pages.saturating_add(host_pages) > i32::MAX as usize {
        return Err(invalid(format!(
            "num_pages + host_pages must be below 2**31, got {num_pages} + {host_pages}"
        )));
    }
    let slots = host_pages.checked_mul(page_size);
    if !matches!(slots, Some(s) if s <= i64::MAX as usize) {
        return Err(invalid(format!(
            "host_pages * page_size must fit in int64, got {host_pages} * {page_size}"
        )));
    }
    Ok(())
}

/// Checks a prompt.
fn check_prompt(tokens: &[u32]) -> Result<()> {
    if tokens.is_empty() {
        return Err(invalid(
            "tokens must hold at least one token, got an empty sequence",
        ));
    }
    Ok(())
}

/// Checks that a batch names each request once.
fn check_distinct(ids: impl Iterator<Item = RequestId>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (i, id) in ids.enumerate() {
        if !seen.insert(id) {
            return Err(invalid(format!(
                "requests must be distinct, but entry {i} repeats an earlier request"
            )));
        }
    }
    Ok(())
}

/// Checks a `commit` target against a request.
fn check_commit(num_computed: usize, current: usize, num_tokens: usize) -> Result<()> {
    if num_computed > num_tokens {
        return Err(invalid(format!(
            "num_computed must be at most num_tokens ({num_tokens}), got {num_computed}"
        )));
    }
    if num_computed < current {
        return Err(invalid(format!(
            "num_computed must not decrease (it is {current}), got {num_computed}"
        )));
    }
    Ok(())
}

/// The most tokens a match may cover: at least one token is left to compute, whole pages only.
pub(crate) fn match_limit(num_tokens: usize, page_size: usize) -> usize {
    (num_tokens - 1) / page_size * page_size
}
