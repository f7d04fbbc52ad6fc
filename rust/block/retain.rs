//! Eviction classes and retentions of the block index (the rules of `radix/retain.rs`, page by
//! page).
//!
//! Each device page has a class and a count of the live retentions holding it, packed in one
//! word (`keep`). Unpinned hashed pages sit in the list of their class (`EVICTABLE` for class
//! 0) or, while retained, in `RETAINED`; eviction takes the front of the lowest list that has a
//! page. A released or expired retention returns its pages to the front of their class's list:
//! the block index keeps no per-page times, and a retained page has waited longest. A retained
//! page evicted (nothing else was left) leaves the retentions holding it; one left with no
//! page ends.
//!
//! ```text
//!   keep[page] = soft << 2 | class        (class < CLASSES = 4)
//! ```

use super::*;
use crate::cache::index::CLASSES;

const CLASS_BITS: u32 = 2;
const _: () = assert!(CLASSES as u32 <= 1 << CLASS_BITS);

impl BlockIndex {
    pub(super) fn class_of(&self, page: PageId) -> u8 {
        (self.keep[page.index()] & ((1 << CLASS_BITS) - 1)) as u8
    }

    pub(super) fn soft_of(&self, page: PageId) -> u32 {
        self.keep[page.index()] >> CLASS_BITS
    }

    /// The list an unpinned hashed device page belongs in.
    #[inline]
    pub(super) fn list_for(&self, page: PageId) -> ListId {
        let k = self.keep[page.index()];
        if k >> CLASS_BITS > 0 {
            RETAINED
        } else {
            CLASS_LISTS[(k & ((1 << CLASS_BITS) - 1)) as usize]
        }
    }

    /// The front of the lowest device list that has a page, taken off it, and whether it was
    /// retained.
    pub(super) fn pop_evictable(&mut self) -> Option<(PageId, bool)> {
        for list in DEVICE_LISTS {
            if let Some(page) = self.lists.pop_front(list) {
                return Some((page, list == RETAINED));
            }
        }
        None
    }

    /// A page leaving the device (evicted or offloaded): it leaves every retention holding it
    /// (a retention left with no page ends), and its class goes back to 0. Chains are released
    /// tail first, so a retention loses its tail first, and keeps its prefix, as in the tree.
    pub(super) fn forget_keep(&mut self, page: PageId) {
        for rid in self.holders.remove(&page).unwrap_or_default() {
            let r = self
                .retained
                .get_mut(rid)
                .expect("holders name live retentions");
            if r.held.last() == Some(&page) {
                r.held.pop();
            } else {
                r.held.retain(|&q| q != page);
            }
            if r.held.is_empty() {
                self.retained.remove(rid);
            }
        }
        self.keep[page.index()] = 0;
    }

    /// See `Index::retain`: the pages that hold `r`'s published prefix in the index (a stored
    /// copy where `r` has a private duplicate), each pinned by `r` now.
    pub(super) fn retain_pages(
        &mut self,
        r: &Request<BlockExt>,
        class: u8,
        until: Option<f64>,
    ) -> u64 {
        let mut pages = Vec::with_capacity(r.published / self.page_size);
        for page in published_holders(r, self.page_size) {
            let k = &mut self.keep[page.index()];
            let c = (*k & ((1 << CLASS_BITS) - 1)).max(class as u32);
            *k = (*k & !((1 << CLASS_BITS) - 1)) | c;
            pages.push(page);
        }
        let Some(until) = until.filter(|_| !pages.is_empty()) else {
            return 0;
        };
        let rid = self.retained.insert(pages, until);
        let held = &self.retained.get(rid).expect("just made").held;
        for &page in held {
            self.keep[page.index()] += 1 << CLASS_BITS;
            self.holders.entry(page).or_default().push(rid);
        }
        rid
    }

    /// Moves `page`, if unpinned (so linked), from `old` to the list its `keep` now says.
    fn relink(&mut self, page: PageId, old: ListId) {
        if self.refcount[page.index()] == 0 && old != self.list_for(page) {
            self.lists.remove(old, page);
            let list = self.list_for(page);
            self.lists.push_back(list, page);
        }
    }

    /// See `Index::retain_prefix`: the device pages of the cached prefix of `tokens`, up to
    /// the first on the host tier, raised to `class` and, with `until`, retained; pinning
    /// nothing, so the counters stay as they were. An unpinned page moves to the list its
    /// class and retentions now say.
    pub(super) fn retain_cached(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        class: u8,
        until: Option<f64>,
    ) -> (u64, usize) {
        let found = self.lookup(tokens, namespace);
        let tier = &self.tier;
        let pages: Vec<PageId> = found
            .at
            .pages
            .into_iter()
            .take_while(|&pg| !tier.is_host(pg))
            .collect();
        let held = pages.len() * self.page_size;
        for &page in &pages {
            let old = self.list_for(page);
            let k = &mut self.keep[page.index()];
            let c = (*k & ((1 << CLASS_BITS) - 1)).max(class as u32);
            *k = (*k & !((1 << CLASS_BITS) - 1)) | c;
            self.relink(page, old);
        }
        let Some(until) = until.filter(|_| !pages.is_empty()) else {
            return (0, held);
        };
        let rid = self.retained.insert(pages.clone(), until);
        for page in pages {
            let old = self.list_for(page);
            self.keep[page.index()] += 1 << CLASS_BITS;
            self.holders.entry(page).or_default().push(rid);
            self.relink(page, old);
        }
        (rid, held)
    }

    /// Ends retention `rid`; false when it is not live.
    pub(super) fn release_retention(&mut self, rid: u64) -> bool {
        let Some(r) = self.retained.remove(rid) else {
            return false;
        };
        for page in r.held {
            let linked = self.refcount[page.index()] == 0 && self.lists.is_linked(page);
            self.keep[page.index()] -= 1 << CLASS_BITS;
            if let Some(h) = self.holders.get_mut(&page) {
                h.retain(|&x| x != rid);
                if h.is_empty() {
                    self.holders.remove(&page);
                }
            }
            if linked && self.soft_of(page) == 0 {
                self.lists.remove(RETAINED, page);
                let list = self.list_for(page);
                self.lists.push_front(list, page);
            }
        }
        true
    }

    /// Ends every retention whose time is up at `now`; returns how many.
    pub(super) fn expire(&mut self, now: f64) -> usize {
        let due = self.retained.due(now);
        for &rid in &due {
            self.release_retention(rid);
        }
        self.retained.expired += due.len() as u64;
        due.len()
    }
}
