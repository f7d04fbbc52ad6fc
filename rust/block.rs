//! `BlockCache`: a map from chained block hash to page, in the style of vLLM's Automatic Prefix
//! Caching.
//!
//! Every full page of a request has a key, `h_i = H(h_{i-1}, tokens of page i)` (see
//! [`crate::hash`]), so a page's key names its whole prefix. Lookups walk a prompt's hashes until
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

use crate::cache::{check_commit, check_pool_args, check_prompt, match_limit, Namespace};
use crate::cache::{Cursor, PrefixCache, RequestView};
use crate::error::{corrupt, Error, Result};
use crate::hash::{next_hash, root_hash, BlockHash};
use crate::links::{Links, ListId};
use crate::request::{new_cache_id, Request, RequestId, Requests};
use crate::stats::{CacheStats, Counters};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const FREE: ListId = ListId(0);
const EVICTABLE: ListId = ListId(1);

/// Block hashes are uniformly random already: their first eight bytes are the table hash.
#[derive(Default)]
struct PrefixHasher(u64);

impl Hasher for PrefixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        if bytes.len() >= 8 {
            self.0 = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        }
    }
}

type HashMapToPage = HashMap<BlockHash, u32, BuildHasherDefault<PrefixHasher>>;

/// The block cache's own part of a request.
#[derive(Debug, Clone, Default)]
pub struct BlockExt {
    /// Hashes of its full pages computed so far.
    hashes: Vec<BlockHash>,
    /// `(position, stored page)` where this request computed a page that another request had
    /// published first: its own copy stays private, and it pins the stored one instead, so that
    /// the chain through its published pages stays whole (and reachable by `fork`) while it lives.
    stored: Vec<(u32, u32)>,
}

/// Page records and the hash map: everything besides the requests.
#[derive(Debug)]
struct Pool {
    page_size: usize,
    refcount: Vec<u32>,
    hash_of: Vec<Option<BlockHash>>,
    map: HashMapToPage,
    lists: Links,
    /// Of each hashed page: the hash of its prefix (`h_{i-1}`) and its tokens, `page_size` per
    /// page. With them a cached page answers "what is `H(prev, tokens)`" without blake3.
    parent_of: Vec<BlockHash>,
    tokens_of: Vec<u32>,
    /// `memo_key(prev, tokens)` -> a hashed page with that parent and those tokens (verified on
    /// use, so a collision of this 64-bit key only costs a blake3 call).
    memo: HashMap<u64, u32, BuildHasherDefault<PrefixHasher>>,
}

/// A fast 64-bit key of `(prev, tokens)` for the memo: two tokens a multiply.
fn memo_key(prev: &BlockHash, page: &[u32]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = u64::from_le_bytes(prev[..8].try_into().expect("8 bytes"));
    let mut pairs = page.chunks_exact(2);
    for pair in &mut pairs {
        h = (h ^ ((pair[0] as u64) << 32 | pair[1] as u64))
            .wrapping_mul(K)
            .rotate_left(23);
    }
    if let [t] = pairs.remainder() {
        h = (h ^ *t as u64).wrapping_mul(K);
    }
    (h ^ (h >> 29)).wrapping_mul(K)
}

impl Pool {
    fn available(&self) -> usize {
        self.lists.len(FREE) + self.lists.len(EVICTABLE)
    }

    /// Takes `count` pages, never-hashed ones first, then the least recently released cached
    /// ones (dropping their hashes). Returns how many cached pages were evicted.
    fn allocate(&mut self, count: usize, out: &mut Vec<u32>) -> usize {
        let mut evicted = 0;
        for _ in 0..count {
            let page = match self.lists.pop_front(FREE) {
                Some(p) => p,
                None => {
                    let p = self.lists.pop_front(EVICTABLE).expect("capacity checked");
                    self.unhash(p);
                    evicted += 1;
                    p
                }
            };
            self.refcount[page as usize] = 1;
            out.push(page);
        }
        evicted
    }

    fn unhash(&mut self, page: u32) {
        let h = self.hash_of[page as usize]
            .take()
            .expect("evictable pages are hashed");
        self.map.remove(&h);
        let key = memo_key(&self.parent_of[page as usize], self.page_tokens(page));
        if self.memo.get(&key) == Some(&page) {
            self.memo.remove(&key);
        }
    }

    fn page_tokens(&self, page: u32) -> &[u32] {
        let p = self.page_size;
        &self.tokens_of[page as usize * p..(page as usize + 1) * p]
    }

    /// Enters `page` into the index under `h = H(prev, tokens)`.
    fn hash_page(&mut self, page: u32, prev: &BlockHash, tokens: &[u32], h: BlockHash) {
        let p = self.page_size;
        self.map.insert(h, page);
        self.hash_of[page as usize] = Some(h);
        self.parent_of[page as usize] = *prev;
        self.tokens_of[page as usize * p..(page as usize + 1) * p].copy_from_slice(tokens);
        self.memo.insert(memo_key(prev, tokens), page);
    }

