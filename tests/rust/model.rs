//! Model-based tests: random operation sequences applied to a cache and to a naive reference
//! model that follows docs/SEMANTICS.md literally, page by page. After every step the results
//! (errors included), the stats and every live request's view must agree, and `check()` must pass.
//!
//! The models know nothing of trees, lists of nodes or hashes:
//! - radix: a map `(namespace, tokens[0 : (k+1) P]) -> (page, last use)`, pins recomputed from the
//!   live requests' published prefixes, a logical clock, a set of free ids (smallest first);
//! - block: a map `(namespace, prefix tokens) -> page` standing for the hash map, refcounts, and
//!   the FREE / EVICTABLE lists as `VecDeque`s.
//!
//! Independently of the models, a shadow of the KV pool checks the point of the whole thing: a
//! commit writes (a digest of) each token's KV into its slot, only in pages no other live request
//! holds, and every token a live request relies on (`0..num_computed`) still holds the KV of its
//! own prefix, whether computed or served from the cache. A cursor walk (`cursor`/`advance`, in
//! chunks of pages) must agree with `match_prefix`.
//!
//! `PROPTEST_CASES=n` runs more cases than the default.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use radixkv::{BlockCache, CacheStats, Error, Namespace, PrefixCache, RadixCache, RequestId};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

type Key = (Namespace, Vec<u32>);

/// What an error is, without its message.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ek {
    Invalid,
    OutOfPages { needed: usize, available: usize },
    Closed,
    Foreign,
    Corruption(String),
}

fn kind(e: &Error) -> Ek {
    match e {
        Error::InvalidArgument(_) => Ek::Invalid,
        Error::OutOfPages { needed, available } => Ek::OutOfPages {
            needed: *needed,
            available: *available,
        },
        Error::ClosedRequest => Ek::Closed,
        Error::ForeignRequest => Ek::Foreign,
        Error::Corruption(m) => Ek::Corruption(m.clone()),
    }
}

/// A live request of a model.
#[derive(Debug, Clone)]
struct MReq {
    tokens: Vec<u32>,
    ns: Namespace,
    pages: Vec<u32>,
    num_cached: usize,
    num_computed: usize,
    /// Page-aligned prefix this request has published (starts at `num_cached`).
    published: usize,
    /// Block model only: `(position, stored page)` pinned in place of a private duplicate.
    stored: Vec<(usize, u32)>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    queries: u64,
    query_tokens: u64,
    hit_tokens: u64,
    evicted: u64,
}

trait Model {
    fn admit(&mut self, tokens: &[u32], ns: &Namespace) -> Result<usize, Ek>;
    fn extend(&mut self, r: usize, tokens: &[u32]) -> Result<(), Ek>;
    fn commit(&mut self, r: usize, c: usize) -> Result<(), Ek>;
    fn finish(&mut self, r: usize);
    fn abort(&mut self, r: usize);
    fn match_prefix(&self, tokens: &[u32], ns: &Namespace) -> Result<usize, Ek>;
    fn evict(&mut self, k: usize) -> usize;
    fn stats(&self) -> CacheStats;
    fn req(&self, r: usize) -> &MReq;
    fn fork(&mut self, r: usize) -> Result<usize, Ek> {
        let (t, ns) = (self.req(r).tokens.clone(), self.req(r).ns.clone());
        self.admit(&t, &ns)
    }
    fn reset(&mut self) -> usize {
        self.evict(usize::MAX)
    }
}

fn limit(n: usize, p: usize) -> usize {
    (n - 1) / p * p
}

fn commit_args(r: &MReq, c: usize) -> Result<(), Ek> {
    if c > r.tokens.len() || c < r.num_computed {
        Err(Ek::Invalid)
    } else {
        Ok(())
    }
}

fn key(ns: &Namespace, tokens: &[u32], end: usize) -> Key {
    (ns.clone(), tokens[..end].to_vec())
}

// ---------------------------------------------------------------------------------- radix model

