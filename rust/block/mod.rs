//! `BlockIndex`: a map from chained block hash to page, in the style of vLLM's Automatic Prefix
//! Caching.
//!
//! Every full page of a request has a key, `h_i = H(h_{i-1}, tokens of page i)` (see
//! [`crate::wire::hash`]), so a page's key names its whole prefix. Lookups walk a prompt's hashes until
//! the first miss. Pages are refcounted one by one. Unpinned pages sit in one of two intrusive
//! lists threaded through the page records:
//!
//! ```text
//!   FREE:      never hashed (or evicted)  -- reused first, most recently freed first
//!   EVICTABLE: hashed, refcount 0         -- least recently released at the front
//! ```
//!
//! A hit takes its page out of EVICTABLE in O(1). A finished request releases its pages tail
//! first, so a chain's tail is evicted before its head. Eviction is lazy: a cached page loses its
//! hash only when allocation reuses it (or on `evict`/`reset`).
//!
//! The map is one hash table of 64-bit content keys to pages. Content keys are chained like the
//! block hashes, but with a fast keyed hash seeded per cache: `k_i = K(k_{i-1}, tokens of page i)`,
//! `k_{-1}` the first 8 bytes of `h_root`; so `k_i`, like `h_i`, is a function of the namespace and
//! every token up to page `i`. Each hashed page records its hash `h_i`, its parent `h_{i-1}`, its
//! tokens and its key, and a table hit is compared against the parent hash and tokens exactly.
//! Since `h_i` is a function of `(h_{i-1}, tokens)`, this is the map from block hash to page,
//! reached without running blake3: a lookup costs one probe a page, and blake3 runs only for
//! pages published for the first time. And since a prompt's keys need no hash of the map's, a
//! lookup computes them a window of pages ahead and loads their slots together.
//!
//! A host tier adds host pages to the same records, map and lists (ids `num_pages..`), in two
//! more lists, HOST_FREE and HOST_EVICTABLE: an evicted page's record moves to a host page, and
//! a hit on a host page moves it back to a device page.

use crate::arena::ids::{ArenaId, PageId};
use crate::arena::links::{Links, ListId};
use crate::arena::table_hash::TokenKeys;
use crate::cache::index::{Cursor, CursorAt, Found, Index};
use crate::cache::request::{Request, Requests};
use crate::cache::tier::Tier;
use crate::cache::Cache;
use crate::error::{corrupt, try_vec, Result};
use crate::wire::events::EventLog;
use crate::wire::hash::Namespace;
use crate::wire::hash::{next_hash, root_hash, BlockHash};
use content_map::ContentMap;
use page_records::{PageRecords, HASH_WORDS};

mod check;
mod content_map;
mod disk;
mod page_records;
mod retain;

use crate::cache::retention::Retentions;

/// A prefix cache indexed by chained block hashes.
pub type BlockCache = Cache<BlockIndex>;

const FREE: ListId = ListId(0);
/// Unpinned hashed device pages of eviction class 0 (see `retain.rs` for the others).
const EVICTABLE: ListId = ListId(1);
const HOST_FREE: ListId = ListId(2);
const HOST_EVICTABLE: ListId = ListId(3);
/// The evictable list of each eviction class, and of retained pages.
const CLASS_LISTS: [ListId; 4] = [EVICTABLE, ListId(4), ListId(5), ListId(6)];
const RETAINED: ListId = ListId(7);
/// Every list of evictable device pages, in eviction order.
const DEVICE_LISTS: [ListId; 5] = [EVICTABLE, ListId(4), ListId(5), ListId(6), RETAINED];

/// Pages whose map slots and records `publish` loads together, that many pages ahead.
const AHEAD: usize = 16;

/// Pages whose map slots an allocation loads together before evicting them.
const EVICT_BATCH: usize = 16;

/// The most pages whose map slots a lookup loads together.
const WALK_WINDOW: usize = 32;

/// The block cache's own part of a request.
#[derive(Debug, Clone)]
pub struct BlockExt {
    /// The hash of its published prefix, `h` of page `published / P - 1` (`None` before any):
    /// the parent of the next page it publishes. Pages are published in order, so this is all
    /// of its chain a request keeps (32 bytes, not 32 a page).
    tip: Option<BlockHash>,
    /// The content key of the same page (`k_{-1}` before any).
    lead: u64,
    /// `(position, stored page)` where this request computed a page that another request had
    /// published first: its own copy stays private, and it pins the stored one instead, so that
    /// the chain through its published pages stays whole (and reachable by `fork`) while it lives.
    stored: Vec<(u32, PageId)>,
}

