//! The disk tier's index, shared by both caches: which block key each disk slot holds, which
//! slots are free, and the order in which held slots are dropped to make room.
//!
//! Disk pages are found by their block key (`h_i` of DESIGN.md's `radixkv.block.v1`), not by a
//! place in the radix tree or the block map: a key names a page's namespace and its whole prefix,
//! it is the same in every process, and it is 256 bits of blake3, so a directory written by one
//! process is found again by the next and nobody can construct a key that collides. The radix
//! tree computes the keys of the pages it spills (it already keeps them for KV events); the block
//! index has them in its records.
//!
//! ```text
//!   host tier drops a page  ->  store(key): a held key is touched; else FREE's front slot, else
//!                               LRU's front (its key dropped): a spill copy is logged
//!   prefetch(prompt)        ->  the prompt's keys past the memory match, while held: slots
//!                               pinned (out of LRU) until the owner confirms the read
//! ```
//!
//! The copies themselves (host page -> disk slot, disk slot -> host page) are the owner's: the
//! core never touches a file.

use crate::arena::ids::PageId;
use crate::arena::links::{Links, ListId};
use crate::cache::digest::StateDigest;
use crate::error::{corrupt, invalid, Result};
use crate::wire::hash::BlockHash;
use std::collections::HashMap;

/// Slots holding nothing, reused front first.
const FREE: ListId = ListId(0);
/// Slots holding a key and pinned by no prefetch, least recently stored or read at the front.
const LRU: ListId = ListId(1);

/// The disk tier's slots and keys (`pages == 0`: no tier).
#[derive(Debug)]
pub struct Disk {
    /// Slots of the tier.
    pub pages: usize,
    map: HashMap<BlockHash, u32>,
    /// The key each slot holds, where `live`.
    keys: Vec<BlockHash>,
    live: Vec<bool>,
    /// Prefetches in progress reading each slot; a pinned slot is on no list.
    pins: Vec<u32>,
    lists: Links<PageId>,
    /// Pages written to the tier so far (spilled from the host, or persisted).
    pub written: u64,
    /// Pages read back into the host tier so far (confirmed good).
    pub fetched: u64,
    /// Held slots dropped so far (to make room, or by `clear`).
    pub dropped: u64,
    /// Pages the owner found torn or corrupted when reading them (dropped, never served).
    pub bad: u64,
}

impl Disk {
    /// A tier of `pages` slots, every one free (front to back: `pages - 1, ..., 1, 0`: pages
    /// are stored a path's tail first, so they take decreasing slots and a path reads back
    /// from increasing ones).
    pub fn new(pages: usize) -> Result<Self> {
        let mut lists = Links::try_new(2, pages)?;
        for s in (0..pages as u32).rev() {
            lists.push_back(FREE, PageId(s));
        }
        Ok(Disk {
            pages,
            map: HashMap::new(),
            keys: crate::error::try_vec(pages, [0u8; 32])?,
            live: crate::error::try_vec(pages, false)?,
            pins: crate::error::try_vec(pages, 0)?,
            lists,
            written: 0,
            fetched: 0,
            dropped: 0,
            bad: 0,
        })
    }

    /// Whether there is a disk tier.
    #[inline]
    pub fn on(&self) -> bool {
        self.pages > 0
    }

    /// Slots holding nothing.
    pub fn free_slots(&self) -> usize {
        self.lists.len(FREE)
    }

    /// Slots holding a key.
    pub fn held(&self) -> usize {
        self.map.len()
    }

    /// The slot holding `key`, if any.
    pub fn find(&self, key: &BlockHash) -> Option<u32> {
        self.map.get(key).copied()
    }