struct RadixModel {
    p: usize,
    n: usize,
    /// `(namespace, tokens[0 : (k+1) P]) -> (page, last-use time)`.
    index: BTreeMap<Key, (u32, u64)>,
    free: BTreeSet<u32>,
    clock: u64,
    reqs: Vec<Option<MReq>>,
    c: Counters,
}

impl RadixModel {
    fn new(n: usize, p: usize) -> Self {
        RadixModel {
            p,
            n,
            index: BTreeMap::new(),
            free: (0..n as u32).collect(),
            clock: 0,
            reqs: Vec::new(),
            c: Counters::default(),
        }
    }

    /// Some live request's published prefix covers `k`.
    fn pinned(&self, k: &Key) -> bool {
        self.reqs
            .iter()
            .flatten()
            .any(|r| r.ns == k.0 && r.published >= k.1.len() && r.tokens[..k.1.len()] == k.1[..])
    }

    fn num_evictable(&self) -> usize {
        self.index.keys().filter(|k| !self.pinned(k)).count()
    }

    /// No key in the index extends `k` by exactly one page.
    fn is_leaf(&self, k: &Key) -> bool {
        let len = k.1.len();
        !self
            .index
            .keys()
            .any(|o| o.0 == k.0 && o.1.len() == len + self.p && o.1[..len] == k.1[..])
    }

    /// Evicts the unpinned leaf page with the smallest last-use time.
    fn evict_one(&mut self) -> bool {
        let mut cands: Vec<(u64, Key)> = self
            .index
            .iter()
            .filter(|(k, _)| !self.pinned(k) && self.is_leaf(k))
            .map(|(k, &(_, t))| (t, k.clone()))
            .collect();
        if cands.is_empty() {
            return false;
        }
        cands.sort();
        if cands.len() > 1 {
            // SEMANTICS.md: two different leaf pages never share a time.
            assert_ne!(cands[0].0, cands[1].0, "model: two leaf pages share a time");
        }
        let (page, _) = self.index.remove(&cands[0].1).unwrap();
        self.free.insert(page);
        self.c.evicted += 1;
        true
    }

    fn matched(&self, tokens: &[u32], ns: &Namespace) -> usize {
        let (p, lim) = (self.p, limit(tokens.len(), self.p));
        let mut m = 0;
        while m + p <= lim && self.index.contains_key(&key(ns, tokens, m + p)) {
            m += p;
        }
        m
    }

    /// A new tick for every page of request `r`'s pinned (published) prefix.
    fn stamp(&mut self, r: usize) {
        self.clock += 1;
        let req = self.reqs[r].as_ref().unwrap();
        let keys: Vec<Key> = (1..=req.published / self.p)
            .map(|k| key(&req.ns, &req.tokens, k * self.p))
            .collect();
        for k in keys {
            self.index
                .get_mut(&k)
                .expect("model: pinned page missing")
                .1 = self.clock;
        }
    }

    /// Evicts what is missing, then takes the smallest free ids one by one.
    fn allocate(&mut self, count: usize) -> Vec<u32> {
        for _ in 0..count.saturating_sub(self.free.len()) {
            assert!(self.evict_one(), "model: capacity was checked");
        }
        (0..count).map(|_| self.free.pop_first().unwrap()).collect()
    }

    fn publish(&mut self, r: usize, upto: usize) {
        let p = self.p;
        let req = self.reqs[r].as_ref().unwrap();
        let (first, last) = (req.published / p, upto / p);
        if last <= first {
            return;
        }
        let new: Vec<(Key, u32)> = (first..last)
            .map(|k| (key(&req.ns, &req.tokens, (k + 1) * p), req.pages[k]))
            .collect();
        for (k, page) in new {
            // A page the index holds already stays private to the request (a duplicate).
            self.index.entry(k).or_insert((page, 0));
        }
        self.reqs[r].as_mut().unwrap().published = last * p;
        self.stamp(r);
    }

    fn release(&mut self, r: usize) {
        self.stamp(r);
        let req = self.reqs[r].take().unwrap();
        let held: BTreeSet<u32> = self.index.values().map(|v| v.0).collect();
        for page in req.pages {
            if !held.contains(&page) {
                assert!(self.free.insert(page), "model: page {page} freed twice");
            }
        }
    }
}