    /// `H(prev, tokens)`, and the cached page holding that prefix if there is one. A cached page
    /// with the same parent hash and tokens already carries the value, so blake3 runs only for
    /// content the cache does not hold.
    fn chain(&self, prev: &BlockHash, tokens: &[u32]) -> (BlockHash, Option<u32>) {
        if let Some(&page) = self.memo.get(&memo_key(prev, tokens)) {
            if self.parent_of[page as usize] == *prev && self.page_tokens(page) == tokens {
                let h = self.hash_of[page as usize].expect("memo pages are hashed");
                return (h, Some(page));
            }
        }
        let h = next_hash(prev, tokens);
        (h, self.map.get(&h).copied())
    }

    /// Pins a cached page (a hit).
    fn pin(&mut self, page: u32) {
        let rc = &mut self.refcount[page as usize];
        if *rc == 0 {
            self.lists.remove(EVICTABLE, page);
        }
        *rc += 1;
    }

    /// Drops one pin of a page: at refcount 0 a hashed page becomes the most recently used
    /// evictable page, an unhashed one the next free page.
    fn unpin(&mut self, page: u32) {
        let rc = &mut self.refcount[page as usize];
        *rc -= 1;
        if *rc == 0 {
            if self.hash_of[page as usize].is_some() {
                self.lists.push_back(EVICTABLE, page);
            } else {
                self.lists.push_front(FREE, page);
            }
        }
    }

    /// Drops a request's pins, its chain's tail first. At a position where the request holds a
    /// private duplicate, the stored copy it pinned is released right there in the chain.
    fn release(&mut self, pages: &[u32], stored: &[(u32, u32)]) {
        let mut stored = stored.iter().rev().peekable();
        for (i, &page) in pages.iter().enumerate().rev() {
            if let Some(&(_, copy)) = stored.next_if(|(at, _)| *at as usize == i) {
                self.unpin(copy);
            }
            self.unpin(page);
        }
    }

    /// Hashes of the full pages of `tokens` up to page `upto`, extending `hashes`.
    fn ensure_hashes(
        &self,
        tokens: &[u32],
        namespace: &Namespace,
        hashes: &mut Vec<BlockHash>,
        upto: usize,
    ) {
        let p = self.page_size;
        while hashes.len() < upto {
            let i = hashes.len();
            let prev = match hashes.last() {
                Some(h) => *h,
                None => root_hash(p, namespace),
            };
            hashes.push(self.chain(&prev, &tokens[i * p..(i + 1) * p]).0);
        }
    }

    /// Cached pages for the longest prefix of `tokens[..limit]`, hashing as it goes.
    fn lookup(
        &self,
        tokens: &[u32],
        namespace: &Namespace,
        limit: usize,
        hashes: &mut Vec<BlockHash>,
    ) -> Vec<u32> {
        let p = self.page_size;
        let mut hits = Vec::new();
        let mut prev = root_hash(p, namespace);
        for page in tokens[..limit].chunks_exact(p) {
            let (h, cached) = self.chain(&prev, page);
            hashes.push(h);
            match cached {
                Some(pg) => hits.push(pg),
                None => break,
            }
            prev = h;
        }
        hits
    }
}

/// A prefix cache indexed by chained block hashes.
#[derive(Debug)]
pub struct BlockCache {
    pool: Pool,
    num_pages: usize,
    requests: Requests<BlockExt>,
    counters: Counters,
}

impl BlockCache {
    /// A cache over `num_pages` pages of `page_size` tokens (16 is the usual choice).
    pub fn new(num_pages: usize, page_size: usize) -> Result<Self> {
        check_pool_args(num_pages, page_size)?;
        let mut lists = Links::new(2, num_pages);
        for page in 0..num_pages as u32 {
            lists.push_back(FREE, page);
        }
        Ok(BlockCache {
            pool: Pool {
                page_size,
                refcount: vec![0; num_pages],
                hash_of: vec![None; num_pages],
                map: HashMapToPage::default(),
                lists,
                parent_of: vec![[0; 32]; num_pages],
                tokens_of: vec![0; num_pages * page_size],
                memo: HashMap::default(),
            },
            num_pages,
            requests: Requests::new(new_cache_id()),
            counters: Counters::default(),
        })
    }

    fn p(&self) -> usize {
        self.pool.page_size
    }