/// Page records, the content map and the two lists.
#[derive(Debug)]
pub struct BlockIndex {
    page_size: usize,
    refcount: Vec<u32>,
    /// Of each hashed page: its hash `h_i`, its parent hash `h_{i-1}` and its tokens.
    recs: PageRecords,
    /// The content key of a prefix -> the hashed page ending it. Holds every hashed page, once.
    map: ContentMap,
    lists: Links<PageId>,
    /// Random per cache: the content keys, `k_i = keys.key(k_{i-1}, tokens of page i)`.
    keys: TokenKeys,
    events: EventLog,
    tier: Tier,
    /// `h_root` of the namespace `None`, the common case.
    root_none: BlockHash,
    /// `publish`'s ring of the hashes and content keys of the pages ahead, kept between calls.
    scratch: Vec<(BlockHash, u64)>,
    /// Of each device page: its eviction class and the retentions holding it (`retain.rs`).
    keep: Vec<u32>,
    /// Live retentions (each holding the pages of a chain), and the ids of those holding each
    /// retained page.
    retained: Retentions<Vec<PageId>>,
    holders: std::collections::HashMap<PageId, Vec<u64>>,
    /// The device pages evicted, offloaded or reset since the cache last drained them (recorded
    /// only with state slots).
    drops: crate::cache::states::Drops,
    /// Unit tests set this to give every page the same content key, so that the paths where
    /// several contents share a key run.
    #[cfg(test)]
    collide: bool,
}

impl BlockIndex {
    /// The content key of a page of `tokens` after the page whose key is `lead`.
    #[inline]
    fn key(&self, lead: u64, tokens: &[u32]) -> u64 {
        #[cfg(test)]
        if self.collide {
            return 7;
        }
        self.keys.key(lead, tokens)
    }

    /// `h_root` of `namespace`.
    fn root(&self, namespace: &Namespace) -> BlockHash {
        match namespace {
            None => self.root_none,
            Some(_) => root_hash(self.page_size, namespace),
        }
    }

    /// `k_{-1}`: the lead of a namespace's first page, from its root hash.
    fn root_lead(root: &BlockHash) -> u64 {
        u64::from_le_bytes(root[..8].try_into().expect("8 bytes"))
    }

    /// Unhashes a page that allocation or eviction takes back.
    fn unhash(&mut self, page: PageId) {
        if self.events.on {
            let h = self.recs.hash(page).expect("evicted pages are hashed");
            self.events.removed(vec![h]);
        }
        let removed = self.map.remove(self.recs.key(page), page);
        debug_assert!(removed, "hashed pages are mapped");
        self.recs.clear(page);
    }

    /// Enters `page` into the index under `h = H(prev, tokens)`; `key` is its content key.
    fn hash_page(
        &mut self,
        page: PageId,
        prev: &BlockHash,
        tokens: &[u32],
        h: BlockHash,
        key: u64,
    ) {
        self.map.insert(key, page);
        self.recs.set(page, prev, tokens, &h, key);
    }

    /// The hash and content key of page `i` of `r`, after the page whose hash and key are
    /// `prev`; `prev` becomes the page's.
    #[inline]
    fn hash_and_key(
        &self,
        r: &Request<BlockExt>,
        i: usize,
        prev: &mut (BlockHash, u64),
    ) -> (BlockHash, u64) {
        let p = self.page_size;
        let tokens = &r.tokens[i * p..(i + 1) * p];
        *prev = (next_hash(&prev.0, tokens), self.key(prev.1, tokens));
        *prev
    }

    /// Loads the map slots and the records of pages `first + k` of `r` for `k` in `ks`, whose
    /// hashes and keys are `todo[k % todo.len()]`.
    #[inline]
    fn prefetch_batch(
        &self,
        r: &Request<BlockExt>,
        todo: &[(BlockHash, u64)],
        first: usize,
        ks: std::ops::Range<usize>,
    ) {
        if ks.is_empty() {
            return;
        }
        self.map
            .prefetch(ks.clone().map(|k| todo[k % todo.len()].1));
        self.recs
            .prefetch(&r.pages[first + ks.start..first + ks.end]);
    }

    /// The hashed page holding the content `(prev, tokens)`, whose content key is `key`, and its
    /// hash.
    fn find(&self, key: u64, prev: &BlockHash, tokens: &[u32]) -> Option<(PageId, BlockHash)> {
        let (page, h) = self.find_words(key, &PageRecords::words_of(prev), tokens)?;
        Some((page, PageRecords::hash_of(&h)))
    }

