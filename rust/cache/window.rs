//! The sliding-window layer group, shared by both caches: the pages of the layers whose queries
//! attend only to the last `window` keys.
//!
//! A cache built with `window > 0` keeps two kinds of page for every page of tokens:
//!
//! ```text
//!   full group   (the index: radix tree or block map)   every cached page, as without a window
//!   window group (this file, its own pool of pages)     a page only while someone can read it
//!
//!   request, next query at position t:   [ gone ........ | held: window pages | new pages ]
//!                                        0        first_needed(t)            t
//! ```
//!
//! A query at position `t` reads keys `t - window < j <= t` (transformers' sliding window). A
//! request holds its window pages from what a hit at its last computed page boundary `b` would
//! read (page `(b + 1 - window) / P`, `b = min(num_computed, num_tokens - 1)` rounded down to a
//! page): its next query reads from there or later, and a fork or its next turn finds its
//! window. Each commit releases the pages below. A released page that is published stays cached, evictable (least recently released
//! first), so that a branch at that point can still find it; an unpublished one is freed.
//!
//! Window pages are found by their block key (DESIGN.md's `h_i`, which names the namespace and
//! the whole prefix), so that one group serves both indexes and a window page never outlives the
//! meaning of its key. A hit of `k` pages needs the index's `k` full pages and the window pages
//! of pages `first_needed(k * P) .. k`; [`Window::cut`] finds the longest such `k` from the right.

use crate::arena::ids::PageId;
use crate::arena::links::{Links, ListId};
use crate::cache::digest::StateDigest;
use crate::cache::index::{Found, Index};
use crate::cache::request::{Request, WindowPages, GONE};
use crate::cache::window_host::WindowHost;
use crate::cache::Cache;
use crate::error::{corrupt, invalid, Result};
use crate::wire::events::EventLog;
use crate::wire::hash::{next_hash, root_hash, BlockHash, Namespace};
use std::collections::HashMap;

/// Window pages holding nothing, taken front first (lowest ids first at the start).
const FREE: ListId = ListId(0);
/// Cached window pages no live request holds, least recently released at the front.
const LRU: ListId = ListId(1);

/// The window group of a cache (`pages == 0`: none).
#[derive(Debug)]
pub struct Window {
    /// Tokens each query of a window layer attends to (itself included).
    pub window: usize,
    /// Pages of the group's pool.
    pub pages: usize,
    page_size: usize,
    map: HashMap<BlockHash, u32>,
    /// The key each page is cached under, where `cached`.
    key: Vec<BlockHash>,
    cached: Vec<bool>,
    /// Live requests holding each page.
    refs: Vec<u32>,
    lists: Links<PageId>,
    /// Admissions whose hit the window cut short (the full pages went further).
    pub cut_hits: u64,
    /// Tokens those admissions recomputed because of the cut.
    pub cut_tokens: u64,
    /// Cached window pages dropped so far (to make room, or by `reset`).
    pub evicted: u64,
    /// Where cached pages go when the pool needs room, with a host tier (see
    /// `cache/window_host.rs`).
    pub host: WindowHost,
}

impl Window {
    /// A group of `pages` pages for a window of `window` tokens (`pages == 0`: none), with a
    /// host tier of `host_pages` pages (0: none).
    pub fn new(window: usize, pages: usize, page_size: usize, host_pages: usize) -> Result<Self> {
        let mut lists = Links::try_new(2, pages)?;
        for p in 0..pages as u32 {
            lists.push_back(FREE, PageId(p));
        }
        Ok(Window {
            window,
            pages,
            page_size,
            map: HashMap::new(),
            key: crate::error::try_vec(pages, [0u8; 32])?,
            cached: crate::error::try_vec(pages, false)?,
            refs: crate::error::try_vec(pages, 0)?,
            lists,
            cut_hits: 0,
            cut_tokens: 0,
            evicted: 0,
            host: WindowHost::new(host_pages)?,
        })
    }

    /// Whether the cache has a window group.
    #[inline]
    pub fn on(&self) -> bool {
        self.pages > 0
    }

    /// The first page a query at position `t` reads.
    #[inline]
    pub fn first_needed(&self, t: usize) -> usize {
        (t + 1).saturating_sub(self.window) / self.page_size
    }

    /// Pages holding nothing.
    pub fn free_pages(&self) -> usize {
        self.lists.len(FREE)
    }

