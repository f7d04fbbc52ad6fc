//! The request life cycle's part in the state slots (see `states.rs`): where an admission's hit
//! ends, taking and publishing snapshots, and the pages' drops reaching the snapshots.
//!
//! ```text
//!   admit:   lookup -> KV match m pages -> cut at the last snapshot k <= m -> pin k pages and
//!            the snapshot; the request reports num_cached = k*P, kv_matched = m*P, state_slot
//!   take_state(req, pos)   a slot for the request's state at pos, pending (not findable)
//!   commit / finish        pages published up to `published`: pending snapshots at or before
//!                          it are published, anchored at the index's page ending their prefix
//!   finish                 the deepest one published supersedes the request's earlier ones
//!                          (cold) and the one its hit continued from (cool)
//!   evict / allocate       every snapshot needing a dropped page goes (slot freed)
//! ```

use crate::arena::ids::PageId;
use crate::cache::index::{Found, Index};
use crate::cache::request::{Request, RequestId};
use crate::cache::states::{States, Temp};
use crate::cache::Cache;
use crate::error::{corrupt, invalid, Result};
use crate::wire::hash::Namespace;

impl<I: Index> Cache<I> {
    /// Gives the cache `slots` state slots (0: none, the cache as without them). Refused with a
    /// disk tier or a window group, which this version does not combine with snapshots, and
    /// once anything was admitted.
    pub fn with_state_slots(mut self, slots: usize) -> Result<Self> {
        if slots == 0 {
            return Ok(self);
        }
        if slots > i32::MAX as usize {
            return Err(invalid(format!(
                "state_slots must be below 2**31, got {slots}"
            )));
        }
        if self.index.tier().disk.on() {
            return Err(invalid(format!(
                "state_slots={slots} with a disk tier (disk_pages={}) is not supported in this \
                 version: snapshots are not persisted",
                self.index.tier().disk.pages
            )));
        }
        if self.window.on() {
            return Err(invalid(format!(
                "state_slots={slots} with a window group (window={}) is not supported in this \
                 version",
                self.window.window
            )));
        }
        self.states = States::new(slots, self.num_pages).map_err(|e| {
            invalid(format!(
                "state_slots={slots} is too large for this machine: {e}"
            ))
        })?;
        self.index.drops().on = true;
        Ok(self)
    }

    /// With state slots: the lookup of `tokens`, cut back to the longest prefix that ends where
    /// a snapshot is; also the tokens the KV match ran to and the snapshot's slot.
    pub(crate) fn find_state(
        &self,
        tokens: &[u32],
        namespace: &Namespace,
    ) -> (Found<I::At>, usize, Option<u32>) {
        let found = self.index.lookup(tokens, namespace);
        let kv = found.matched;
        if kv == 0 {
            return (found, 0, None);
        }
        let mut pages = Vec::with_capacity(kv / self.index.page_size());
        self.index.found_pages(&found, &mut pages);
        let (k, slot) = self.states.cut(&pages);
        if k == pages.len() {
            return (found, kv, slot);
        }
        let p = self.index.page_size();
        (self.index.lookup(&tokens[..k * p], namespace), kv, slot)
    }

    /// The index's device pages of `tokens` (a whole number of pages), or `None` where the
    /// index does not hold them all on the device.
    fn chain_of(&self, tokens: &[u32], namespace: &Namespace) -> Option<Vec<PageId>> {
        let found = self.index.lookup(tokens, namespace);
        if found.matched != tokens.len() || found.host > 0 {
            return None;
        }
        let mut pages = Vec::with_capacity(tokens.len() / self.index.page_size());
        self.index.found_pages(&found, &mut pages);
        Some(pages)
    }

    /// Evicts the snapshots that needed the pages the index dropped since the last call.
    pub(crate) fn sweep_states(&mut self) {
        if self.states.on() {
            let drops = std::mem::take(&mut self.index.drops().pages);
            self.states.dropped(&drops);
            self.log_states();
        }
    }

    /// Moves the snapshots published and removed since the last call into the event log
    /// (recorded only while events are), after the page events of the same operation: a
    /// snapshot is announced after its pages, and its removal after theirs.
    pub(crate) fn log_states(&mut self) {
        let changes = self.states.drain_changes();
        if changes.is_empty() {
            return;
        }
        let p = self.index.page_size();
        let log = self.index.events();
        for (stored, tokens, namespace) in changes {
            if stored {
                log.state_stored(&namespace, &tokens, p);
            } else {
                log.state_removed(&namespace, &tokens, p);
            }
        }
    }