    /// [`BlockIndex::find`] with hashes as the records keep them (words), as a walk chains them.
    #[inline]
    fn find_words(
        &self,
        key: u64,
        prev: &[u32; HASH_WORDS],
        tokens: &[u32],
    ) -> Option<(PageId, [u32; HASH_WORDS])> {
        let mut hash = None;
        let page = self.map.find(key, |page| {
            hash = self.recs.holds(page, prev, tokens);
            hash.is_some()
        })?;
        Some((page, hash.expect("found pages hold the content")))
    }

    /// Walks the pages of `tokens` after the page whose hash and key are `at` while the map
    /// holds them, calling `hit` with each page found; `at` becomes the last one's. Keys are
    /// computed a window ahead (cheap, and needing nothing from the map) and the window's slots
    /// loaded together, so that in a large index their cache misses overlap; the window starts
    /// small, as a miss usually comes at the first page.
    #[inline]
    fn walk(&self, tokens: &[u32], at: &mut (BlockHash, u64), mut hit: impl FnMut(PageId)) {
        let p = self.page_size;
        let mut keys = [0u64; WALK_WINDOW];
        let mut pages = tokens.chunks_exact(p);
        let mut window = 2;
        let (mut prev, mut lead, mut moved) = (PageRecords::words_of(&at.0), at.1, false);
        'walk: loop {
            let mut n = 0;
            let mut next = lead;
            for page in pages.clone().take(window) {
                next = self.key(next, page);
                keys[n] = next;
                n += 1;
            }
            if n == 0 {
                break;
            }
            self.map.prefetch(keys[..n].iter().copied());
            for &key in &keys[..n] {
                let page = pages.next().expect("counted above");
                let Some((pg, h)) = self.find_words(key, &prev, page) else {
                    break 'walk;
                };
                hit(pg);
                (prev, lead, moved) = (h, key, true);
            }
            window = (window * 4).min(WALK_WINDOW);
        }
        if moved {
            *at = (PageRecords::hash_of(&prev), lead);
        }
    }

    /// Records that the pages `first..first + hashes.len()` of `r`, hashed `hashes`, entered
    /// the map after `parent` (nothing when recording is off).
    fn record_stored(
        &mut self,
        r: &Request<BlockExt>,
        first: usize,
        parent: Option<BlockHash>,
        hashes: &mut Vec<BlockHash>,
    ) {
        if !self.events.on || hashes.is_empty() {
            return;
        }
        let p = self.page_size;
        let end = first + hashes.len();
        self.events.stored_keys(
            &r.namespace,
            parent,
            std::mem::take(hashes),
            r.tokens[first * p..end * p].to_vec(),
        );
    }

    /// Moves hashed `from`'s hash, record and map entry to unhashed `to`.
    fn relocate(&mut self, from: PageId, to: PageId) {
        let key = self.recs.key(from);
        let removed = self.map.remove(key, from);
        debug_assert!(removed, "hashed pages are mapped");
        self.map.insert(key, to);
        self.recs.relocate(from, to);
    }

    /// Moves evicted device page `d`'s hash to a host page: HOST_FREE's front, else
    /// HOST_EVICTABLE's front (dropping its hash). Returns false, changing nothing, when every
    /// host page belongs to a load in progress.
    #[inline(never)]
    fn offload(&mut self, d: PageId) -> bool {
        let Some(h) = self.take_host_page() else {
            return false;
        };
        self.relocate(d, h);
        self.lists.push_back(HOST_EVICTABLE, h);
        self.tier.offload(d, h);
        true
    }

    /// A host page for a page coming down or back: HOST_FREE's front, else HOST_EVICTABLE's
    /// front, whose hash is dropped (to the disk tier when there is one). `None` when every host
    /// page belongs to a load in progress.
    fn take_host_page(&mut self) -> Option<PageId> {
        if let Some(h) = self.lists.pop_front(HOST_FREE) {
            return Some(h);
        }
        let h = self.lists.pop_front(HOST_EVICTABLE)?;
        if self.tier.spills() {
            let key = self.recs.hash(h).expect("host evictable pages are hashed");
            self.tier.send_to_disk(&[h], &[key]);
        }
        self.unhash(h);
        self.tier.dropped += 1;
        Some(h)
    }

    /// Evicts device page `d` (just taken off EVICTABLE): to the host tier when there is one
    /// with room, else its hash is dropped.
    #[inline]
    fn evict_page(&mut self, d: PageId) {
        self.drops.note(&[d]);
        if self.keep[d.index()] != 0 {
            self.forget_keep(d);
        }
        if !(self.tier.on() && self.offload(d)) {
            self.unhash(d);
        }
    }

    /// Takes one pin of a cached page (a hit).
    fn pin_page(&mut self, page: PageId) {
        if self.refcount[page.index()] == 0 {
            let list = self.list_for(page);
            self.lists.remove(list, page);
        }
        self.refcount[page.index()] += 1;
    }

    /// Drops one pin of a page: at refcount 0 a hashed page becomes the most recently used
    /// evictable page, an unhashed one the next free page.
    fn unpin(&mut self, page: PageId) {
        let rc = &mut self.refcount[page.index()];
        *rc -= 1;
        if *rc == 0 {
            if self.recs.is_hashed(page) {
                let list = self.list_for(page);
                self.lists.push_back(list, page);
            } else {
                self.lists.push_front(FREE, page);
            }
        }
    }
}