    /// Cached pages no live request holds.
    pub fn evictable_pages(&self) -> usize {
        self.lists.len(LRU)
    }

    /// The longest hit of at most `m` pages whose window is cached: `keys` are the block keys
    /// of the prompt's first `m` pages (whose full pages the index holds).
    pub fn cut(&self, keys: &[BlockHash], m: usize) -> usize {
        let mut k = m;
        'next: while k > 0 {
            let lo = self.first_needed(k * self.page_size);
            for j in (lo..k).rev() {
                if !self.map.contains_key(&keys[j]) && !self.host.holds(&keys[j]) {
                    k = j; // pages past a missing one cannot end a hit
                    continue 'next;
                }
            }
            return k;
        }
        0
    }

    /// Of the pages a hit of `k` pages holds (`first_needed(k * P)..k`), how many are evictable
    /// now (in the pool, unheld) and how many must come back from the host tier (each needs a
    /// page).
    pub fn hit_pages(&self, keys: &[BlockHash], k: usize) -> (usize, usize) {
        let lo = self.first_needed(k * self.page_size).min(k);
        let (mut evictable, mut host) = (0, 0);
        for key in &keys[lo..k] {
            match self.map.get(key) {
                Some(&w) => evictable += (self.refs[w as usize] == 0) as usize,
                None => host += 1,
            }
        }
        (evictable, host)
    }

    /// Fails unless `needed` pages are free or evictable, not counting `pinned` evictable pages
    /// the call is about to hold.
    pub fn reserve(&self, needed: usize, pinned: usize) -> Result<()> {
        let available = self.free_pages() + self.evictable_pages() - pinned;
        if needed > available {
            return Err(crate::error::Error::OutOfPages { needed, available });
        }
        Ok(())
    }

    /// The window pages of a new request with a hit of `k` pages (`keys[..k]` cached) and
    /// `total` pages in all: the hit's window held, fresh pages for the rest.
    pub fn open(
        &mut self,
        keys: Vec<BlockHash>,
        k: usize,
        total: usize,
        log: &mut EventLog,
    ) -> WindowPages {
        let lo = self.first_needed(k * self.page_size).min(k);
        let mut pages = vec![GONE; lo];
        pages.reserve(total - lo);
        // The pool's pages first, so that taking pages for the host's ones evicts none of them;
        // the host's slots pinned, so that offloads to make room drop none of them.
        let mut loads = Vec::new();
        for (j, key) in keys.iter().enumerate().take(k).skip(lo) {
            match self.map.get(key) {
                Some(&w) => {
                    self.hold(w);
                    pages.push(w);
                }
                None => {
                    loads.push((j, self.host.pin(key)));
                    pages.push(GONE);
                }
            }
        }
        for (j, h) in loads {
            let w = self.take(log);
            self.host.load(h, w);
            self.enter(keys[j], w);
            pages[j] = w;
        }
        let mut out = WindowPages { pages, lo, keys };
        self.grow(&mut out, total, log);
        out
    }

    /// Fresh pages for a request's pages up to `total` (the caller reserved them).
    pub fn grow(&mut self, r: &mut WindowPages, total: usize, log: &mut EventLog) {
        while r.pages.len() < total {
            let w = self.take(log);
            r.pages.push(w);
        }
    }

    /// After a commit or an extend, or before a close: enters the request's computed full
    /// pages up to `published` (a page count) under their keys, then releases the pages below
    /// what a hit of `next` tokens reads (see the module's doc for `next`).
    pub fn advance(
        &mut self,
        r: &mut WindowPages,
        tokens: &[u32],
        namespace: &Namespace,
        published: usize,
        next: usize,
        log: &mut EventLog,
    ) {
        let p = self.page_size;
        // The run of pages entered, for one event: its first page and keys.
        let (mut first, mut run) = (0, Vec::new());
        while r.keys.len() < published {
            let j = r.keys.len();
            let prev = match r.keys.last() {
                Some(h) => *h,
                None => root_hash(p, namespace),
            };
            let key = next_hash(&prev, &tokens[j * p..(j + 1) * p]);
            r.keys.push(key);
            let w = r.pages[j];
            if w == GONE {
                continue;
            }
            if let Some(&cached) = self.map.get(&key) {
                // Another request published this page's window first: hold its page (the same
                // KV: a page's KV is a function of its prefix) and free this private copy, so
                // that the key stays findable for as long as this request holds the page.
                if cached != w {
                    self.hold(cached);
                    r.pages[j] = cached;
                    self.unhold(w);
                }
                continue;
            }
            // On the window host tier already: this fresh page takes its place (no event: the
            // key stays in the group).
            let moved = self.host.forget(&key);
            self.enter(key, w);
            if log.on && !moved {
                if run.is_empty() {
                    first = j;
                } else if first + run.len() != j {
                    let done = std::mem::take(&mut run);
                    Self::stored(log, r, tokens, namespace, (first, p), done);
                    first = j;
                }
                run.push(key);
            }
        }
        if !run.is_empty() {
            Self::stored(log, r, tokens, namespace, (first, p), run);
        }
        let lo = self.first_needed(next).min(r.pages.len());
        while r.lo < lo {
            let w = std::mem::replace(&mut r.pages[r.lo], GONE);
            self.unhold(w);
            r.lo += 1;
        }
    }

    /// Records that the window pages of `run` (pages `first..` of `r`, `p` tokens each) entered
    /// the group.
    fn stored(
        log: &mut EventLog,
        r: &WindowPages,
        tokens: &[u32],
        namespace: &Namespace,
        (first, p): (usize, usize),
        run: Vec<BlockHash>,
    ) {
        let parent = first.checked_sub(1).map(|i| r.keys[i]);
        let tokens = tokens[first * p..(first + run.len()) * p].to_vec();
        log.window_stored(namespace, parent, run, tokens);
    }

    /// Gives back a request's window pages past its first `total` pages (speculative decoding's
    /// rejected drafts: fresh pages, never entered under a key, freed at once). The caller keeps
    /// `total` at or above the pages the request's index published and its held window.
    pub fn truncate(&mut self, r: &mut WindowPages, total: usize) {
        debug_assert!(r.keys.len() <= total && r.lo <= total);
        for w in r.pages.split_off(total.min(r.pages.len())) {
            if w != GONE {
                self.unhold(w);
            }
        }
    }

    /// Releases every page a closing request holds.
    pub fn close(&mut self, r: &WindowPages) {
        for &w in &r.pages[r.lo..] {
            self.unhold(w);
        }
    }

    /// Drops every cached page no request holds; returns how many.
    pub fn reset(&mut self, log: &mut EventLog) -> usize {
        let mut n = self.host.reset(log);
        while let Some(w) = self.lists.pop_front(LRU) {
            self.uncache(w.0, log);
            self.lists.push_back(FREE, w);
            n += 1;
        }
        self.evicted += n as u64;
        n
    }

    fn hold(&mut self, w: u32) {
        if self.refs[w as usize] == 0 {
            self.lists.remove(LRU, PageId(w));
        }
        self.refs[w as usize] += 1;
    }

    fn unhold(&mut self, w: u32) {
        let i = w as usize;
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            let list = if self.cached[i] { LRU } else { FREE };
            self.lists.push_back(list, PageId(w));
        }
    }

    /// A page for new KV, held once: FREE's front, else the least recently released cached page
    /// (its KV offloaded first, with a host tier).
    fn take(&mut self, log: &mut EventLog) -> u32 {
        let w = match self.lists.pop_front(FREE) {
            Some(w) => w.0,
            None => {
                let w = self.lists.pop_front(LRU).expect("window pages reserved").0;
                // Without a host tier (or with every host page pinned) nothing moves.
                let (moved, dropped) = self.host.offload(w, self.key[w as usize], log);
                if moved {
                    self.map.remove(&self.key[w as usize]);
                    self.cached[w as usize] = false;
                } else {
                    self.uncache(w, log);
                }
                self.evicted += (!moved) as u64 + dropped as u64;
                w
            }
        };
        self.refs[w as usize] = 1;
        w
    }

    /// Caches page `w` under `key`.
    fn enter(&mut self, key: BlockHash, w: u32) {
        self.map.insert(key, w);
        self.key[w as usize] = key;
        self.cached[w as usize] = true;
    }

    fn uncache(&mut self, w: u32, log: &mut EventLog) {
        let i = w as usize;
        if self.cached[i] {
            self.map.remove(&self.key[i]);
            self.cached[i] = false;
            if log.on {
                log.window_removed(self.key[i]);
            }
        }
    }

    /// Heap bytes of the group's bookkeeping.
    pub fn heap_bytes(&self) -> usize {
        self.map.capacity() * (32 + 4 + 8)
            + self.key.capacity() * 32
            + self.cached.capacity()
            + self.refs.capacity() * 4
            + self.lists.heap_bytes()
            + self.host.heap_bytes()
    }

    /// The group's invariants against the live requests' window pages, recomputed from
    /// scratch: each page free, cached and unheld (on LRU), or held (on no list) as many times
    /// as requests name it; the map and the keys agree; each request holds exactly the pages
    /// a hit at its boundary `next` reads and what follows (`first_needed(next)..`); a page
    /// nobody else can
    /// find (uncached) is held by one request.
    pub fn check<'a>(
        &self,
        requests: impl Iterator<Item = (&'a WindowPages, usize, usize, usize)>,
    ) -> Result<()> {
        let mut refs = vec![0u32; self.pages];
        for (r, num_pages, published, next) in requests {
            if r.pages.len() != num_pages {
                return corrupt(format!(
                    "a request has {} window entries for {num_pages} pages",
                    r.pages.len()
                ));
            }
            if r.keys.len() != published {
                return corrupt(format!(
                    "a request's window group saw {} pages published, the index {published}",
                    r.keys.len()
                ));
            }
            let lo = self.first_needed(next).min(num_pages);
            if r.lo != lo {
                return corrupt(format!(
                    "a request holds window pages from page {}, a hit of its {next} tokens reads \
                     from page {lo}",
                    r.lo
                ));
            }
            for (j, &w) in r.pages.iter().enumerate() {
                if (w == GONE) != (j < r.lo) {
                    return corrupt(format!("window entry {j} of a request is {w}, lo {lo}"));
                }
                if w != GONE {
                    if w as usize >= self.pages {
                        return corrupt(format!("window page {w} is past the pool"));
                    }
                    refs[w as usize] += 1;
                    if j < r.keys.len()
                        && self.cached[w as usize]
                        && self.key[w as usize] != r.keys[j]
                    {
                        return corrupt(format!("window page {w} is cached under another key"));
                    }
                }
            }
        }
        let (mut free, mut lru) = (0, 0);
        for (i, &n) in refs.iter().enumerate() {
            let id = PageId(i as u32);
            if n != self.refs[i] {
                return corrupt(format!(
                    "window page {i} is held {} times, requests name it {n} times",
                    self.refs[i]
                ));
            }
            if n > 1 && !self.cached[i] {
                return corrupt(format!("uncached window page {i} is held by {n} requests"));
            }
            if self.cached[i] && self.map.get(&self.key[i]) != Some(&(i as u32)) {
                return corrupt(format!("cached window page {i} is not found by its key"));
            }
            let linked = self.lists.is_linked(id);
            if (n == 0) != linked {
                return corrupt(format!("window page {i}: held {n} times, listed {linked}"));
            }
            if n == 0 {
                if self.cached[i] {
                    lru += 1
                } else {
                    free += 1
                }
            }
        }
        if free != self.free_pages() || lru != self.evictable_pages() {
            return corrupt(format!(
                "window lists hold {} free and {} evictable pages, {free} and {lru} expected",
                self.free_pages(),
                self.evictable_pages()
            ));
        }
        if self.map.len() != self.cached.iter().filter(|&&c| c).count() {
            return corrupt("the window map and the cached pages differ in number");
        }
        self.host.check(|key| self.map.contains_key(key))
    }

    /// Feeds the group's state into `d`: sizes, the free list in order, the LRU list in order
    /// with each page's key, and each cached held page's key in page order.
    pub fn digest(&self, d: &mut StateDigest) {
        d.word(self.window as u64);
        d.word(self.pages as u64);
        for list in [FREE, LRU] {
            d.word(self.lists.len(list) as u64);
            for w in self.lists.iter(list) {
                d.word(w.0 as u64);
                if list == LRU {
                    d.bytes(&self.key[w.0 as usize]);
                }
            }
        }
        for i in 0..self.pages {
            if self.refs[i] > 0 {
                d.word(i as u64);
                d.word(self.refs[i] as u64);
                d.word(self.cached[i] as u64);
                if self.cached[i] {
                    d.bytes(&self.key[i]);
                }
            }
        }
        self.host.digest(d);
    }
}