impl Model for RadixModel {
    fn admit(&mut self, tokens: &[u32], ns: &Namespace) -> Result<usize, Ek> {
        if tokens.is_empty() {
            return Err(Ek::Invalid);
        }
        let p = self.p;
        let m = self.matched(tokens, ns);
        let needed = tokens.len().div_ceil(p) - m / p;
        let pinned_by_match = (1..=m / p)
            .filter(|&k| !self.pinned(&key(ns, tokens, k * p)))
            .count();
        let available = self.free.len() + self.num_evictable() - pinned_by_match;
        if needed > available {
            return Err(Ek::OutOfPages { needed, available });
        }
        let mut pages: Vec<u32> = (1..=m / p)
            .map(|k| self.index[&key(ns, tokens, k * p)].0)
            .collect();
        self.reqs.push(Some(MReq {
            tokens: tokens.to_vec(),
            ns: ns.clone(),
            pages: Vec::new(),
            num_cached: m,
            num_computed: m,
            published: m,
            stored: Vec::new(),
        }));
        let r = self.reqs.len() - 1;
        self.stamp(r);
        pages.extend(self.allocate(needed));
        self.reqs[r].as_mut().unwrap().pages = pages;
        self.c.queries += 1;
        self.c.query_tokens += tokens.len() as u64;
        self.c.hit_tokens += m as u64;
        Ok(r)
    }

    fn extend(&mut self, r: usize, tokens: &[u32]) -> Result<(), Ek> {
        let req = self.reqs[r].as_ref().unwrap();
        let needed = (req.tokens.len() + tokens.len()).div_ceil(self.p) - req.pages.len();
        let available = self.free.len() + self.num_evictable();
        if needed > available {
            return Err(Ek::OutOfPages { needed, available });
        }
        let new = self.allocate(needed);
        let req = self.reqs[r].as_mut().unwrap();
        req.pages.extend(new);
        req.tokens.extend_from_slice(tokens);
        Ok(())
    }

    fn commit(&mut self, r: usize, c: usize) -> Result<(), Ek> {
        commit_args(self.req(r), c)?;
        self.reqs[r].as_mut().unwrap().num_computed = c;
        self.publish(r, c / self.p * self.p);
        Ok(())
    }

    fn finish(&mut self, r: usize) {
        let c = self.req(r).num_computed;
        self.publish(r, c / self.p * self.p);
        self.release(r);
    }

    fn abort(&mut self, r: usize) {
        self.release(r);
    }

    fn match_prefix(&self, tokens: &[u32], ns: &Namespace) -> Result<usize, Ek> {
        if tokens.is_empty() {
            return Err(Ek::Invalid);
        }
        Ok(self.matched(tokens, ns))
    }

    fn evict(&mut self, k: usize) -> usize {
        let mut done = 0;
        while done < k && self.evict_one() {
            done += 1;
        }
        done
    }

    fn stats(&self) -> CacheStats {
        let (free, evictable) = (self.free.len(), self.num_evictable());
        CacheStats {
            num_pages: self.n,
            page_size: self.p,
            free_pages: free,
            evictable_pages: evictable,
            used_pages: self.n - free - evictable,
            queries: self.c.queries,
            query_tokens: self.c.query_tokens,
            hit_tokens: self.c.hit_tokens,
            evicted_pages: self.c.evicted,
        }
    }

    fn req(&self, r: usize) -> &MReq {
        self.reqs[r].as_ref().unwrap()
    }
}

// ---------------------------------------------------------------------------------- block model

struct BlockModel {
    p: usize,
    n: usize,
    refcount: Vec<u32>,
    /// The "hash" of a page: the key of its whole prefix.
    key_of: Vec<Option<Key>>,
    map: HashMap<Key, u32>,
    free: VecDeque<u32>,
    evictable: VecDeque<u32>,
    reqs: Vec<Option<MReq>>,
    c: Counters,
}

