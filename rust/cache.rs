//! The interface both indexes implement, and the argument checks they share.

use crate::error::{invalid, Error, Result};
use crate::request::RequestId;
use crate::stats::CacheStats;

/// A namespace: `None`, or the bytes of a str (utf-8) or bytes value. Requests in different
/// namespaces never share pages.
pub type Namespace = Option<Box<[u8]>>;

/// Where a step-by-step match stands: how many tokens matched so far, and the index position to
/// continue from. Valid only while the cache is unchanged (the scheduler holds the cache's lock
/// for a whole ranking pass).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    /// Tokens matched so far.
    pub matched: usize,
    pub(crate) node: u32,
    pub(crate) offset: usize,
    pub(crate) hash: [u8; 32],
}

/// A read-only view of one live request.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// Token ids so far.
    pub tokens: &'a [u32],
    /// Namespace the request was admitted in.
    pub namespace: &'a Namespace,
    /// Page table, `ceil(num_tokens / page_size)` entries.
    pub pages: &'a [u32],
    /// Tokens served from the cache at admission.
    pub num_cached: usize,
    /// Tokens whose KV has been written.
    pub num_computed: usize,
    /// Tokens per page.
    pub page_size: usize,
}

impl RequestView<'_> {
    /// Tokens in the request so far.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Slot of token `i`: `pages[i / P] * P + i % P`.
    pub fn slot(&self, i: usize) -> i64 {
        let p = self.page_size;
        self.pages[i / p] as i64 * p as i64 + (i % p) as i64
    }

    /// Slots of tokens `start..end`, appended to `out`.
    pub fn extend_slots(&self, start: usize, end: usize, out: &mut Vec<i64>) {
        let p = self.page_size;
        if p == 1 {
            out.extend(self.pages[start..end].iter().map(|&x| x as i64));
        } else {
            out.extend((start..end).map(|i| self.slot(i)));
        }
    }
}

/// A prefix cache over a fixed pool of pages: the operations of the design, for either index.
///
/// Every method either succeeds or returns an error having changed nothing.
pub trait PrefixCache: Send {
    /// Finds the longest cached prefix of `tokens` in `namespace`, pins its pages and allocates
    /// pages for the rest, all or nothing.
    fn admit(&mut self, tokens: &[u32], namespace: Namespace) -> Result<RequestId>;
    /// Appends tokens to a live request, allocating pages as needed.
    fn extend(&mut self, id: RequestId, tokens: &[u32]) -> Result<()>;
    /// Marks `tokens[..num_computed]` as written and publishes the full pages this completes.
    fn commit(&mut self, id: RequestId, num_computed: usize) -> Result<()>;
    /// A new request with the same tokens and namespace sharing the computed full pages of `id`.
    ///
    /// Commits publish computed full pages at once, so admitting `id`'s tokens again finds them
    /// (or an equal copy published earlier) and shares them without copying KV.
    fn fork(&mut self, id: RequestId) -> Result<RequestId> {
        let r = self.request(id)?;
        let (tokens, namespace) = (r.tokens.to_vec(), r.namespace.clone());
        self.admit(&tokens, namespace)
    }
    /// Extends each `(request, tokens)` in order and stops before the first one the pool cannot
    /// supply; returns how many were extended (that one and the rest are unchanged). Every
    /// request is checked first: a closed, foreign or repeated one changes nothing.
    fn extend_many(&mut self, batch: &[(RequestId, &[u32])]) -> Result<usize> {
        check_distinct(batch.iter().map(|b| b.0))?;
        for &(id, _) in batch {
            self.request(id)?;
        }
        for (done, &(id, tokens)) in batch.iter().enumerate() {
            match self.extend(id, tokens) {
                Ok(()) => {}
                Err(Error::OutOfPages { .. }) => return Ok(done),
                Err(e) => return Err(e),
            }
        }
        Ok(batch.len())
    }
    /// Commits each `(request, num_computed)`; every pair is checked first, all or nothing.
    fn commit_many(&mut self, batch: &[(RequestId, usize)]) -> Result<()> {
        check_distinct(batch.iter().map(|b| b.0))?;
        for &(id, n) in batch {
            let r = self.request(id)?;
            check_commit(n, r.num_computed, r.num_tokens())?;
        }
        for &(id, n) in batch {
            self.commit(id, n)?;
        }
        Ok(())
    }
    /// Publishes what is computed, unpins, frees what is not published, and closes the request.
    fn finish(&mut self, id: RequestId) -> Result<()>;
    /// Unpins and frees what is not published, publishing nothing more; closes the request.
    fn abort(&mut self, id: RequestId) -> Result<()>;
    /// How many tokens `admit` would find cached now. Changes nothing, LRU order included.
    fn match_prefix(&self, tokens: &[u32], namespace: &Namespace) -> Result<usize>;
    /// Evicts up to `num_pages` evictable pages in eviction order; returns how many.
    fn evict(&mut self, num_pages: usize) -> usize;
    /// Drops every evictable page; returns how many.
    fn reset(&mut self) -> usize;
    /// A snapshot of the counters.
    fn stats(&self) -> CacheStats;
    /// Recomputes every invariant from scratch; `Err(Corruption)` names the first broken one.
    fn check(&self) -> Result<()>;
    /// A view of a live request.
    fn request(&self, id: RequestId) -> Result<RequestView<'_>>;
    /// Heap bytes of the index and pool bookkeeping (requests excluded).
    fn metadata_bytes(&self) -> usize;
    /// Tokens per page.
    fn page_size(&self) -> usize;
    /// A cursor at the start of `namespace` (nothing matched yet).
    fn cursor(&self, namespace: &Namespace) -> Cursor;
    /// Continues a match over `tokens` (a whole number of pages); returns whether all of them
    /// matched. `cursor.matched` grows by the whole pages that did. Changes nothing.
    fn advance(&self, cursor: &mut Cursor, tokens: &[u32]) -> bool;
}