/// The pages that hold `r`'s published prefix in the index, in order: its own, or the stored
/// copy it pins where it computed a private duplicate.
fn published_holders(r: &Request<BlockExt>, page_size: usize) -> impl Iterator<Item = PageId> + '_ {
    let mut stored = r.ext.stored.iter().peekable();
    r.pages[..r.published / page_size]
        .iter()
        .enumerate()
        .map(
            move |(i, &own)| match stored.next_if(|(at, _)| *at as usize == i) {
                Some(&(_, copy)) => copy,
                None => own,
            },
        )
}

/// The cached pages of a lookup and the hash of the last one.
#[derive(Debug)]
pub struct Hits {
    pages: Vec<PageId>,
    tip: Option<BlockHash>,
    lead: u64,
}

impl Index for BlockIndex {
    type Ext = BlockExt;
    type At = Hits;

    /// Per-page records are allocated here (fallibly); page tokens only as pages are hashed.
    fn new(num_pages: usize, page_size: usize, host_pages: usize) -> Result<Self> {
        // The largest arrays are reserved first, before anything is written, so that a pool too
        // large for this machine fails fast and without touching memory.
        let total = num_pages + host_pages;
        let recs = PageRecords::try_new(total, page_size)?;
        let refcount = try_vec(num_pages, 0)?;
        let keep = try_vec(num_pages, 0)?;
        let mut lists = Links::try_new(8, total)?;
        for page in 0..num_pages as u32 {
            lists.push_back(FREE, PageId(page));
        }
        for page in num_pages as u32..total as u32 {
            lists.push_back(HOST_FREE, PageId(page));
        }
        // At most one entry a page: sized for them all, the map never rehashes.
        let map = ContentMap::try_new(total)?;
        Ok(BlockIndex {
            page_size,
            refcount,
            recs,
            map,
            lists,
            keys: TokenKeys::random(),
            events: EventLog::default(),
            tier: Tier::new(num_pages, host_pages),
            root_none: root_hash(page_size, &None),
            scratch: Vec::new(),
            keep,
            retained: Retentions::default(),
            holders: std::collections::HashMap::new(),
            drops: Default::default(),

            #[cfg(test)]
            collide: false,
        })
    }

    fn page_size(&self) -> usize {
        self.page_size
    }

    fn free_pages(&self) -> usize {
        self.lists.len(FREE)
    }

    fn evictable_pages(&self) -> usize {
        DEVICE_LISTS.iter().map(|&l| self.lists.len(l)).sum()
    }

    /// Hashes page by page until the first page the map does not hold.
    fn lookup(&self, tokens: &[u32], namespace: &Namespace) -> Found<Hits> {
        let p = self.page_size;
        let root = self.root(namespace);
        let mut at = (root, Self::root_lead(&root));
        let mut pages = Vec::new();
        self.walk(tokens, &mut at, |pg| pages.push(pg));
        let hits = Hits {
            tip: (!pages.is_empty()).then_some(at.0),
            lead: at.1,
            pages,
        };
        let (mut evictable, mut host) = (0, 0);
        for &pg in &hits.pages {
            if self.tier.is_host(pg) {
                host += 1;
            } else if self.refcount[pg.index()] == 0 {
                evictable += 1;
            }
        }
        Found {
            matched: hits.pages.len() * p,
            evictable,
            host,
            at: hits,
        }
    }

