//! `ContentMap`: a hash table from 64-bit content keys to pages, one cache line a probe.
//!
//! The block index asks it one question a page: which cached page holds this content? At a
//! million pages a general-purpose map (control bytes in one array, entries in another) costs two
//! cache misses a probe, and rehashing a million entries while it grows costs a million more.
//! This table is sized for the pool once, never grows, and keeps a whole entry in 8 bytes:
//!
//! ```text
//!   slot (u64):  [ tag: high 32 bits of the key | page + 1 ]      0 = empty
//!   home slot:   tag * 2^64/phi >> (64 - bits)                     linear probing from there
//! ```
//!
//! Several pages may share a tag (equal keys, or a 2^-32 chance); a lookup offers each candidate
//! to the caller, who compares the content exactly. Deletion shifts the probe run back (no
//! tombstones), so a table that sees a billion inserts and removes stays as fast as a fresh one.

use crate::arena::ids::{ArenaId, PageId};
use crate::error::{invalid, Result};

/// Fibonacci hashing's multiplier (2^64 / golden ratio).
const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

/// Content key -> pages, for at most `capacity` pages at once.
#[derive(Debug)]
pub struct ContentMap {
    slots: Vec<u64>,
    bits: u32,
    len: usize,
}

fn tag_of(key: u64) -> u32 {
    (key >> 32) as u32
}

impl ContentMap {
    /// A table for up to `capacity` entries, at most half full.
    pub fn try_new(capacity: usize) -> Result<Self> {
        let size = capacity.max(8).saturating_mul(2).next_power_of_two();
        let mut slots = Vec::new();
        if slots.try_reserve_exact(size).is_err() {
            return Err(invalid(format!(
                "cannot allocate the block map for {capacity} pages ({} bytes)",
                size as u128 * 8
            )));
        }
        slots.resize(size, 0);
        Ok(ContentMap {
            slots,
            bits: size.trailing_zeros(),
            len: 0,
        })
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn home(&self, tag: u32) -> usize {
        ((tag as u64).wrapping_mul(PHI) >> (64 - self.bits)) as usize
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The first page under `key` that `is_it` accepts.
    #[inline]
    pub fn find(&self, key: u64, mut is_it: impl FnMut(PageId) -> bool) -> Option<PageId> {
        let tag = tag_of(key);
        let mut i = self.home(tag);
        loop {
            let slot = self.slots[i];
            if slot == 0 {
                return None;
            }
            if (slot >> 32) as u32 == tag {
                let page = PageId::from_raw(slot as u32 - 1);
                if is_it(page) {
                    return Some(page);
                }
            }
            i = (i + 1) & self.mask();
        }
    }

    /// Loads the home slots of `keys`, all at once, so that the `find`s and `insert`s after it
    /// hit the cache: the loads are independent, so their misses overlap.
    #[inline]
    pub fn prefetch(&self, keys: impl Iterator<Item = u64>) {
        let mut acc = 0;
        for key in keys {
            acc ^= self.slots[self.home(tag_of(key))];
        }
        std::hint::black_box(acc);
    }

    /// Adds `page` under `key`. The caller keeps within the capacity (one entry a pool page).
    pub fn insert(&mut self, key: u64, page: PageId) {
        debug_assert!(self.len < self.slots.len() / 2, "table over capacity");
        let tag = tag_of(key);
        let mut i = self.home(tag);
        while self.slots[i] != 0 {
            i = (i + 1) & self.mask();
        }
        self.slots[i] = (tag as u64) << 32 | (page.raw() as u64 + 1);
        self.len += 1;
    }

    /// Removes `page`'s entry under `key`; returns whether it was there.
    pub fn remove(&mut self, key: u64, page: PageId) -> bool {
        let want = (tag_of(key) as u64) << 32 | (page.raw() as u64 + 1);
        let mask = self.mask();
        let mut i = self.home(tag_of(key));
        loop {
            match self.slots[i] {
                0 => return false,
                s if s == want => break,
                _ => i = (i + 1) & mask,
            }
        }
        // Backward shift: move later entries of the run into the hole when their home allows.
        // Whether an entry moves is a coin toss for the branch predictor, so both outcomes are
        // computed and selected (the hole is rewritten with its own value when it does not).
        let mut hole = i;
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let slot = self.slots[j];
            if slot == 0 {
                break;
            }
            let home = self.home((slot >> 32) as u32);
            // The entry at j may fill the hole when its home is not cyclically in (hole, j].
            let moves = (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask);
            // All ones when it moves, else zero: a select written as masks.
            let m = (moves as usize).wrapping_neg();
            let kept = self.slots[hole];
            self.slots[hole] = (slot & m as u64) | (kept & !(m as u64));
            hole = (j & m) | (hole & !m);
        }
        self.slots[hole] = 0;
        self.len -= 1;
        true
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts and removes against a HashMap of (key, page) -> (), keys drawn from a
    /// small set so that runs, equal tags and wrap-around at the table's end all happen.
    #[test]
    fn agrees_with_a_map_under_churn() {
        let mut t = ContentMap::try_new(64).unwrap();
        let mut model: HashMap<PageId, u64> = HashMap::new();
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut rand = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..200_000 {
            let page = PageId((rand() % 64) as u32);
            // 16 distinct keys, some sharing a tag: many pages per key and long probe runs.
            let key = (rand() % 8) << 32 | (rand() % 2);
            match model.get(&page).copied() {
                Some(k) => {
                    assert!(t.remove(k, page), "step {step}");
                    model.remove(&page);
                }
                None => {
                    t.insert(key, page);
                    model.insert(page, key);
                }
            }
            assert_eq!(t.len(), model.len());
            if step % 1000 == 0 {
                for (&p, &k) in &model {
                    assert_eq!(t.find(k, |q| q == p), Some(p), "step {step}");
                }
                assert_eq!(t.slots.iter().filter(|&&s| s != 0).count(), model.len());
            }
        }
        for (&p, &k) in &model {
            assert!(t.remove(k, p));
        }
        assert_eq!(t.len(), 0);
        assert!(t.slots.iter().all(|&s| s == 0));
    }

    #[test]
    fn missing_entries_are_not_removed() {
        let mut t = ContentMap::try_new(4).unwrap();
        t.insert(5 << 32, PageId(1));
        assert!(!t.remove(5 << 32, PageId(2)));
        assert!(!t.remove(6 << 32, PageId(1)));
        assert_eq!(t.find(5 << 32, |_| false), None);
        assert_eq!(t.find(5 << 32, |_| true), Some(PageId(1)));
        assert!(t.remove(5 << 32, PageId(1)));
        assert_eq!(t.len(), 0);
        assert_eq!(t.find(5 << 32, |_| true), None);
    }

    #[test]
    fn impossible_sizes_are_errors() {
        let e = ContentMap::try_new(usize::MAX / 4).unwrap_err();
        assert!(e.to_string().contains("block map"), "{e}");
    }
}