    /// A slot for the page whose key is `key`, about to be written: `None` when the tier holds
    /// the key already (the slot is touched: its page is the same bytes) or when every slot is
    /// pinned; else FREE's front, or LRU's front with its key dropped.
    pub fn store(&mut self, key: &BlockHash) -> Option<u32> {
        if let Some(&s) = self.map.get(key) {
            if self.pins[s as usize] == 0 {
                self.lists.remove(LRU, PageId(s));
                self.lists.push_back(LRU, PageId(s));
            }
            return None;
        }
        let s = match self.lists.pop_front(FREE) {
            Some(s) => s.0,
            None => {
                let s = self.lists.pop_front(LRU)?.0;
                self.map.remove(&self.keys[s as usize]);
                self.dropped += 1;
                s
            }
        };
        self.map.insert(*key, s);
        self.keys[s as usize] = *key;
        self.live[s as usize] = true;
        self.lists.push_back(LRU, PageId(s));
        self.written += 1;
        Some(s)
    }

    /// [`Disk::store`] for the pages of one run (`keys` in page order), from the last page to
    /// the first, so that the run's tail is the least recently used; with FREE handing out
    /// slots from the top down, the run's new pages take increasing slots along it (and so do
    /// a path's pages stored a run at a time, deepest first): read back, a run is one read of
    /// consecutive slots. `None` where the tier holds the key already. The writes must be
    /// performed in that order too (tail first): a run longer than the tier's unpinned slots
    /// reuses its own slots, and the page stored last in a slot is the one it holds.
    pub fn store_run(&mut self, keys: &[BlockHash]) -> Vec<Option<u32>> {
        let mut out: Vec<Option<u32>> = keys.iter().rev().map(|k| self.store(k)).collect();
        out.reverse();
        out
    }

    /// Keeps slot `s` (holding a key) from being dropped until [`Disk::unpin`].
    pub fn pin(&mut self, s: u32) {
        let i = s as usize;
        if self.pins[i] == 0 {
            self.lists.remove(LRU, PageId(s));
        }
        self.pins[i] += 1;
    }

    /// Drops one pin of `s`; unpinned, it is the most recently used slot (or a free one, if it
    /// was dropped meanwhile).
    pub fn unpin(&mut self, s: u32) {
        let i = s as usize;
        self.pins[i] -= 1;
        if self.pins[i] == 0 {
            if self.live[i] {
                self.lists.push_back(LRU, PageId(s));
            } else {
                self.lists.push_front(FREE, PageId(s));
            }
        }
    }

    /// Drops the key of slot `s` if it still holds `key` (a page the owner found bad, counted in
    /// `bad`); the slot is free once no prefetch pins it.
    pub fn drop_bad(&mut self, s: u32, key: &BlockHash) {
        if self.map.get(key) != Some(&s) {
            return;
        }
        self.bad += 1;
        self.unmap(s);
    }

    fn unmap(&mut self, s: u32) {
        let i = s as usize;
        self.map.remove(&self.keys[i]);
        self.live[i] = false;
        self.keys[i] = [0; 32];
        if self.pins[i] == 0 {
            self.lists.remove(LRU, PageId(s));
            self.lists.push_front(FREE, PageId(s));
        }
    }

    /// Drops every key (a `reset`: what the disk holds is as stale as the rest); returns how many.
    pub fn clear(&mut self) -> usize {
        let held: Vec<u32> = (0..self.pages as u32)
            .filter(|&s| self.live[s as usize])
            .collect();
        for &s in &held {
            self.unmap(s);
        }
        self.dropped += held.len() as u64;
        held.len()
    }

    /// Every held `(key, slot)`, least recently used first (pinned slots last, by slot).
    pub fn entries(&self) -> Vec<(BlockHash, u32)> {
        let mut out: Vec<(BlockHash, u32)> = self
            .lists
            .iter(LRU)
            .map(|s| (self.keys[s.0 as usize], s.0))
            .collect();
        out.extend(
            (0..self.pages as u32)
                .filter(|&s| self.live[s as usize] && self.pins[s as usize] > 0)
                .map(|s| (self.keys[s as usize], s)),
        );
        out
    }