    fn pin(
        &mut self,
        found: Found<Hits>,
        _namespace: &Namespace,
        pages: &mut Vec<PageId>,
    ) -> BlockExt {
        for &page in &found.at.pages {
            if self.tier.is_host(page) {
                // Out of the host tier's reach until it comes back.
                self.lists.remove(HOST_EVICTABLE, page);
            } else {
                self.pin_page(page);
            }
        }
        pages.extend_from_slice(&found.at.pages);
        BlockExt {
            tip: found.at.tip,
            lead: found.at.lead,
            stored: Vec::new(),
        }
    }

    /// Each host hit, in chain order, moves into the next of `fresh` (refcount 1 already).
    fn load(&mut self, _ext: &mut BlockExt, pages: &mut [PageId], fresh: &[PageId]) {
        let mut fresh = fresh.iter();
        for page in pages.iter_mut() {
            if !self.tier.is_host(*page) {
                continue;
            }
            let (h, d) = (
                *page,
                *fresh.next().expect("a device page for every host hit"),
            );
            self.relocate(h, d);
            self.lists.push_front(HOST_FREE, h);
            self.tier.load(h, d);
            *page = d;
        }
    }

    /// Takes never-hashed pages first, then the least recently released cached ones (to the
    /// host tier, or dropping their hashes).
    fn allocate(&mut self, count: usize, out: &mut Vec<PageId>) -> usize {
        let mut left = count;
        while left > 0 {
            let Some(page) = self.lists.pop_front(FREE) else {
                break;
            };
            self.refcount[page.index()] = 1;
            out.push(page);
            left -= 1;
        }
        // FREE is empty now, and evicting adds nothing to it. Cached pages leave EVICTABLE a
        // batch at a time, and the map slots of their keys are loaded together before the batch
        // is evicted: in a large pool each is a cache miss, and together they overlap.
        let evicted = left;
        let mut batch = [PageId(0); EVICT_BATCH];
        while left > 0 {
            let n = left.min(EVICT_BATCH);
            for slot in &mut batch[..n] {
                let (page, retained) = self.pop_evictable().expect("capacity checked");
                self.retained.forced_pages += retained as u64;
                *slot = page;
            }
            self.map
                .prefetch(batch[..n].iter().map(|&page| self.recs.key(page)));
            for &page in &batch[..n] {
                self.evict_page(page);
                self.refcount[page.index()] = 1;
                out.push(page);
            }
            left -= n;
        }
        evicted
    }

    /// A page whose hash another page holds already stays private to `r` (its table does not
    /// change) and is freed when `r` ends; `r` pins the stored copy in its place.
    fn publish(&mut self, r: &mut Request<BlockExt>, upto: usize) {
        let p = self.page_size;
        let (first, last) = (r.published / p, upto / p);
        if last <= first {
            return;
        }
        // The run of pages entered into the map since the last stored copy, for the event log:
        // its first index, the hash before it and its hashes (collected only when recording).
        let (mut run_first, mut run_parent, mut run) = (first, r.ext.tip, Vec::new());
        let root = self.root(&r.namespace);
        // Pages are hashed (blake3, one after the other: no memory traffic) `2 * AHEAD` pages
        // ahead of the page entered, and their map slots and records are loaded `AHEAD` pages
        // at a time, `AHEAD` pages before they are needed. In a large index each load is a cache
        // miss, and loaded together their latencies overlap instead of adding up page after
        // page; and the map work of a page overlaps the blake3 of a later one. A published page
        // is nearly always new, and a stored copy of it has the same hash anyway.
        let n = last - first;
        let mut todo = std::mem::take(&mut self.scratch);
        todo.resize(2 * AHEAD, ([0; 32], 0));
        let mut ahead = (r.ext.tip.unwrap_or(root), r.ext.lead);
        for k in 0..n.min(2 * AHEAD) {
            todo[k] = self.hash_and_key(r, first + k, &mut ahead);
        }
        self.prefetch_batch(r, &todo, first, 0..n.min(AHEAD));
        for k in 0..n {
            if k % AHEAD == 0 {
                self.prefetch_batch(r, &todo, first, k + AHEAD..n.min(k + 2 * AHEAD));
            }
            let i = first + k;
            let (h, key) = todo[k % (2 * AHEAD)];
            if k + 2 * AHEAD < n {
                todo[k % (2 * AHEAD)] = self.hash_and_key(r, i + 2 * AHEAD, &mut ahead);
            }
            let prev = r.ext.tip.unwrap_or(root);
            let tokens = &r.tokens[i * p..(i + 1) * p];
            match self.find(key, &prev, tokens) {
                Some((copy, _)) if self.tier.is_host(copy) => {
                    // The request's page replaces the host copy: no duplicate, no copy.
                    self.lists.remove(HOST_EVICTABLE, copy);
                    self.relocate(copy, r.pages[i]);
                    self.lists.push_front(HOST_FREE, copy);
                    self.record_stored(r, run_first, run_parent, &mut run);
                    (run_first, run_parent) = (i + 1, Some(h));
                }
                Some((copy, _)) => {
                    self.pin_page(copy);
                    r.ext.stored.push((i as u32, copy));
                    self.record_stored(r, run_first, run_parent, &mut run);
                    (run_first, run_parent) = (i + 1, Some(h));
                }
                None => {
                    self.hash_page(r.pages[i], &prev, tokens, h, key);
                    if self.events.on {
                        run.push(h);
                    }
                }
            }
            (r.ext.tip, r.ext.lead) = (Some(h), key);
        }
        self.scratch = todo;
        self.record_stored(r, run_first, run_parent, &mut run);
        r.published = last * p;
    }