impl BlockModel {
    fn new(n: usize, p: usize) -> Self {
        BlockModel {
            p,
            n,
            refcount: vec![0; n],
            key_of: vec![None; n],
            map: HashMap::new(),
            free: (0..n as u32).collect(),
            evictable: VecDeque::new(),
            reqs: Vec::new(),
            c: Counters::default(),
        }
    }

    fn hits(&self, tokens: &[u32], ns: &Namespace) -> Vec<u32> {
        let (p, lim) = (self.p, limit(tokens.len(), self.p));
        let mut hits = Vec::new();
        while (hits.len() + 1) * p <= lim {
            match self.map.get(&key(ns, tokens, (hits.len() + 1) * p)) {
                Some(&page) => hits.push(page),
                None => break,
            }
        }
        hits
    }

    fn unhash(&mut self, page: u32) {
        let k = self.key_of[page as usize].take().expect("model: hashed");
        assert_eq!(self.map.remove(&k), Some(page));
    }

    fn allocate(&mut self, count: usize) -> Vec<u32> {
        (0..count)
            .map(|_| {
                let page = match self.free.pop_front() {
                    Some(page) => page,
                    None => {
                        let page = self.evictable.pop_front().expect("model: capacity checked");
                        self.unhash(page);
                        self.c.evicted += 1;
                        page
                    }
                };
                self.refcount[page as usize] = 1;
                page
            })
            .collect()
    }

    fn publish(&mut self, r: usize, upto: usize) {
        let p = self.p;
        let req = self.reqs[r].as_ref().unwrap();
        let (first, last) = (req.published / p, upto / p);
        if last <= first {
            return;
        }
        let new: Vec<(Key, u32)> = (first..last)
            .map(|k| (key(&req.ns, &req.tokens, (k + 1) * p), req.pages[k]))
            .collect();
        for (i, (k, page)) in (first..last).zip(new) {
            match self.map.get(&k) {
                // A page the index holds already: the request's copy stays private and it pins
                // the stored one in its place.
                Some(&copy) => {
                    if self.refcount[copy as usize] == 0 {
                        let at = self.evictable.iter().position(|&x| x == copy).unwrap();
                        self.evictable.remove(at);
                    }
                    self.refcount[copy as usize] += 1;
                    self.reqs[r].as_mut().unwrap().stored.push((i, copy));
                }
                None => {
                    self.map.insert(k.clone(), page);
                    self.key_of[page as usize] = Some(k);
                }
            }
        }
        self.reqs[r].as_mut().unwrap().published = last * p;
    }

    fn unpin(&mut self, page: u32) {
        let rc = &mut self.refcount[page as usize];
        *rc -= 1;
        if *rc == 0 {
            if self.key_of[page as usize].is_some() {
                self.evictable.push_back(page);
            } else {
                self.free.push_front(page);
            }
        }
    }

    /// Last position to first; at a duplicate position the stored copy first, then the
    /// request's private page.
    fn release(&mut self, r: usize) {
        let req = self.reqs[r].take().unwrap();
        for (i, &page) in req.pages.iter().enumerate().rev() {
            if let Some(&(_, copy)) = req.stored.iter().find(|(at, _)| *at == i) {
                self.unpin(copy);
            }
            self.unpin(page);
        }
    }
}

impl Model for BlockModel {
    fn admit(&mut self, tokens: &[u32], ns: &Namespace) -> Result<usize, Ek> {
        if tokens.is_empty() {
            return Err(Ek::Invalid);
        }
        let hits = self.hits(tokens, ns);
        let needed = tokens.len().div_ceil(self.p) - hits.len();
        let pinned_by_match = hits
            .iter()
            .filter(|&&pg| self.refcount[pg as usize] == 0)
            .count();
        let available = self.free.len() + self.evictable.len() - pinned_by_match;
        if needed > available {
            return Err(Ek::OutOfPages { needed, available });
        }
        for &page in &hits {
            if self.refcount[page as usize] == 0 {
                let at = self.evictable.iter().position(|&x| x == page).unwrap();
                self.evictable.remove(at);
            }
            self.refcount[page as usize] += 1;
        }
        let m = hits.len() * self.p;
        let mut pages = hits;
        pages.extend(self.allocate(needed));
        self.c.queries += 1;
        self.c.query_tokens += tokens.len() as u64;
        self.c.hit_tokens += m as u64;
        self.reqs.push(Some(MReq {
            tokens: tokens.to_vec(),
            ns: ns.clone(),
            pages,
            num_cached: m,
            num_computed: m,
            published: m,
            stored: Vec::new(),
        }));
        Ok(self.reqs.len() - 1)
    }