    /// Publishes the full pages of `r` below `upto` tokens. A page whose hash another page holds
    /// already stays private to `r` (its table does not change) and is freed when `r` ends;
    /// `r` pins the stored copy in its place.
    fn publish(pool: &mut Pool, r: &mut Request<BlockExt>, upto: usize) {
        let p = pool.page_size;
        let (first, last) = (r.published / p, upto / p);
        if last <= first {
            return;
        }
        pool.ensure_hashes(&r.tokens, &r.namespace, &mut r.ext.hashes, last);
        for i in first..last {
            let h = r.ext.hashes[i];
            match pool.map.get(&h) {
                Some(&copy) => {
                    pool.pin(copy);
                    r.ext.stored.push((i as u32, copy));
                }
                None => {
                    let prev = if i == 0 {
                        root_hash(p, &r.namespace)
                    } else {
                        r.ext.hashes[i - 1]
                    };
                    pool.hash_page(r.pages[i], &prev, &r.tokens[i * p..(i + 1) * p], h);
                }
            }
        }
        r.published = last * p;
    }

    fn release(&mut self, id: RequestId, publish: bool) -> Result<()> {
        let mut r = self.requests.remove(id)?;
        if publish {
            let upto = r.num_computed / self.p() * self.p();
            Self::publish(&mut self.pool, &mut r, upto);
        }
        self.pool.release(&r.pages, &r.ext.stored);
        Ok(())
    }
}

impl PrefixCache for BlockCache {
    fn admit(&mut self, tokens: &[u32], namespace: Namespace) -> Result<RequestId> {
        check_prompt(tokens)?;
        let (p, n) = (self.p(), tokens.len());
        let mut hashes = Vec::with_capacity(n / p);
        let hits = self
            .pool
            .lookup(tokens, &namespace, match_limit(n, p), &mut hashes);
        hashes.truncate(hits.len());
        let needed = n.div_ceil(p) - hits.len();
        let pinned = hits
            .iter()
            .filter(|&&pg| self.pool.refcount[pg as usize] == 0)
            .count();
        let available = self.pool.available() - pinned;
        if needed > available {
            return Err(Error::OutOfPages { needed, available });
        }
        for &page in &hits {
            self.pool.pin(page);
        }
        let matched = hits.len() * p;
        let mut pages = hits;
        pages.reserve_exact(needed);
        self.counters.evicted_pages += self.pool.allocate(needed, &mut pages) as u64;
        self.counters.record_query(n, matched);
        Ok(self.requests.insert(Request {
            tokens: tokens.to_vec(),
            namespace,
            pages,
            num_cached: matched,
            num_computed: matched,
            published: matched,
            ext: BlockExt {
                hashes,
                stored: Vec::new(),
            },
        }))
    }

    fn extend(&mut self, id: RequestId, tokens: &[u32]) -> Result<()> {
        let p = self.p();
        let r = self.requests.get(id)?;
        let needed = (r.tokens.len() + tokens.len()).div_ceil(p) - r.pages.len();
        let available = self.pool.available();
        if needed > available {
            return Err(Error::OutOfPages { needed, available });
        }
        let r = self.requests.get_mut(id)?;
        self.counters.evicted_pages += self.pool.allocate(needed, &mut r.pages) as u64;
        r.tokens.extend_from_slice(tokens);
        Ok(())
    }

    fn commit(&mut self, id: RequestId, num_computed: usize) -> Result<()> {
        let p = self.p();
        let r = self.requests.get_mut(id)?;
        check_commit(num_computed, r.num_computed, r.tokens.len())?;
        r.num_computed = num_computed;
        Self::publish(&mut self.pool, r, num_computed / p * p);
        Ok(())
    }

    fn finish(&mut self, id: RequestId) -> Result<()> {
        self.release(id, true)
    }

    fn abort(&mut self, id: RequestId) -> Result<()> {
        self.release(id, false)
    }

    fn match_prefix(&self, tokens: &[u32], namespace: &Namespace) -> Result<usize> {
        check_prompt(tokens)?;
        let mut scratch = Vec::new();
        let limit = match_limit(tokens.len(), self.p());
        Ok(self
            .pool
            .lookup(tokens, namespace, limit, &mut scratch)
            .len()
            * self.p())
    }

    fn evict(&mut self, num_pages: usize) -> usize {
        let mut done = 0;
        while done < num_pages {
            let Some(page) = self.pool.lists.pop_front(EVICTABLE) else {
                break;
            };
            self.pool.unhash(page);
            self.pool.lists.push_front(FREE, page);
            done += 1;
        }
        self.counters.evicted_pages += done as u64;
        done
    }

    fn reset(&mut self) -> usize {
        self.evict(usize::MAX)
    }

    fn stats(&self) -> CacheStats {
        let (free, evictable) = (self.pool.lists.len(FREE), self.pool.lists.len(EVICTABLE));
        self.counters
            .snapshot(self.num_pages, self.p(), free, evictable)
    }