    /// Drops the request's pins, its chain's tail first. At a position where it holds a private
    /// duplicate, the stored copy it pinned is released right there in the chain.
    fn release(&mut self, r: &Request<BlockExt>) {
        let mut stored = r.ext.stored.iter().rev().peekable();
        for (i, &page) in r.pages.iter().enumerate().rev() {
            if let Some(&(_, copy)) = stored.next_if(|(at, _)| *at as usize == i) {
                self.unpin(copy);
            }
            self.unpin(page);
        }
    }

    fn found_pages(&self, found: &Found<Hits>, out: &mut Vec<PageId>) {
        out.extend_from_slice(&found.at.pages);
    }

    fn drops(&mut self) -> &mut crate::cache::states::Drops {
        &mut self.drops
    }

    fn free_private(&mut self, pages: &[PageId]) {
        for &page in pages.iter().rev() {
            self.unpin(page); // allocated with a refcount of 1 and never hashed: freed
        }
    }

    fn evict(&mut self, num_pages: usize) -> usize {
        let mut done = 0;
        while done < num_pages {
            let Some((page, retained)) = self.pop_evictable() else {
                break;
            };
            self.retained.forced_pages += retained as u64;
            self.evict_page(page);
            self.lists.push_front(FREE, page);
            done += 1;
        }
        done
    }

    /// Drops HOST_EVICTABLE front to back (each page to HOST_FREE's front), then EVICTABLE front
    /// to back (each to FREE's front), offloading nothing.
    fn reset(&mut self) -> usize {
        while let Some(h) = self.lists.pop_front(HOST_EVICTABLE) {
            self.unhash(h);
            self.lists.push_front(HOST_FREE, h);
            self.tier.dropped += 1;
        }
        let mut done = 0;
        while let Some((page, _)) = self.pop_evictable() {
            self.forget_keep(page);
            self.drops.note(&[page]);
            self.unhash(page);
            self.lists.push_front(FREE, page);
            done += 1;
        }
        done
    }

    fn take_host(&mut self, count: usize, out: &mut Vec<PageId>) {
        for _ in 0..count {
            let Some(h) = self.take_host_page() else {
                break;
            };
            out.push(self.tier.local(h));
        }
    }

    fn free_host(&mut self, pages: &[PageId]) {
        self.free_host_pages(pages);
    }

    fn touch_host(&mut self, tokens: &[u32], namespace: &Namespace) {
        let root = self.root(namespace);
        let mut at = (root, Self::root_lead(&root));
        let mut host = Vec::new();
        self.walk(tokens, &mut at, |pg| host.push(pg));
        host.retain(|&pg| self.tier.is_host(pg));
        // The chain's tail first, so that its head ends at the very back.
        for &pg in host.iter().rev() {
            self.lists.remove(HOST_EVICTABLE, pg);
            self.lists.push_back(HOST_EVICTABLE, pg);
        }
    }

    fn adopt(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        from: usize,
        host: &[PageId],
    ) -> usize {
        BlockIndex::adopt(self, tokens, namespace, from, host)
    }

    fn persist(&mut self) {
        BlockIndex::persist(self)
    }

    fn host_free_pages(&self) -> usize {
        self.lists.len(HOST_FREE)
    }

    fn tier(&self) -> &Tier {
        &self.tier
    }

    fn tier_mut(&mut self) -> &mut Tier {
        &mut self.tier
    }

