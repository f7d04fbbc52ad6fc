//! The live retentions of an index, by id, and the counters both indexes report of them. What
//! one retention holds is the index's own (a node of the tree, the pages of a chain); the rules
//! are in `radix/retain.rs` and `block/retain.rs`.

use crate::cache::digest::StateDigest;
use std::collections::BTreeMap;

/// One live retention: what it holds, until the cache's clock passes `until` (infinite: until
/// released).
#[derive(Debug, Clone)]
pub struct Held<T> {
    pub held: T,
    pub until: f64,
}

/// Live retentions by id (ids from 1, in the order they were made), and the counters.
#[derive(Debug)]
pub struct Retentions<T> {
    live: BTreeMap<u64, Held<T>>,
    next: u64,
    /// Device pages evicted (dropped or moved to the host) while retained.
    pub forced_pages: u64,
    /// Retentions that expired.
    pub expired: u64,
}

impl<T> Default for Retentions<T> {
    fn default() -> Self {
        Retentions {
            live: BTreeMap::new(),
            next: 1,
            forced_pages: 0,
            expired: 0,
        }
    }
}

impl<T> Retentions<T> {
    /// A new retention of `held` until `until`; returns its id.
    pub fn insert(&mut self, held: T, until: f64) -> u64 {
        let rid = self.next;
        self.next += 1;
        self.live.insert(rid, Held { held, until });
        rid
    }

    pub fn remove(&mut self, rid: u64) -> Option<Held<T>> {
        self.live.remove(&rid)
    }

    pub fn get(&self, rid: u64) -> Option<&Held<T>> {
        self.live.get(&rid)
    }

    pub fn get_mut(&mut self, rid: u64) -> Option<&mut Held<T>> {
        self.live.get_mut(&rid)
    }

    /// In id order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, &Held<T>)> {
        self.live.iter().map(|(&rid, h)| (rid, h))
    }

    /// The ids of the retentions whose time is up at `now`, in id order.
    pub fn due(&self, now: f64) -> Vec<u64> {
        self.iter()
            .filter(|(_, h)| h.until <= now)
            .map(|(rid, _)| rid)
            .collect()
    }

    /// Live retentions, forced pages, expired retentions (`Index::retention_counts`).
    pub fn counts(&self) -> (usize, u64, u64) {
        (self.live.len(), self.forced_pages, self.expired)
    }

    /// Feeds every live retention into `d`: its id, its time, and what `held` says it holds.
    pub fn digest(&self, d: &mut StateDigest, held: impl Fn(&T, &mut StateDigest)) {
        d.word(self.live.len() as u64);
        for (rid, h) in self.iter() {
            d.word(rid);
            d.word(h.until.to_bits());
            held(&h.held, d);
        }
    }
}