/// The life cycle's part of the window group: construction, the cut hit, and the window pages
/// of requests as they commit and close.
impl<I: Index> Cache<I> {
    /// A cache whose sliding-window layers (each query reads the last `window` keys) keep their
    /// KV in a pool of their own, of `window_pages` pages: the full-attention pages are the
    /// index's as always; a window page is held only while a live request's next query reads
    /// it (see `cache/window.rs` and SEMANTICS.md, "Sliding-window layers").
    pub fn with_window(
        num_pages: usize,
        page_size: usize,
        window: usize,
        window_pages: usize,
    ) -> Result<Self> {
        Self::windowed(Self::new(num_pages, page_size)?, window, window_pages, 0)
    }

    /// `c` given a window group of `window_pages` pages and a window host tier of `host_pages`.
    pub(crate) fn windowed(
        mut c: Self,
        window: usize,
        window_pages: usize,
        host_pages: usize,
    ) -> Result<Self> {
        let page_size = c.index.page_size();
        if window == 0 || window_pages == 0 {
            return Err(invalid(format!(
                "a window group needs window >= 1 (tokens) and window_pages >= 1, got \
                 window={window} and window_pages={window_pages}"
            )));
        }
        if window_pages > i32::MAX as usize
            || window_pages
                .checked_mul(page_size)
                .map_or(true, |s| s > i64::MAX as usize)
        {
            return Err(invalid(format!(
                "window_pages must be below 2**31 and window_pages * page_size fit in int64, \
                 got {window_pages}"
            )));
        }
        if host_pages > i32::MAX as usize
            || host_pages
                .checked_mul(page_size)
                .map_or(true, |s| s > i64::MAX as usize)
        {
            return Err(invalid(format!(
                "window_host_pages must be below 2**31 and window_host_pages * page_size fit in \
                 int64, got {host_pages}"
            )));
        }
        if host_pages > 0 && !c.index.tier().on() {
            return Err(invalid(format!(
                "window_host_pages={host_pages} needs a host tier: pass host_pages > 0 as well"
            )));
        }
        c.window = Window::new(window, window_pages, page_size, host_pages).map_err(|e| {
            invalid(format!(
                "window_pages={window_pages} with window_host_pages={host_pages} is too large for \
                 this machine: {e}"
            ))
        })?;
        Ok(c)
    }