/// Checks the pool arguments shared by both caches.
pub(crate) fn check_pool_args(num_pages: usize, page_size: usize) -> Result<()> {
    if num_pages == 0 {
        return Err(invalid("num_pages must be at least 1, got 0"));
    }
    if num_pages > i32::MAX as usize {
        return Err(invalid(format!(
            "num_pages must be below 2**31, got {num_pages}"
        )));
    }
    if page_size == 0 {
        return Err(invalid("page_size must be at least 1, got 0"));
    }
    if page_size > 1 << 16 {
        return Err(invalid(format!(
            "page_size must be at most 65536, got {page_size}"
        )));
    }
    Ok(())
}

/// Checks a prompt.
pub(crate) fn check_prompt(tokens: &[u32]) -> Result<()> {
    if tokens.is_empty() {
        return Err(invalid(
            "tokens must hold at least one token, got an empty sequence",
        ));
    }
    Ok(())
}

/// Checks that a batch names each request once.
fn check_distinct(ids: impl Iterator<Item = RequestId>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for (i, id) in ids.enumerate() {
        if !seen.insert(id) {
            return Err(invalid(format!(
                "requests must be distinct, but entry {i} repeats an earlier request"
            )));
        }
    }
    Ok(())
}

/// Checks a `commit` target against a request.
pub(crate) fn check_commit(num_computed: usize, current: usize, num_tokens: usize) -> Result<()> {
    if num_computed > num_tokens {
        return Err(invalid(format!(
            "num_computed must be at most num_tokens ({num_tokens}), got {num_computed}"
        )));
    }
    if num_computed < current {
        return Err(invalid(format!(
            "num_computed must not decrease (it is {current}), got {num_computed}"
        )));
    }
    Ok(())
}

/// The most tokens a match may cover: at least one token is left to compute, whole pages only.
pub(crate) fn match_limit(num_tokens: usize, page_size: usize) -> usize {
    (num_tokens - 1) / page_size * page_size
}