    /// Publishes the pending snapshots of `r` at or before its published pages.
    pub(crate) fn publish_states(states: &mut States, index: &I, r: &mut Request<I::Ext>) {
        if r.states.pending.is_empty() {
            return;
        }
        let published = r.published;
        let (mut ready, later): (Vec<_>, Vec<_>) = std::mem::take(&mut r.states.pending)
            .into_iter()
            .partition(|&(pos, _)| pos <= published);
        r.states.pending = later;
        ready.sort_unstable();
        for (pos, slot) in ready {
            let found = index.lookup(&r.tokens[..pos], &r.namespace);
            let mut chain = Vec::new();
            if found.matched == pos && found.host == 0 {
                index.found_pages(&found, &mut chain);
            }
            let serial = states.serial(slot).expect("a pending snapshot");
            if chain.is_empty() {
                states.remove(slot); // unreachable: the request pins its published pages
            } else if states.publish(slot, chain) {
                r.states.own.push((pos, slot, serial));
            }
        }
    }

    /// A closing request's part: its hit's pin dropped; its pending snapshots published where
    /// its pages are (`publish`), the rest freed; with them published, the snapshots its
    /// deepest one supersedes.
    pub(crate) fn close_states(&mut self, r: &mut Request<I::Ext>, publish: bool) {
        if let Some(h) = r.states.hit.take() {
            self.states.unpin(h);
        }
        if publish {
            Self::publish_states(&mut self.states, &self.index, r);
            let own = std::mem::take(&mut r.states.own);
            if let Some(&(deepest, _, _)) = own.iter().max() {
                for &(_, slot, serial) in own.iter().filter(|&&(at, _, _)| at < deepest) {
                    self.states.superseded(slot, serial, Temp::Cold);
                }
                if let Some((_, slot, serial)) = r.states.from.filter(|f| f.0 < deepest) {
                    self.states.superseded(slot, serial, Temp::Cool);
                }
            }
        }
        for (_, slot) in std::mem::take(&mut r.states.pending) {
            self.states.remove(slot);
        }
        self.log_states();
    }

    /// See [`crate::PrefixCache::take_state`].
    pub(crate) fn take_state_at(&mut self, id: RequestId, pos: usize) -> Result<Option<u32>> {
        let p = self.index.page_size();
        let r = self.requests.get(id)?;
        if !self.states.on() {
            return Err(invalid(
                "take_state: the cache has no state slots (state_slots=0)",
            ));
        }
        if pos == 0 || pos % p != 0 || pos > r.tokens.len() {
            return Err(invalid(format!(
                "take_state: pos must be a multiple of page_size ({p}) from {p} to num_tokens \
                 ({}), got {pos}",
                r.tokens.len()
            )));
        }
        if r.states.pending.iter().any(|&(at, _)| at == pos) {
            return Ok(None);
        }
        if pos <= r.published {
            match self.chain_of(&r.tokens[..pos], &r.namespace) {
                Some(chain) if !self.states.anchored(*chain.last().expect("pos > 0")) => {}
                _ => return Ok(None), // a snapshot is there already
            }
        }
        let r = self.requests.get(id)?;
        let junction = pos <= r.states.kv_matched;
        let Some(slot) = self.states.take(&r.tokens[..pos], &r.namespace, junction) else {
            return Ok(None);
        };
        self.requests.get_mut(id)?.states.pending.push((pos, slot));
        self.log_states(); // the snapshot a slot was taken from
        Ok(Some(slot))
    }

    /// See [`crate::PrefixCache::evict_state`].
    pub(crate) fn evict_state_at(&mut self, slot: u32) -> Result<bool> {
        if slot as usize >= self.states.slots() {
            return Err(invalid(format!(
                "evict_state: slot must be below state_slots ({}), got {slot}",
                self.states.slots()
            )));
        }
        let done = self.states.evict(slot);
        self.log_states();
        Ok(done)
    }

    /// See [`crate::PrefixCache::release_state`].
    pub(crate) fn release_state_of(&mut self, id: RequestId) -> Result<bool> {
        let r = self.requests.get_mut(id)?;
        match r.states.hit.take() {
            Some(h) => {
                self.states.unpin(h);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The slots' own invariants, and that every published snapshot's pages are in the index,
    /// on the device, where its prefix leads.
    pub(crate) fn check_states(&self) -> Result<()> {
        if !self.states.on() {
            if self
                .requests
                .iter()
                .any(|r| r.states.hit.is_some() || !r.states.pending.is_empty())
            {
                return corrupt("a request holds state slots without state slots");
            }
            return Ok(());
        }
        let p = self.index.page_size();
        self.states
            .check(p, self.requests.iter().map(|r| &r.states))?;
        for (slot, tokens, namespace) in self.states.published() {
            match self.chain_of(tokens, namespace) {
                Some(chain) if chain == self.states.chain(slot) => {}
                _ => {
                    return corrupt(format!(
                        "state slot {slot}: the pages of its {} tokens are not all in the index",
                        tokens.len()
                    ))
                }
            }
        }
        for r in self.requests.iter() {
            if r.states
                .pending
                .iter()
                .any(|&(pos, _)| pos > r.tokens.len())
            {
                return corrupt("a pending snapshot is past its request's tokens");
            }
        }
        Ok(())
    }
}