    fn check(&self) -> Result<()> {
        let pool = &self.pool;
        let p = pool.page_size;
        let mut refs = vec![0u32; self.num_pages];
        for r in self.requests.iter() {
            if r.pages.len() != r.tokens.len().div_ceil(p)
                || r.published % p != 0
                || r.published > r.num_computed
            {
                return corrupt("a request's page table or published count is malformed");
            }
            // Straight from the spec (no memo), so a wrong memo entry cannot vouch for itself.
            let full = &r.tokens[..r.ext.hashes.len() * p];
            if crate::hash::block_hashes(full, p, &r.namespace) != r.ext.hashes {
                return corrupt("a request's stored block hashes differ from its tokens'");
            }
            for (i, &page) in r.pages.iter().enumerate() {
                let Some(rc) = refs.get_mut(page as usize) else {
                    return corrupt(format!("a request holds page {page}, outside the pool"));
                };
                *rc += 1;
                if i < r.num_cached / p && pool.hash_of[page as usize] != Some(r.ext.hashes[i]) {
                    return corrupt(format!(
                        "page {page}, a cache hit, no longer holds its prefix"
                    ));
                }
            }
            for &(at, copy) in &r.ext.stored {
                let (at, copy) = (at as usize, copy as usize);
                let stands_for = at < r.published / p
                    && pool.hash_of[copy] == Some(r.ext.hashes[at])
                    && pool.hash_of[r.pages[at] as usize].is_none();
                if !stands_for {
                    return corrupt(format!(
                        "request position {at}: stored copy {copy} does not stand for its private page"
                    ));
                }
                refs[copy] += 1;
            }
        }
        for page in 0..self.num_pages {
            let rc = pool.refcount[page];
            if rc != refs[page] {
                return corrupt(format!(
                    "page {page} has refcount {rc}, live requests hold it {} times",
                    refs[page]
                ));
            }
            let linked = pool.lists.is_linked(page as u32);
            if linked != (rc == 0) {
                return corrupt(format!(
                    "page {page} with refcount {rc} is linked: {linked}"
                ));
            }
            if let Some(h) = pool.hash_of[page] {
                if next_hash(&pool.parent_of[page], pool.page_tokens(page as u32)) != h {
                    return corrupt(format!(
                        "page {page}: its parent hash and tokens do not hash to its key"
                    ));
                }
                if pool.map.get(&h) != Some(&(page as u32)) {
                    return corrupt(format!(
                        "page {page} is hashed but the map does not point to it"
                    ));
                }
            }
        }
        for (list, hashed, name) in [(FREE, false, "free"), (EVICTABLE, true, "evictable")] {
            for page in pool.lists.iter(list) {
                if pool.hash_of[page as usize].is_some() != hashed
                    || pool.refcount[page as usize] != 0
                {
                    return corrupt(format!("page {page} does not belong on the {name} list"));
                }
            }
        }
        for (&key, &page) in &pool.memo {
            let hashed = pool.hash_of[page as usize].is_some();
            if !hashed || memo_key(&pool.parent_of[page as usize], pool.page_tokens(page)) != key {
                return corrupt(format!("memo entry for page {page} is stale"));
            }
        }
        let hashed = pool.hash_of.iter().filter(|h| h.is_some()).count();
        if hashed != pool.map.len() {
            return corrupt(format!(
                "{hashed} pages are hashed, the map holds {}",
                pool.map.len()
            ));
        }
        if self.counters.hit_tokens > self.counters.query_tokens {
            return corrupt("more hit tokens than query tokens");
        }
        Ok(())
    }

    fn request(&self, id: RequestId) -> Result<RequestView<'_>> {
        Ok(self.requests.get(id)?.view(self.p()))
    }

    fn page_size(&self) -> usize {
        self.p()
    }

    fn cursor(&self, namespace: &Namespace) -> Cursor {
        Cursor {
            matched: 0,
            node: 0,
            offset: 0,
            hash: root_hash(self.p(), namespace),
        }
    }

    fn advance(&self, cursor: &mut Cursor, tokens: &[u32]) -> bool {
        for page in tokens.chunks_exact(self.p()) {
            let h = next_hash(&cursor.hash, page);
            if !self.pool.map.contains_key(&h) {
                return false;
            }
            cursor.hash = h;
            cursor.matched += page.len();
        }
        true
    }

    fn metadata_bytes(&self) -> usize {
        let pool = &self.pool;
        pool.refcount.capacity() * 4
            + pool.hash_of.capacity() * std::mem::size_of::<Option<BlockHash>>()
            + pool.map.capacity() * (std::mem::size_of::<(BlockHash, u32)>() + 1)
            + pool.lists.heap_bytes()
            + pool.parent_of.capacity() * 32
            + pool.tokens_of.capacity() * 4
            + pool.memo.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
    }
}
