//! The test harness shared by the test files (`tests/radix.rs`, `tests/block.rs`, the tier tests).
#![allow(dead_code)] // each test file uses its own subset

/// `at_page_sizes!(name, body, [1, 4])`: a test `name::at_page_sizes` that runs `body(p)` at
/// each page size.
#[macro_export]
macro_rules! at_page_sizes {
    ($name:ident, $body:ident, [$($p:expr),+]) => {
        mod $name {
            #[test]
            fn at_page_sizes() {
                $(super::$body($p);)+
            }
        }
    };
}

use radixkv::{CacheStats, CopyKind, Error, Namespace, PageCopy, PrefixCache, RequestId};

/// Admits `tokens`, computes them all and finishes; `check()` after.
pub fn run(c: &mut dyn PrefixCache, tokens: &[u32]) {
    let r = c.admit(tokens, None).unwrap();
    c.commit(r, tokens.len()).unwrap();
    c.finish(r).unwrap();
    c.check().unwrap();
}

/// The copies the cache logged since the last drain, as `(kind, src, dst)`.
pub fn copies(c: &mut dyn PrefixCache) -> Vec<(CopyKind, u32, u32)> {
    c.drain_copies()
        .into_iter()
        .map(|PageCopy { kind, src, dst }| (kind, src, dst))
        .collect()
}

pub struct Ck<C: PrefixCache> {
    pub c: C,
}

impl<C: PrefixCache> Ck<C> {
    pub fn check(&self) {
        if let Err(e) = self.c.check() {
            panic!("check() failed: {e}");
        }
    }
    pub fn try_admit_in(&mut self, t: &[u32], ns: &Namespace) -> Result<RequestId, Error> {
        let r = self.c.admit(t, ns.clone());
        self.check();
        r
    }
    pub fn try_admit(&mut self, t: &[u32]) -> Result<RequestId, Error> {
        self.try_admit_in(t, &None)
    }
    pub fn admit_in(&mut self, t: &[u32], ns: &Namespace) -> RequestId {
        self.try_admit_in(t, ns)
            .unwrap_or_else(|e| panic!("admit of {} tokens: {e}", t.len()))
    }
    pub fn admit(&mut self, t: &[u32]) -> RequestId {
        self.admit_in(t, &None)
    }
    pub fn try_extend(&mut self, id: RequestId, t: &[u32]) -> Result<(), Error> {
        let r = self.c.extend(id, t);
        self.check();
        r
    }
    pub fn extend(&mut self, id: RequestId, t: &[u32]) {
        self.try_extend(id, t).unwrap();
    }
    /// `extend` that must fail with `OutOfPages { needed, available }` and change nothing.
    pub fn extend_short(&mut self, id: RequestId, t: &[u32], needed: usize, available: usize) {
        let (stats, pages) = (self.stats(), self.pages(id));
        let n = self.c.request(id).unwrap().num_tokens();
        let err = self.try_extend(id, t);
        assert_eq!(err, Err(Error::OutOfPages { needed, available }));
        assert_eq!((self.stats(), self.pages(id)), (stats, pages));
        assert_eq!(self.c.request(id).unwrap().num_tokens(), n);
    }
    pub fn try_commit(&mut self, id: RequestId, n: usize) -> Result<(), Error> {
        let r = self.c.commit(id, n);
        self.check();
        r
    }
    pub fn commit(&mut self, id: RequestId, n: usize) {
        self.try_commit(id, n).unwrap();
    }
    pub fn try_fork(&mut self, id: RequestId) -> Result<RequestId, Error> {
        let r = self.c.fork(id);
        self.check();
        r
    }
    pub fn fork(&mut self, id: RequestId) -> RequestId {
        self.try_fork(id).unwrap()
    }
    pub fn finish(&mut self, id: RequestId) {
        self.c.finish(id).unwrap();
        self.check();
    }
    pub fn abort(&mut self, id: RequestId) {
        self.c.abort(id).unwrap();
        self.check();
    }
    /// `match_prefix`, asserting that it changes nothing visible.
    pub fn matched_in(&self, t: &[u32], ns: &Namespace) -> usize {
        let before = self.c.stats();
        let m = self.c.match_prefix(t, ns).unwrap();
        assert_eq!(self.c.stats(), before, "match_prefix changed the stats");
        self.check();
        m
    }
    pub fn matched(&self, t: &[u32]) -> usize {
        self.matched_in(t, &None)
    }
    pub fn evict(&mut self, k: usize) -> usize {
        let n = self.c.evict(k);
        self.check();
        n
    }
    pub fn reset(&mut self) -> usize {
        let n = self.c.reset();
        self.check();
        n
    }
    pub fn pages(&self, id: RequestId) -> Vec<u32> {
        self.c
            .request(id)
            .unwrap()
            .pages
            .iter()
            .map(|p| p.0)
            .collect()
    }
    pub fn cached(&self, id: RequestId) -> usize {
        self.c.request(id).unwrap().num_cached
    }
    pub fn stats(&self) -> CacheStats {
        self.c.stats()
    }
    /// `(free, evictable, used)` pages.
    pub fn counts(&self) -> (usize, usize, usize) {
        let s = self.c.stats();
        assert_eq!(s.free_pages + s.evictable_pages + s.used_pages, s.num_pages);
        (s.free_pages, s.evictable_pages, s.used_pages)
    }
}

/// Tokens of whole pages: unit `s` is the page `[100 s, 100 s + 1, ..., 100 s + p - 1]`.
pub fn u(p: usize, syms: &[u32]) -> Vec<u32> {
    assert!(p <= 100);
    syms.iter()
        .flat_map(|&s| (0..p as u32).map(move |i| s * 100 + i))
        .collect()
}

pub fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

pub fn ns(s: &str) -> Namespace {
    Some(s.as_bytes().into())
}

pub fn range(a: u32, b: u32) -> Vec<u32> {
    (a..b).collect()
}