    fn cursor(&self, namespace: &Namespace) -> Cursor {
        let root = self.root(namespace);
        Cursor {
            matched: 0,
            at: CursorAt::Hash(root, Self::root_lead(&root)),
        }
    }

    fn advance(&self, cursor: &mut Cursor, tokens: &[u32]) -> bool {
        let CursorAt::Hash(h, lead) = cursor.at else {
            return false;
        };
        let mut at = (h, lead);
        let mut found = 0;
        self.walk(tokens, &mut at, |_| found += 1);
        cursor.matched += found * self.page_size;
        cursor.at = CursorAt::Hash(at.0, at.1);
        found == tokens.len() / self.page_size
    }

    /// Each page in id order: its refcount and, when hashed, its block hash (a function of the
    /// namespace and every token up to it, keyed by nothing per cache); then the free list and
    /// the evictable list front to back. The content map is left out: its layout follows the
    /// per-cache keys, and it holds exactly the hashed pages. O(num_pages).
    fn digest(&self, d: &mut crate::cache::digest::StateDigest) {
        d.word(self.refcount.len() as u64);
        for (i, &rc) in self.refcount.iter().enumerate() {
            match self.recs.hash(PageId(i as u32)) {
                Some(h) => {
                    d.word((rc as u64) << 1 | 1);
                    for w in h.chunks_exact(8) {
                        d.word(u64::from_le_bytes(w.try_into().expect("8 bytes")));
                    }
                }
                None => d.word((rc as u64) << 1),
            }
        }
        for list in std::iter::once(FREE).chain(DEVICE_LISTS) {
            d.word(self.lists.len(list) as u64);
            for page in self.lists.iter(list) {
                d.word(page.0 as u64);
            }
        }
        for (i, &k) in self.keep.iter().enumerate().filter(|(_, &k)| k != 0) {
            d.word((i as u64) << 32 | k as u64);
        }
        self.retained.digest(d, |pages, d| d.pages(pages));
        if self.tier.on() {
            for list in [HOST_FREE, HOST_EVICTABLE] {
                d.word(self.lists.len(list) as u64);
                for page in self.lists.iter(list) {
                    d.word(page.0 as u64);
                    if let Some(h) = self.recs.hash(page) {
                        for w in h.chunks_exact(8) {
                            d.word(u64::from_le_bytes(w.try_into().expect("8 bytes")));
                        }
                    }
                }
            }
        }
    }

    fn check(&self, requests: &Requests<BlockExt>, num_pages: usize) -> Result<()> {
        check::check_index(self, requests, num_pages)
    }

    fn retains(&self) -> bool {
        true
    }

    fn retain(&mut self, r: &Request<BlockExt>, class: u8, until: Option<f64>) -> u64 {
        self.retain_pages(r, class, until)
    }

    fn retain_prefix(
        &mut self,
        tokens: &[u32],
        namespace: &Namespace,
        class: u8,
        until: Option<f64>,
    ) -> (u64, usize) {
        self.retain_cached(tokens, namespace, class, until)
    }

    fn release_retention(&mut self, id: u64) -> bool {
        BlockIndex::release_retention(self, id)
    }

    fn expire(&mut self, now: f64) -> usize {
        BlockIndex::expire(self, now)
    }

    fn retention_counts(&self) -> (usize, u64, u64) {
        self.retained.counts()
    }

    fn events(&mut self) -> &mut EventLog {
        &mut self.events
    }