    fn extend(&mut self, r: usize, tokens: &[u32]) -> Result<(), Ek> {
        let req = self.req(r);
        let needed = (req.tokens.len() + tokens.len()).div_ceil(self.p) - req.pages.len();
        let available = self.free.len() + self.evictable.len();
        if needed > available {
            return Err(Ek::OutOfPages { needed, available });
        }
        let new = self.allocate(needed);
        let req = self.reqs[r].as_mut().unwrap();
        req.pages.extend(new);
        req.tokens.extend_from_slice(tokens);
        Ok(())
    }

    fn commit(&mut self, r: usize, c: usize) -> Result<(), Ek> {
        commit_args(self.req(r), c)?;
        self.reqs[r].as_mut().unwrap().num_computed = c;
        self.publish(r, c / self.p * self.p);
        Ok(())
    }

    fn finish(&mut self, r: usize) {
        let c = self.req(r).num_computed;
        self.publish(r, c / self.p * self.p);
        self.release(r);
    }

    fn abort(&mut self, r: usize) {
        self.release(r);
    }

    fn match_prefix(&self, tokens: &[u32], ns: &Namespace) -> Result<usize, Ek> {
        if tokens.is_empty() {
            return Err(Ek::Invalid);
        }
        Ok(self.hits(tokens, ns).len() * self.p)
    }

    fn evict(&mut self, k: usize) -> usize {
        let mut done = 0;
        while done < k {
            let Some(page) = self.evictable.pop_front() else {
                break;
            };
            self.unhash(page);
            self.free.push_front(page);
            self.c.evicted += 1;
            done += 1;
        }
        done
    }

    fn stats(&self) -> CacheStats {
        let (free, evictable) = (self.free.len(), self.evictable.len());
        CacheStats {
            num_pages: self.n,
            page_size: self.p,
            free_pages: free,
            evictable_pages: evictable,
            used_pages: self.n - free - evictable,
            queries: self.c.queries,
            query_tokens: self.c.query_tokens,
            hit_tokens: self.c.hit_tokens,
            evicted_pages: self.c.evicted,
        }
    }

    fn req(&self, r: usize) -> &MReq {
        self.reqs[r].as_ref().unwrap()
    }
}

// ------------------------------------------------------------------------------ operations, runner

/// `bases[base][..len] ++ tail` in namespace `ns`.
#[derive(Debug, Clone)]
struct Prompt {
    base: usize,
    len: usize,
    tail: Vec<u32>,
    ns: usize,
}

#[derive(Debug, Clone)]
enum Op {
    Admit(Prompt),
    /// `match_prefix`, and a cursor walk over the same tokens in chunks of `chunk` pages.
    Match(Prompt, usize),
    Extend(usize, Vec<u32>),
    /// Commit to `num_computed + frac % (left + 1)`, or to `num_tokens` for `frac >= 192`.
    Commit(usize, u8),
    /// Commit above `num_tokens` or below `num_computed`.
    BadCommit(usize, bool),
    Fork(usize),
    Finish(usize),
    Abort(usize),
    /// Some call with a closed request (`what < 6`) or another cache's request.
    Stale(usize, u8),
    Evict(usize),
    Reset,
}

fn namespace(i: usize) -> Namespace {
    match i {
        3 => Some(b"x".to_vec().into()),
        4 => Some(Vec::new().into()),
        _ => None,
    }
}

