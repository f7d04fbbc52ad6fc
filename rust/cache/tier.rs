//! What both indexes share of the host and disk tiers: the copy log and its counters.
//!
//! With `host_pages > 0` a cached page is on the device or on the host. The index decides
//! where each page goes; the owner of the KV tensors moves them. Every move is appended to the
//! log as a [`PageCopy`], and the owner performs the log in order (see `docs/SEMANTICS.md`,
//! "Host tier").
//!
//! Inside an index, host pages share one id space with device pages so that an index entry is
//! a plain [`PageId`]: device pages are `0..num_pages`, host page `h` is `num_pages + h`. Copies
//! name pages per tier (`h`, not `num_pages + h`).
//!
//! With `disk_pages > 0` as well, a host page the host tier drops goes to a disk slot (a
//! [`CopyKind::Spill`]); [`crate::PrefixCache::disk_persist`] writes every page the index holds
//! that the disk lacks (spills from the host, [`CopyKind::Persist`] from the device): both
//! through [`Tier::send_to_disk`]. Pages
//! come back from disk through the host by a prefetch (see `cache/mod.rs`), not through the log.

use crate::arena::ids::PageId;
use crate::cache::disk::Disk;
use crate::wire::hash::BlockHash;

/// Which way a [`PageCopy`] goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// Device page `src` to host page `dst`: its KV leaves the device, its entry stays cached.
    Offload = 0,
    /// Host page `src` to device page `dst`: a request is about to read it.
    Load = 1,
    /// Host page `src` to disk slot `dst`: the host tier drops the page, the disk keeps it.
    Spill = 2,
    /// Device page `src` to disk slot `dst`: a copy for `disk_persist`; the page stays.
    Persist = 3,
    /// Window page `src` to window host page `dst` (the window layers' pools only; see
    /// `cache/window_host.rs`): its KV leaves the window pool, its key stays in the group.
    WindowOffload = 4,
    /// Window host page `src` to window page `dst`: a hit is about to read it.
    WindowLoad = 5,
}

/// One copy of a page's KV between the tiers; ids are per tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    /// Which way.
    pub kind: CopyKind,
    /// The page read.
    pub src: u32,
    /// The page written.
    pub dst: u32,
}

/// An index's host tier: its size, counters and the copies not drained yet.
#[derive(Debug, Default)]
pub struct Tier {
    /// Device pages; host page `h` is `PageId(num_pages + h)` inside the index.
    num_pages: u32,
    /// Host pages (0: no tier).
    pub host_pages: usize,
    /// Pages moved device -> host so far.
    pub offloaded: u64,
    /// Pages moved host -> device so far.
    pub loaded: u64,
    /// Host pages dropped so far (to make room, or by `reset`).
    pub dropped: u64,
    log: Vec<PageCopy>,
    /// The disk tier behind the host tier (no slots: none).
    pub disk: Disk,
    /// Host pages (per tier) taken by prefetches in progress: in no list and not in the index.
    pub reserved: Vec<PageId>,
    /// Set while `reset` drops the host tier: nothing spills (the disk is cleared too).
    pub resetting: bool,
    /// The block key of each disk copy in `log`, in order (what the owner writes beside the
    /// page, so a slot's bytes always name the page they are).
    disk_keys: Vec<BlockHash>,
}

impl Default for Disk {
    fn default() -> Self {
        Disk::new(0).expect("an empty disk tier")
    }
}

impl Tier {
    /// A tier of `host_pages` pages behind a pool of `num_pages` device pages.
    pub fn new(num_pages: usize, host_pages: usize) -> Self {
        Tier {
            num_pages: num_pages as u32,
            host_pages,
            ..Tier::default()
        }
    }

    /// Whether there is a host tier.
    #[inline]
    pub fn on(&self) -> bool {
        self.host_pages > 0
    }

    /// Whether an index page id names a host page.
    #[inline]
    pub fn is_host(&self, page: PageId) -> bool {
        page.0 >= self.num_pages
    }

    /// The index id of host page `h`.
    #[inline]
    pub fn host_id(&self, h: PageId) -> PageId {
        PageId(self.num_pages + h.0)
    }

    /// The host page an index id names.
    #[inline]
    pub fn local(&self, page: PageId) -> PageId {
        debug_assert!(self.is_host(page));
        PageId(page.0 - self.num_pages)
    }

    /// Records that device page `d` goes to host page `h` (an index id).
    pub fn offload(&mut self, d: PageId, h: PageId) {
        let dst = self.local(h).0;
        self.log.push(PageCopy {
            kind: CopyKind::Offload,
            src: d.0,
            dst,
        });
        self.offloaded += 1;
    }

    /// Records that host page `h` (an index id) comes back into device page `d`.
    pub fn load(&mut self, h: PageId, d: PageId) {
        let src = self.local(h).0;
        self.log.push(PageCopy {
            kind: CopyKind::Load,
            src,
            dst: d.0,
        });
        self.loaded += 1;
    }

    /// Whether host pages the host tier drops go to disk now.
    #[inline]
    pub fn spills(&self) -> bool {
        self.disk.on() && !self.resetting
    }

    /// Records that the index pages `pages` (device or host, one run in page order), whose block
    /// keys are `keys`, go to disk: the disk stores them tail first (see [`Disk::store_run`]),
    /// and for each key it lacked a copy is logged, in that order (`Spill` from a host page,
    /// `Persist` from a device page). Where the run reused one of its own slots, the page
    /// stored last there is the one the slot holds.
    pub fn send_to_disk(&mut self, pages: &[PageId], keys: &[BlockHash]) {
        let slots = self.disk.store_run(keys);
        for ((&page, key), slot) in pages.iter().zip(keys).zip(slots).rev() {
            let Some(dst) = slot else { continue };
            let (kind, src) = if self.is_host(page) {
                (CopyKind::Spill, self.local(page).0)
            } else {
                (CopyKind::Persist, page.0)
            };
            self.log.push(PageCopy { kind, src, dst });
            self.disk_keys.push(*key);
        }
    }

    /// The copies not drained yet, in order; the log is left empty.
    pub fn drain(&mut self) -> Vec<PageCopy> {
        self.disk_keys.clear();
        std::mem::take(&mut self.log)
    }

    /// [`Tier::drain`], with the block key of each disk copy, in order.
    pub fn drain_keyed(&mut self) -> (Vec<PageCopy>, Vec<BlockHash>) {
        (
            std::mem::take(&mut self.log),
            std::mem::take(&mut self.disk_keys),
        )
    }

    /// Copies not drained yet.
    pub fn pending(&self) -> usize {
        self.log.len()
    }

    /// Heap bytes of the log.
    pub fn heap_bytes(&self) -> usize {
        self.log.capacity() * std::mem::size_of::<PageCopy>()
            + self.disk.heap_bytes()
            + self.reserved.capacity() * 4
            + self.disk_keys.capacity() * 32
    }
}