    fn metadata_bytes(&self) -> usize {
        self.refcount.capacity() * 4
            + self.keep.capacity() * 4
            + self.recs.heap_bytes()
            + self.map.heap_bytes()
            + self.lists.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::PrefixCache;

    /// Every page's content key made the same (as equal keys of different contents would make
    /// them): a lookup compares before it serves, so another tenant's prompt is never given the
    /// victim's page, and pages of different content under one key are all cached and found.
    #[test]
    fn pages_sharing_a_content_key_are_told_apart() {
        let mut c = BlockCache::new(16, 2).unwrap();
        c.index_mut().collide = true;
        let victim = [1, 2, 3, 4, 5];
        let r = c.admit(&victim, None).unwrap();
        c.commit(r, 5).unwrap();
        c.finish(r).unwrap();
        assert_eq!(c.stats().evictable_pages, 2);
        let evil: Namespace = Some(b"evil".to_vec().into());
        let prompt = [1, 2, 9];
        assert_eq!(c.match_prefix(&prompt, &evil).unwrap(), 0);
        let r = c.admit(&prompt, evil.clone()).unwrap();
        let v = c.request(r).unwrap();
        assert_eq!(v.num_cached, 0);
        assert!(!v.pages.contains(&PageId(0)), "served the victim's page");
        c.commit(r, 3).unwrap();
        c.finish(r).unwrap();
        c.check().unwrap();
        assert_eq!(c.match_prefix(&victim, &None).unwrap(), 4);
        assert_eq!(c.match_prefix(&prompt, &evil).unwrap(), 2);
        assert_eq!(c.evict(1), 1);
        c.check().unwrap();
        assert_eq!(c.reset(), 2);
        c.check().unwrap();
    }

    /// A pool sized for big pages reserves no token memory up front: 2**20 pages of 65536 tokens
    /// (2**36 token slots) cost page records only, and token memory grows with hashed pages.
    #[test]
    fn a_huge_pool_reserves_no_token_memory() {
        let mut c = BlockCache::new(1 << 20, 1 << 16).unwrap();
        let before = c.metadata_bytes();
        assert!(before < 1 << 28, "{before} bytes of metadata up front");
        let toks: Vec<u32> = (0..(1 << 16) + 1).collect();
        let r = c.admit(&toks, None).unwrap();
        c.commit(r, toks.len()).unwrap();
        c.finish(r).unwrap();
        c.check().unwrap();
        let after = c.metadata_bytes();
        assert!(after >= before + (1 << 18) && after < before + (1 << 20));
    }

    /// An allocation that cannot succeed is an error naming its size, not an abort.
    #[test]
    fn impossible_allocations_are_errors() {
        let e = crate::error::try_vec(usize::MAX / 8, [0u8; 32]).unwrap_err();
        assert!(e.to_string().contains("cannot allocate"), "{e}");
        let e = crate::error::try_vec(usize::MAX / 2, 0u64).unwrap_err();
        assert!(e.to_string().contains("bytes"), "{e}");
    }

    /// One publish of 150 pages (several of `publish`'s look-ahead windows) that meets stored
    /// device copies (pages 0..30), host copies (30..60) and new pages (60..150): the stored
    /// events name exactly the new pages under their spec hashes, and every page is found.
    #[test]
    fn long_publishes_over_stored_and_host_copies() {
        use crate::wire::events::CacheEvent;
        let tokens: Vec<u32> = (0..150).map(|t| t * 7 + 1).collect();
        let hashes = crate::wire::hash::block_hashes(&tokens, 1, &None);
        let mut c = BlockCache::with_host(300, 1, 64).unwrap();
        let late = c.admit(&tokens, None).unwrap();
        let early = c.admit(&tokens[..60], None).unwrap();
        c.commit(early, 60).unwrap();
        c.finish(early).unwrap();
        assert_eq!(c.evict(30), 30, "pages 30..60 go to the host tier");
        assert_eq!(c.index().host_free_pages(), 64 - 30);
        c.record_events(true);
        c.commit(late, 150).unwrap();
        c.check().unwrap();
        let events = c.drain_events();
        let want = CacheEvent::Stored {
            namespace: None,
            parent: Some(hashes[59]),
            hashes: hashes[60..].to_vec(),
            tokens: tokens[60..].to_vec(),
        };
        assert_eq!(events, vec![want]);
        assert_eq!(c.index().host_free_pages(), 64, "host copies were replaced");
        c.finish(late).unwrap();
        c.check().unwrap();
        assert_eq!(c.match_prefix(&tokens, &None).unwrap(), 149);
        let found = c.index().lookup(&tokens, &None);
        assert_eq!((found.matched, found.at.tip), (150, Some(hashes[149])));
    }

    /// Two caches draw different seeds, and still make the same decisions.
    #[test]
    fn seeds_differ_and_decisions_do_not() {
        let run = || {
            let mut c = BlockCache::new(8, 2).unwrap();
            let mut pages = Vec::new();
            for t in [&[1, 2, 3, 4, 5][..], &[1, 2, 7, 8, 9], &[3, 4, 1, 2, 0]] {
                let r = c.admit(t, None).unwrap();
                pages.push(c.request(r).unwrap().pages.to_vec());
                c.commit(r, t.len()).unwrap();
                c.finish(r).unwrap();
            }
            (c.index().keys.key(0, &[1]), pages)
        };
        let (a, b) = (run(), run());
        assert_ne!(a.0, b.0);
        assert_eq!(a.1, b.1);
    }
}