fn prompt() -> impl Strategy<Value = Prompt> {
    (0..3usize, 0..40usize, vec(0..3u32, 0..6), 0..5usize).prop_map(|(base, len, tail, ns)| {
        Prompt {
            base,
            len,
            tail,
            ns,
        }
    })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prompt().prop_map(Op::Admit),
        2 => (prompt(), 1..4usize).prop_map(|(p, c)| Op::Match(p, c)),
        2 => (0..64usize, vec(0..3u32, 1..6)).prop_map(|(r, t)| Op::Extend(r, t)),
        5 => (0..64usize, any::<u8>()).prop_map(|(r, f)| Op::Commit(r, f)),
        1 => (0..64usize, any::<bool>()).prop_map(|(r, a)| Op::BadCommit(r, a)),
        2 => (0..64usize).prop_map(Op::Fork),
        3 => (0..64usize).prop_map(Op::Finish),
        2 => (0..64usize).prop_map(Op::Abort),
        1 => (0..64usize, 0..12u8).prop_map(|(r, w)| Op::Stale(r, w)),
        1 => (0..6usize).prop_map(Op::Evict),
        1 => Just(Op::Reset),
    ]
}

/// Three prompts sharing a random trunk, over a 3-token alphabet (so that pages repeat).
fn bases() -> impl Strategy<Value = Vec<Vec<u32>>> {
    (vec(0..3u32, 0..12), vec(vec(0..3u32, 2..16), 3)).prop_map(|(trunk, bodies)| {
        bodies
            .into_iter()
            .map(|b| [&trunk[..], &b[..]].concat())
            .collect()
    })
}

fn build(bases: &[Vec<u32>], abc: &[u32; 3], p: &Prompt) -> (Vec<u32>, Namespace) {
    let base = &bases[p.base];
    let len = p.len % (base.len() + 1);
    (
        [&base[..len], &map(abc, &p.tail)[..]].concat(),
        namespace(p.ns),
    )
}

/// Generated tokens are 0, 1, 2: the alphabet names the token ids they stand for.
fn map(abc: &[u32; 3], t: &[u32]) -> Vec<u32> {
    t.iter().map(|&x| abc[x as usize]).collect()
}

/// Small ids, or ids spread over the whole u32 range.
fn alphabet() -> impl Strategy<Value = [u32; 3]> {
    prop_oneof![Just([0, 1, 2]), Just([0xFFFF_FFFF, 0, 0x8000_0001])]
}

/// A stand-in for the KV of token `i`: a digest of the namespace and `tokens[..=i]`, chained
/// token by token (causal attention: the KV of a token depends on its whole prefix only).
fn kv_digests(ns: &Namespace, tokens: &[u32]) -> Vec<u64> {
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let mut h = match ns {
        None => 1,
        Some(b) => b.iter().fold(2, |h, &x| mix(h ^ x as u64)),
    };
    tokens
        .iter()
        .map(|&t| {
            h = mix(h.rotate_left(17) ^ t as u64 ^ 0x5555_0000_0000);
            h
        })
        .collect()
}

fn res<T>(r: Result<T, Error>) -> Result<T, Ek> {
    r.map_err(|e| kind(&e))
}