    /// Fills an empty tier with `entries` (least recently used first), as [`Disk::entries`]
    /// gave them. Checked first, changing nothing on error: every slot below `pages`, no slot
    /// or key twice, and the tier empty.
    pub fn restore(&mut self, entries: &[(BlockHash, u32)]) -> Result<()> {
        if !self.map.is_empty() {
            return Err(invalid(format!(
                "the disk tier must be empty to restore into, but it holds {} pages",
                self.map.len()
            )));
        }
        if entries.len() > self.pages {
            return Err(invalid(format!(
                "{} disk entries do not fit a tier of disk_pages={}",
                entries.len(),
                self.pages
            )));
        }
        let mut slots = vec![false; self.pages];
        let mut keys = std::collections::HashSet::with_capacity(entries.len());
        for (i, (key, s)) in entries.iter().enumerate() {
            let si = *s as usize;
            if si >= self.pages {
                return Err(invalid(format!(
                    "disk entry {i} names slot {s}, past disk_pages={}",
                    self.pages
                )));
            }
            if std::mem::replace(&mut slots[si], true) {
                return Err(invalid(format!("disk entry {i} repeats slot {s}")));
            }
            if !keys.insert(*key) {
                return Err(invalid(format!("disk entry {i} repeats a key")));
            }
        }
        for (key, s) in entries {
            self.lists.remove(FREE, PageId(*s));
            self.map.insert(*key, *s);
            self.keys[*s as usize] = *key;
            self.live[*s as usize] = true;
            self.lists.push_back(LRU, PageId(*s));
        }
        Ok(())
    }

    /// Recomputes the tier's invariants: the map and the slots agree, and every slot is on
    /// exactly the list its state says (FREE: holds nothing; LRU: holds a key, unpinned; none:
    /// pinned).
    pub fn check(&self) -> Result<()> {
        let live = self.live.iter().filter(|&&l| l).count();
        if live != self.map.len() {
            return corrupt(format!(
                "the disk map holds {} keys, {live} slots hold one",
                self.map.len()
            ));
        }
        for (key, &s) in &self.map {
            if !self.live[s as usize] || self.keys[s as usize] != *key {
                return corrupt(format!("disk slot {s} does not hold the key mapped to it"));
            }
        }
        let (mut free, mut lru) = (0, 0);
        for s in 0..self.pages as u32 {
            let i = s as usize;
            let linked = self.lists.is_linked(PageId(s));
            let want = self.pins[i] == 0;
            if linked != want {
                return corrupt(format!(
                    "disk slot {s} is pinned {} times and linked: {linked}",
                    self.pins[i]
                ));
            }
            if want {
                if self.live[i] {
                    lru += 1
                } else {
                    free += 1
                }
            }
        }
        if free != self.lists.len(FREE) || lru != self.lists.len(LRU) {
            return corrupt(format!(
                "disk lists hold {} free and {} used slots, {free} and {lru} expected",
                self.lists.len(FREE),
                self.lists.len(LRU)
            ));
        }
        for s in self.lists.iter(FREE) {
            if self.live[s.0 as usize] {
                return corrupt(format!("disk slot {} holds a key and is free", s.0));
            }
        }
        Ok(())
    }

    /// The keys, slots, pins and order the tier's decisions depend on.
    pub fn digest(&self, d: &mut StateDigest) {
        d.word(self.pages as u64);
        for list in [FREE, LRU] {
            d.word(self.lists.len(list) as u64);
            for s in self.lists.iter(list) {
                d.word(s.0 as u64);
                if self.live[s.0 as usize] {
                    d.bytes(&self.keys[s.0 as usize]);
                }
            }
        }
        for (s, &p) in self.pins.iter().enumerate().filter(|(_, &p)| p > 0) {
            d.word((s as u64) << 32 | p as u64);
        }
    }

    /// Heap bytes of the tier's index.
    pub fn heap_bytes(&self) -> usize {
        self.map.capacity() * (32 + 4 + 1)
            + self.keys.capacity() * 32
            + self.live.capacity()
            + self.pins.capacity() * 4
            + self.lists.heap_bytes()
    }
}