    /// The longest prefix of `tokens[..limit]` a request can start from: the index's match,
    /// cut (with a window group) to the longest one whose window is cached. Returns the lookup
    /// of the cut prefix, the block keys of its pages (with a window group), and the pages the
    /// cut took off.
    pub(crate) fn find(
        &self,
        tokens: &[u32],
        namespace: &Namespace,
    ) -> (Found<I::At>, Vec<BlockHash>, usize) {
        let found = self.index.lookup(tokens, namespace);
        if !self.window.on() || found.matched == 0 {
            return (found, Vec::new(), 0);
        }
        let p = self.index.page_size();
        let mut keys = crate::wire::hash::block_hashes(&tokens[..found.matched], p, namespace);
        let m = found.matched / p;
        let k = self.window.cut(&keys, m);
        if k == m {
            return (found, keys, 0);
        }
        keys.truncate(k);
        (self.index.lookup(&tokens[..k * p], namespace), keys, m - k)
    }

    /// A request's window pages after a publish: entered under their keys, the pages its next
    /// query no longer reads released.
    pub(crate) fn advance_window(
        window: &mut Window,
        r: &mut Request<I::Ext>,
        p: usize,
        log: &mut EventLog,
    ) {
        if window.on() {
            let Request {
                win,
                tokens,
                namespace,
                published,
                num_computed,
                ..
            } = r;
            window.advance(
                win,
                tokens,
                namespace,
                *published / p,
                hold_from(*num_computed, tokens.len(), p),
                log,
            );
        }
    }

    /// Releases a closing request's window pages, entering its published ones first when
    /// `publish`.
    pub(crate) fn close_window(&mut self, r: &mut Request<I::Ext>, publish: bool) {
        if self.window.on() {
            if publish {
                let p = self.index.page_size();
                Self::advance_window(&mut self.window, r, p, self.index.events());
            }
            self.window.close(&r.win);
        }
    }
}

/// Where a request's window pages start to be held: at the window a hit at its last computed
/// page boundary within the match limit reads (`(b + 1 - window) / P` for that boundary `b`),
/// so that a fork or the next turn finds its window; the next query, at `num_computed`, reads
/// from there or later.
pub(crate) fn hold_from(num_computed: usize, num_tokens: usize, page_size: usize) -> usize {
    num_computed.min(num_tokens - 1) / page_size * page_size
}