/// Applies `ops` to the cache and the model, comparing everything after every step.
fn run<C: PrefixCache, M: Model>(
    cache: &mut C,
    model: &mut M,
    abc: &[u32; 3],
    bases: &[Vec<u32>],
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let p = cache.page_size();
    let bases: Vec<Vec<u32>> = bases.iter().map(|b| map(abc, b)).collect();
    let mut live: Vec<(RequestId, usize)> = Vec::new();
    let mut closed: Vec<RequestId> = Vec::new();
    // Slot -> digest of the KV written there (a shadow of the KV pool).
    let mut kv: HashMap<i64, u64> = HashMap::new();
    let mut other = RadixCache::new(4, 1).unwrap();
    let foreign = other.admit(&[1], None).unwrap();
    for (step, op) in ops.iter().enumerate() {
        let at = format!("step {step}: {op:?}");
        let pick = |i: usize, live: &[(RequestId, usize)]| -> Option<usize> {
            (!live.is_empty()).then(|| i % live.len())
        };
        match op {
            Op::Admit(pr) => {
                let (t, ns) = build(&bases, abc, pr);
                let got = res(cache.admit(&t, ns.clone()));
                let want = model.admit(&t, &ns);
                prop_assert_eq!(got.as_ref().err(), want.as_ref().err(), "{}", at);
                if let (Ok(id), Ok(m)) = (got, want) {
                    live.push((id, m));
                }
            }
            Op::Match(pr, chunk) => {
                let (t, ns) = build(&bases, abc, pr);
                let got = res(cache.match_prefix(&t, &ns));
                let want = model.match_prefix(&t, &ns);
                prop_assert_eq!(&got, &want, "{}", at);
                if let Ok(m) = want {
                    // The scheduler's step-by-step match agrees with match_prefix.
                    let lim = limit(t.len(), p);
                    let mut cur = cache.cursor(&ns);
                    let mut pos = 0;
                    while pos < lim {
                        let end = (pos + chunk * p).min(lim);
                        let all = cache.advance(&mut cur, &t[pos..end]);
                        prop_assert_eq!(all, cur.matched == end, "{} advance to {}", at, end);
                        if !all {
                            break;
                        }
                        pos = end;
                    }
                    prop_assert_eq!(cur.matched, m, "{} cursor", at);
                }
            }
            Op::Extend(i, t) => {
                if let Some(i) = pick(*i, &live) {
                    let (id, m) = live[i];
                    let t = map(abc, t);
                    let got = res(cache.extend(id, &t));
                    prop_assert_eq!(got, model.extend(m, &t), "{}", at);
                }
            }
            Op::Commit(i, frac) => {
                if let Some(i) = pick(*i, &live) {
                    let (id, m) = live[i];
                    let r = model.req(m);
                    let (n, done) = (r.tokens.len(), r.num_computed);
                    let c = if *frac >= 192 {
                        n
                    } else {
                        done + *frac as usize % (n - done + 1)
                    };
                    let got = res(cache.commit(id, c));
                    prop_assert_eq!(&got, &model.commit(m, c), "{} to {}", at, c);
                    if got.is_ok() {
                        // Write the KV of tokens done..c into their slots: pages that no other
                        // live request may hold.
                        let v = cache.request(id).unwrap();
                        let digests = kv_digests(v.namespace, v.tokens);
                        for i in done..c {
                            let page = v.pages[i / p];
                            for &(o, _) in &live {
                                let held =
                                    o != id && cache.request(o).unwrap().pages.contains(&page);
                                prop_assert!(
                                    !held,
                                    "{}: writes page {} another request holds",
                                    at,
                                    page
                                );
                            }
                            kv.insert(v.slot(i), digests[i]);
                        }
                    }
                }
            }
            Op::BadCommit(i, above) => {
                if let Some(i) = pick(*i, &live) {
                    let (id, m) = live[i];
                    let r = model.req(m);
                    let c = if *above || r.num_computed == 0 {
                        r.tokens.len() + 1
                    } else {
                        r.num_computed - 1
                    };
                    let got = res(cache.commit(id, c));
                    prop_assert_eq!(&got, &Err(Ek::Invalid), "{}", at);
                    prop_assert_eq!(got, model.commit(m, c), "{}", at);
                }
            }
            Op::Fork(i) => {
                if let Some(i) = pick(*i, &live) {
                    let (id, m) = live[i];
                    let got = res(cache.fork(id));
                    let want = model.fork(m);
                    prop_assert_eq!(got.as_ref().err(), want.as_ref().err(), "{}", at);
                    if let (Ok(id), Ok(m)) = (got, want) {
                        live.push((id, m));
                    }
                }
            }
            Op::Finish(i) | Op::Abort(i) => {
                if let Some(i) = pick(*i, &live) {
                    let (id, m) = live.remove(i);
                    if matches!(op, Op::Finish(_)) {
                        prop_assert_eq!(res(cache.finish(id)), Ok(()), "{}", at);
                        model.finish(m);
                    } else {
                        prop_assert_eq!(res(cache.abort(id)), Ok(()), "{}", at);
                        model.abort(m);
                    }
                    closed.push(id);
                }
            }
            Op::Stale(i, what) => {
                let (id, want) = if *what >= 6 {
                    (foreign, Ek::Foreign)
                } else if closed.is_empty() {
                    continue;
                } else {
                    (closed[i % closed.len()], Ek::Closed)
                };
                let got = match what % 6 {
                    0 => res(cache.commit(id, 0)),
                    1 => res(cache.extend(id, &[1])),
                    2 => res(cache.fork(id).map(|_| ())),
                    3 => res(cache.finish(id)),
                    4 => res(cache.abort(id)),
                    _ => res(cache.request(id).map(|_| ())),
                };
                prop_assert_eq!(got, Err(want), "{}", at);
            }
            Op::Evict(k) => {
                prop_assert_eq!(cache.evict(*k), model.evict(*k), "{}", at);
            }
            Op::Reset => {
                prop_assert_eq!(cache.reset(), model.reset(), "{}", at);
            }
        }
        if let Err(e) = cache.check() {
            return Err(TestCaseError::fail(format!("{at}: check() failed: {e}")));
        }
        prop_assert_eq!(cache.stats(), model.stats(), "{}", at);
        for &(id, m) in &live {
            let v = cache
                .request(id)
                .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
            let r = model.req(m);
            prop_assert_eq!(v.tokens, &r.tokens[..], "{}", at);
            prop_assert_eq!(v.namespace, &r.ns, "{}", at);
            let pages: Vec<u32> = v.pages.iter().map(|p| p.0).collect();
            prop_assert_eq!(pages, r.pages.clone(), "{} pages of request {}", at, m);
            prop_assert_eq!(
                (v.num_cached, v.num_computed, v.page_size),
                (r.num_cached, r.num_computed, p),
                "{}",
                at
            );
            // Every token the request relies on still holds the KV of its own prefix.
            let digests = kv_digests(v.namespace, v.tokens);
            for i in 0..v.num_computed {
                prop_assert_eq!(
                    kv.get(&v.slot(i)),
                    Some(&digests[i]),
                    "{}: KV of token {} of request {} (slot {})",
                    at,
                    i,
                    m,
                    v.slot(i)
                );
            }
        }
    }
    // Closing everything leaves the pool with nothing used.
    for (id, m) in live {
        prop_assert_eq!(res(cache.finish(id)), Ok(()));
        model.finish(m);
        prop_assert!(cache.check().is_ok());
    }
    prop_assert_eq!(cache.stats(), model.stats(), "after finishing everything");
    prop_assert_eq!(cache.stats().used_pages, 0);
    prop_assert_eq!(cache.reset(), model.reset());
    prop_assert_eq!(cache.stats(), model.stats(), "after the final reset");
    prop_assert_eq!(cache.stats().free_pages, cache.stats().num_pages);
    other.abort(foreign).unwrap();
    Ok(())
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn radix_cache_follows_the_model(
        p in prop_oneof![Just(1usize), Just(2), Just(4)],
        pool in 8..=40usize,
        abc in alphabet(),
        bases in bases(),
        ops in vec(op(), 40..=60),
    ) {
        let mut cache = RadixCache::new(pool, p).unwrap();
        let mut model = RadixModel::new(pool, p);
        run(&mut cache, &mut model, &abc, &bases, &ops)?;
    }

    #[test]
    fn block_cache_follows_the_model(
        p in prop_oneof![Just(1usize), Just(2), Just(4)],
        pool in 8..=40usize,
        abc in alphabet(),
        bases in bases(),
        ops in vec(op(), 40..=60),
    ) {
        let mut cache = BlockCache::new(pool, p).unwrap();
        let mut model = BlockModel::new(pool, p);
        run(&mut cache, &mut model, &abc, &bases, &ops)?;
    }
}
