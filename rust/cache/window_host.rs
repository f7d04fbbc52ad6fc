//! The window group's host tier: where cached window pages go when the window pool needs room,
//! found by their block key, and where a hit loads them back from.
//!
//! ```text
//!   window pool (device)        window host tier (host memory, `slots` pages)
//!   LRU front --- offload ----> HOST_LRU back          (the oldest host page is dropped first)
//!   a hit's page <--- load ---- its slot, then HOST_FREE
//! ```
//!
//! The full group's host tier (`cache/tier.rs`) moves full pages; this one moves window pages,
//! in its own slot space and with its own copy kinds ([`CopyKind::WindowOffload`],
//! [`CopyKind::WindowLoad`]), so that an agent whose session paused finds its last window
//! again after other sessions pushed it out of the window pool. A page that moves between the
//! pool and this tier stays in the group: no event; one this tier drops leaves it.

use crate::arena::ids::PageId;
use crate::arena::links::{Links, ListId};
use crate::cache::digest::StateDigest;
use crate::cache::tier::{CopyKind, PageCopy};
use crate::error::{corrupt, Result};
use crate::wire::events::EventLog;
use crate::wire::hash::BlockHash;
use std::collections::HashMap;

/// Host slots holding nothing.
const HOST_FREE: ListId = ListId(0);
/// Host slots holding a window page, least recently offloaded at the front.
const HOST_LRU: ListId = ListId(1);

/// The host tier of a window group (`slots == 0`: none).
#[derive(Debug)]
pub struct WindowHost {
    /// Host pages of the tier.
    pub slots: usize,
    map: HashMap<BlockHash, u32>,
    key: Vec<BlockHash>,
    lists: Links<PageId>,
    log: Vec<PageCopy>,
    /// Window pages moved to the host so far.
    pub offloaded: u64,
    /// Window pages moved back so far.
    pub loaded: u64,
}

impl WindowHost {
    /// A tier of `slots` host pages (0: none).
    pub fn new(slots: usize) -> Result<Self> {
        let mut lists = Links::try_new(2, slots)?;
        for h in 0..slots as u32 {
            lists.push_back(HOST_FREE, PageId(h));
        }
        Ok(WindowHost {
            slots,
            map: HashMap::new(),
            key: crate::error::try_vec(slots, [0u8; 32])?,
            lists,
            log: Vec::new(),
            offloaded: 0,
            loaded: 0,
        })
    }

    /// Whether the key's page is on the host.
    #[inline]
    pub fn holds(&self, key: &BlockHash) -> bool {
        !self.map.is_empty() && self.map.contains_key(key)
    }

    /// Pages on the host.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Takes the slot holding `key` out of the drop order, for a load that follows; returns it.
    pub fn pin(&mut self, key: &BlockHash) -> u32 {
        let h = self.map[key];
        self.lists.remove(HOST_LRU, PageId(h));
        h
    }

    /// Drops the host copy of `key`, where the tier holds one (the pool took a fresh copy of
    /// the same page); returns whether it did. The key stays in the group: no event.
    pub fn forget(&mut self, key: &BlockHash) -> bool {
        if self.map.is_empty() {
            return false;
        }
        let Some(h) = self.map.remove(key) else {
            return false;
        };
        self.lists.remove(HOST_LRU, PageId(h));
        self.lists.push_back(HOST_FREE, PageId(h));
        true
    }

    /// Copies pinned slot `h` back into window page `w` and frees the slot.
    pub fn load(&mut self, h: u32, w: u32) {
        let key = self.key[h as usize];
        self.map.remove(&key);
        self.lists.push_back(HOST_FREE, PageId(h));
        self.log.push(PageCopy {
            kind: CopyKind::WindowLoad,
            src: h,
            dst: w,
        });
        self.loaded += 1;
    }

    /// Copies window page `w` (cached under `key`, leaving the pool) to a host slot: a free
    /// one, else the least recently offloaded one, whose page leaves the group (recorded in
    /// `log`). False, copying nothing, without a tier or when every slot is pinned by a load in
    /// progress.
    /// Returns whether the page went to the host and whether another page was dropped.
    pub fn offload(&mut self, w: u32, key: BlockHash, log: &mut EventLog) -> (bool, bool) {
        let (h, dropped) = match self.lists.pop_front(HOST_FREE) {
            Some(h) => (h.0, false),
            None => match self.lists.pop_front(HOST_LRU) {
                Some(h) => {
                    let old = self.key[h.0 as usize];
                    self.map.remove(&old);
                    if log.on {
                        log.window_removed(old);
                    }
                    (h.0, true)
                }
                None => return (false, false),
            },
        };
        self.map.insert(key, h);
        self.key[h as usize] = key;
        self.lists.push_back(HOST_LRU, PageId(h));
        self.log.push(PageCopy {
            kind: CopyKind::WindowOffload,
            src: w,
            dst: h,
        });
        self.offloaded += 1;
        (true, dropped)
    }

    /// Drops every page on the host; returns how many.
    pub fn reset(&mut self, log: &mut EventLog) -> usize {
        let mut n = 0;
        while let Some(h) = self.lists.pop_front(HOST_LRU) {
            let key = self.key[h.0 as usize];
            self.map.remove(&key);
            if log.on {
                log.window_removed(key);
            }
            self.lists.push_back(HOST_FREE, h);
            n += 1;
        }
        n
    }

    /// The copies not drained yet, in order; the log is left empty.
    pub fn drain(&mut self) -> Vec<PageCopy> {
        std::mem::take(&mut self.log)
    }

    /// Heap bytes of the tier's bookkeeping.
    pub fn heap_bytes(&self) -> usize {
        self.map.capacity() * (32 + 4 + 8)
            + self.key.capacity() * 32
            + self.lists.heap_bytes()
            + self.log.capacity() * std::mem::size_of::<PageCopy>()
    }

    /// The tier's invariants: every slot free or on HOST_LRU (no load is in progress between
    /// calls), each listed slot found by its key, no key also in the pool (`in_pool`).
    pub fn check(&self, in_pool: impl Fn(&BlockHash) -> bool) -> Result<()> {
        let (free, lru) = (self.lists.len(HOST_FREE), self.lists.len(HOST_LRU));
        if free + lru != self.slots || lru != self.map.len() {
            return corrupt(format!(
                "the window host tier lists {free} free and {lru} used slots of {}, and maps {} \
                 keys",
                self.slots,
                self.map.len()
            ));
        }
        for h in self.lists.iter(HOST_LRU) {
            let key = &self.key[h.0 as usize];
            if self.map.get(key) != Some(&h.0) {
                return corrupt(format!("window host page {} is not found by its key", h.0));
            }
            if in_pool(key) {
                return corrupt(format!(
                    "window host page {} is cached in the window pool as well",
                    h.0
                ));
            }
        }
        Ok(())
    }

    /// Feeds the tier's state into `d`: its size and its used slots in drop order, with keys.
    pub fn digest(&self, d: &mut StateDigest) {
        d.word(self.slots as u64);
        d.word(self.lists.len(HOST_LRU) as u64);
        for h in self.lists.iter(HOST_LRU) {
            d.word(h.0 as u64);
            d.bytes(&self.key[h.0 as usize]);
        }
    }
}
