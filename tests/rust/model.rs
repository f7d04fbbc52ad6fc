//! Model-based tests: random operation sequences applied to a cache and to a naive reference
//! model that follows docs/SEMANTICS.md literally, page by page. After every step the results
//! (errors included), the stats and every live request's view must agree, and `check()` must pass.
//!
//! The request life cycle ("Shared by both caches": admit, extend, commit, publishing, finish,
//! abort, the batched calls, stats, the argument checks) is written once, in [`Model`], over a
//! [`NaiveIndex`]. The two naive index parts hold only what differs, and know nothing of trees,
//! lists of nodes or hashes:
//! - radix: a map `(namespace, tokens[0 : (k+1) P]) -> (page, last use)`, pins recomputed from the
//!   live requests' published prefixes, a logical clock, a set of free ids (smallest first);
//! - block: a map `(namespace, prefix tokens) -> page` standing for the hash map, refcounts, the
//!   FREE / EVICTABLE lists as `VecDeque`s, and the stored pages duplicates pin.
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

/// A request of a model; `ext` is what the index part keeps of it.
#[derive(Debug, Clone)]
struct MReq<E> {
    tokens: Vec<u32>,
    ns: Namespace,
    pages: Vec<u32>,
    num_cached: usize,
    num_computed: usize,
    /// Page-aligned prefix this request has published (starts at `num_cached`).
    published: usize,
    ext: E,
}

/// A model's requests by model id; a closed request leaves `None`.
type Live<E> = [Option<MReq<E>>];

/// A batch entry as a model sees it: one of its requests (live or closed), or another cache's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Req(usize),
    Foreign,
}

#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    queries: u64,
    query_tokens: u64,
    hit_tokens: u64,
    evicted: u64,
}

fn limit(n: usize, p: usize) -> usize {
    (n - 1) / p * p
}

fn key(ns: &Namespace, tokens: &[u32], end: usize) -> Key {
    (ns.clone(), tokens[..end].to_vec())
}

// ------------------------------------------------------------------------ the life cycle, once

/// What the two naive models differ in. [`Model`] calls these with arguments it has checked.
trait NaiveIndex {
    /// What the index part keeps of a live request.
    type Ext: std::fmt::Debug + Default;
    fn new(num_pages: usize, page_size: usize) -> Self;
    /// Pages holding nothing.
    fn free(&self) -> usize;
    /// Index pages no live request pins.
    fn evictable(&self, live: &Live<Self::Ext>) -> usize;
    /// The page the index holds under `key`.
    fn page(&self, key: &Key) -> Option<u32>;
    /// Whether the index page `page`, held under `key`, is evictable now.
    fn is_evictable(&self, key: &Key, page: u32, live: &Live<Self::Ext>) -> bool;
    /// A request being admitted pins the index pages it matched.
    fn pin(&mut self, matched: &[u32]);
    /// The request used its pinned prefix: admitted, published more of it, or is closing.
    fn touch(&mut self, r: &MReq<Self::Ext>);
    /// `page` enters the index under `key`.
    fn enter(&mut self, key: Key, page: u32);
    /// The request's page `k` duplicates the index page `stored`, which it pins in its place.
    fn pin_duplicate(&mut self, ext: &mut Self::Ext, k: usize, stored: u32);
    /// Takes `count` pages (available, checked), evicting as needed; returns them and how many
    /// pages it evicted.
    fn allocate(&mut self, count: usize, live: &Live<Self::Ext>) -> (Vec<u32>, usize);
    /// Unpins a closed request's pages and frees those the index does not hold.
    fn release(&mut self, r: MReq<Self::Ext>);
    /// Evicts up to `k` pages in eviction order; returns how many.
    fn evict(&mut self, k: usize, live: &Live<Self::Ext>) -> usize;
}

/// A naive prefix cache: the life cycle of SEMANTICS.md over the index part `I`.
struct Model<I: NaiveIndex> {
    p: usize,
    n: usize,
    index: I,
    live: Vec<Option<MReq<I::Ext>>>,
    c: Counters,
}

impl<I: NaiveIndex> Model<I> {
    fn new(n: usize, p: usize) -> Self {
        Model {
            p,
            n,
            index: I::new(n, p),
            live: Vec::new(),
            c: Counters::default(),
        }
    }

    fn req(&self, r: usize) -> &MReq<I::Ext> {
        self.live[r].as_ref().unwrap()
    }

    fn get(&self, who: Who) -> Result<&MReq<I::Ext>, Ek> {
        match who {
            Who::Foreign => Err(Ek::Foreign),
            Who::Req(r) => self.live[r].as_ref().ok_or(Ek::Closed),
        }
    }

    /// The index pages of the longest prefix of `tokens` within the match limit, page by page.
    fn found(&self, tokens: &[u32], ns: &Namespace) -> Vec<u32> {
        let (p, lim) = (self.p, limit(tokens.len(), self.p));
        let mut pages = Vec::new();
        while (pages.len() + 1) * p <= lim {
            match self.index.page(&key(ns, tokens, (pages.len() + 1) * p)) {
                Some(page) => pages.push(page),
                None => break,
            }
        }
        pages
    }

    fn out_of_pages(&self, needed: usize, pinned: usize) -> Result<(), Ek> {
        let available = self.index.free() + self.index.evictable(&self.live) - pinned;
        if needed > available {
            return Err(Ek::OutOfPages { needed, available });
        }
        Ok(())
    }

    fn admit(&mut self, tokens: &[u32], ns: &Namespace) -> Result<usize, Ek> {
        if tokens.is_empty() {
            return Err(Ek::Invalid);
        }
        let p = self.p;
        let matched = self.found(tokens, ns);
        let m = matched.len() * p;
        let needed = tokens.len().div_ceil(p) - m / p;
        let e = (0..matched.len())
            .filter(|&k| {
                let at = key(ns, tokens, (k + 1) * p);
                self.index.is_evictable(&at, matched[k], &self.live)
            })
            .count();
        self.out_of_pages(needed, e)?;
        self.index.pin(&matched);
        self.live.push(Some(MReq {
            tokens: tokens.to_vec(),
            ns: ns.clone(),
            pages: matched,
            num_cached: m,
            num_computed: m,
            published: m,
            ext: I::Ext::default(),
        }));
        let r = self.live.len() - 1;
        self.index.touch(self.live[r].as_ref().unwrap());
        let (new, evicted) = self.index.allocate(needed, &self.live);
        self.live[r].as_mut().unwrap().pages.extend(new);
        self.c.evicted += evicted as u64;
        self.c.queries += 1;
        self.c.query_tokens += tokens.len() as u64;
        self.c.hit_tokens += m as u64;
        Ok(r)
    }

    fn fork(&mut self, r: usize) -> Result<usize, Ek> {
        let (t, ns) = (self.req(r).tokens.clone(), self.req(r).ns.clone());
        self.admit(&t, &ns)
    }

    fn extend(&mut self, r: usize, tokens: &[u32]) -> Result<(), Ek> {
        let req = self.req(r);
        let needed = (req.tokens.len() + tokens.len()).div_ceil(self.p) - req.pages.len();
        self.out_of_pages(needed, 0)?;
        let (new, evicted) = self.index.allocate(needed, &self.live);
        self.c.evicted += evicted as u64;
        let req = self.live[r].as_mut().unwrap();
        req.pages.extend(new);
        req.tokens.extend_from_slice(tokens);
        Ok(())
    }

    fn commit_args(r: &MReq<I::Ext>, c: usize) -> Result<(), Ek> {
        if c > r.tokens.len() || c < r.num_computed {
            return Err(Ek::Invalid);
        }
        Ok(())
    }

    fn commit(&mut self, r: usize, c: usize) -> Result<(), Ek> {
        Self::commit_args(self.req(r), c)?;
        self.live[r].as_mut().unwrap().num_computed = c;
        self.publish(r, c / self.p * self.p);
        Ok(())
    }

    /// Publishes the full pages of `r` below `upto` not published yet, in order.
    fn publish(&mut self, r: usize, upto: usize) {
        let p = self.p;
        let req = self.live[r].as_mut().unwrap();
        let (first, last) = (req.published / p, upto / p);
        if last <= first {
            return;
        }
        for k in first..last {
            let at = key(&req.ns, &req.tokens, (k + 1) * p);
            match self.index.page(&at) {
                // The index keeps its page; the request's stays private (a duplicate).
                Some(stored) => self.index.pin_duplicate(&mut req.ext, k, stored),
                None => self.index.enter(at, req.pages[k]),
            }
        }
        req.published = last * p;
        self.index.touch(req);
    }

    fn finish(&mut self, r: usize) {
        let c = self.req(r).num_computed;
        self.publish(r, c / self.p * self.p);
        self.release(r);
    }

    fn abort(&mut self, r: usize) {
        self.release(r);
    }

    fn release(&mut self, r: usize) {
        let req = self.live[r].take().unwrap();
        self.index.touch(&req);
        self.index.release(req);
    }

    fn match_prefix(&self, tokens: &[u32], ns: &Namespace) -> Result<usize, Ek> {
        if tokens.is_empty() {
            return Err(Ek::Invalid);
        }
        Ok(self.found(tokens, ns).len() * self.p)
    }

    fn evict(&mut self, k: usize) -> usize {
        let done = self.index.evict(k, &self.live);
        self.c.evicted += done as u64;
        done
    }

    fn reset(&mut self) -> usize {
        self.evict(usize::MAX)
    }

    /// Every request of a batch is live, of this cache, and named once.
    fn check_batch(&self, batch: impl Iterator<Item = Who>) -> Result<(), Ek> {
        let mut seen = Vec::new();
        for who in batch {
            self.get(who)?;
            if seen.contains(&who) {
                return Err(Ek::Invalid);
            }
            seen.push(who);
        }
        Ok(())
    }

    /// Checks every request first, then extends in order up to the first `OutOfPages`.
    fn extend_many(&mut self, batch: &[(Who, Vec<u32>)]) -> Result<usize, Ek> {
        self.check_batch(batch.iter().map(|b| b.0))?;
        for (done, (who, t)) in batch.iter().enumerate() {
            let Who::Req(r) = *who else { unreachable!() };
            match self.extend(r, t) {
                Ok(()) => {}
                Err(Ek::OutOfPages { .. }) => return Ok(done),
                Err(e) => return Err(e),
            }
        }
        Ok(batch.len())
    }

    /// Checks every pair as `commit` does, and distinct requests, first; then commits in order.
    fn commit_many(&mut self, batch: &[(Who, usize)]) -> Result<(), Ek> {
        self.check_batch(batch.iter().map(|b| b.0))?;
        for &(who, c) in batch {
            Self::commit_args(self.get(who)?, c)?;
        }
        for &(who, c) in batch {
            let Who::Req(r) = who else { unreachable!() };
            self.commit(r, c)?;
        }
        Ok(())
    }

    fn stats(&self) -> CacheStats {
        let (free, evictable) = (self.index.free(), self.index.evictable(&self.live));
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
            ..CacheStats::default()
        }
    }
}

// ---------------------------------------------------------------------------------- radix part

struct RadixPart {
    p: usize,
    /// `(namespace, tokens[0 : (k+1) P]) -> (page, last-use time)`.
    map: BTreeMap<Key, (u32, u64)>,
    free: BTreeSet<u32>,
    clock: u64,
}

impl RadixPart {
    /// Some live request's published prefix covers `k`.
    fn pinned(k: &Key, live: &Live<()>) -> bool {
        live.iter()
            .flatten()
            .any(|r| r.ns == k.0 && r.published >= k.1.len() && r.tokens[..k.1.len()] == k.1[..])
    }

    /// No key in the index extends `k` by exactly one page.
    fn is_leaf(&self, k: &Key) -> bool {
        let len = k.1.len();
        !self
            .map
            .keys()
            .any(|o| o.0 == k.0 && o.1.len() == len + self.p && o.1[..len] == k.1[..])
    }

    /// Evicts the unpinned leaf page with the smallest last-use time.
    fn evict_one(&mut self, live: &Live<()>) -> bool {
        let mut cands: Vec<(u64, Key)> = self
            .map
            .iter()
            .filter(|(k, _)| !Self::pinned(k, live) && self.is_leaf(k))
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
        let (page, _) = self.map.remove(&cands[0].1).unwrap();
        self.free.insert(page);
        true
    }
}

impl NaiveIndex for RadixPart {
    type Ext = ();

    fn new(n: usize, p: usize) -> Self {
        RadixPart {
            p,
            map: BTreeMap::new(),
            free: (0..n as u32).collect(),
            clock: 0,
        }
    }

    fn free(&self) -> usize {
        self.free.len()
    }

    fn evictable(&self, live: &Live<()>) -> usize {
        self.map.keys().filter(|k| !Self::pinned(k, live)).count()
    }

    fn page(&self, key: &Key) -> Option<u32> {
        self.map.get(key).map(|v| v.0)
    }

    fn is_evictable(&self, key: &Key, _page: u32, live: &Live<()>) -> bool {
        !Self::pinned(key, live)
    }

    /// Nothing to record: pins are recomputed from the live requests.
    fn pin(&mut self, _matched: &[u32]) {}

    /// A new tick for every page of the request's pinned (published) prefix.
    fn touch(&mut self, r: &MReq<()>) {
        self.clock += 1;
        for k in 1..=r.published / self.p {
            let at = key(&r.ns, &r.tokens, k * self.p);
            self.map.get_mut(&at).expect("model: pinned page missing").1 = self.clock;
        }
    }

    fn enter(&mut self, key: Key, page: u32) {
        self.map.insert(key, (page, 0));
    }

    /// Nothing to record: the request's published prefix pins the stored page.
    fn pin_duplicate(&mut self, _ext: &mut (), _k: usize, _stored: u32) {}

    /// Evicts what is missing, then takes the smallest free ids one by one.
    fn allocate(&mut self, count: usize, live: &Live<()>) -> (Vec<u32>, usize) {
        let missing = count.saturating_sub(self.free.len());
        for _ in 0..missing {
            assert!(self.evict_one(live), "model: capacity was checked");
        }
        let pages = (0..count).map(|_| self.free.pop_first().unwrap()).collect();
        (pages, missing)
    }

    fn release(&mut self, r: MReq<()>) {
        let held: BTreeSet<u32> = self.map.values().map(|v| v.0).collect();
        for page in r.pages {
            if !held.contains(&page) {
                assert!(self.free.insert(page), "model: page {page} freed twice");
            }
        }
    }

    fn evict(&mut self, k: usize, live: &Live<()>) -> usize {
        let mut done = 0;
        while done < k && self.evict_one(live) {
            done += 1;
        }
        done
    }
}

// ---------------------------------------------------------------------------------- block part

struct BlockPart {
    refcount: Vec<u32>,
    /// The "hash" of a page: the key of its whole prefix.
    key_of: Vec<Option<Key>>,
    map: HashMap<Key, u32>,
    free: VecDeque<u32>,
    evictable: VecDeque<u32>,
}

/// Of a live request: `(position, stored page)` pinned in place of a private duplicate.
type Stored = Vec<(usize, u32)>;

impl BlockPart {
    fn unhash(&mut self, page: u32) {
        let k = self.key_of[page as usize].take().expect("model: hashed");
        assert_eq!(self.map.remove(&k), Some(page));
    }

    fn pin_page(&mut self, page: u32) {
        if self.refcount[page as usize] == 0 {
            let at = self.evictable.iter().position(|&x| x == page).unwrap();
            self.evictable.remove(at);
        }
        self.refcount[page as usize] += 1;
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
}

impl NaiveIndex for BlockPart {
    type Ext = Stored;

    fn new(n: usize, _p: usize) -> Self {
        BlockPart {
            refcount: vec![0; n],
            key_of: vec![None; n],
            map: HashMap::new(),
            free: (0..n as u32).collect(),
            evictable: VecDeque::new(),
        }
    }

    fn free(&self) -> usize {
        self.free.len()
    }

    fn evictable(&self, _live: &Live<Stored>) -> usize {
        self.evictable.len()
    }

    fn page(&self, key: &Key) -> Option<u32> {
        self.map.get(key).copied()
    }

    fn is_evictable(&self, _key: &Key, page: u32, _live: &Live<Stored>) -> bool {
        self.refcount[page as usize] == 0
    }

    fn pin(&mut self, matched: &[u32]) {
        for &page in matched {
            self.pin_page(page);
        }
    }

    /// No last-use times: eviction follows the EVICTABLE list.
    fn touch(&mut self, _r: &MReq<Stored>) {}

    fn enter(&mut self, key: Key, page: u32) {
        self.map.insert(key.clone(), page);
        self.key_of[page as usize] = Some(key);
    }

    fn pin_duplicate(&mut self, stored: &mut Stored, k: usize, page: u32) {
        self.pin_page(page);
        stored.push((k, page));
    }

    /// FREE's front page; when FREE is empty, EVICTABLE's front page (an eviction).
    fn allocate(&mut self, count: usize, _live: &Live<Stored>) -> (Vec<u32>, usize) {
        let mut evicted = 0;
        let pages = (0..count)
            .map(|_| {
                let page = match self.free.pop_front() {
                    Some(page) => page,
                    None => {
                        let page = self.evictable.pop_front().expect("model: capacity checked");
                        self.unhash(page);
                        evicted += 1;
                        page
                    }
                };
                self.refcount[page as usize] = 1;
                page
            })
            .collect();
        (pages, evicted)
    }

    /// Last position to first; at a duplicate position the stored copy first, then the
    /// request's private page.
    fn release(&mut self, r: MReq<Stored>) {
        for (i, &page) in r.pages.iter().enumerate().rev() {
            if let Some(&(_, copy)) = r.ext.iter().find(|(at, _)| *at == i) {
                self.unpin(copy);
            }
            self.unpin(page);
        }
    }

    fn evict(&mut self, k: usize, _live: &Live<Stored>) -> usize {
        let mut done = 0;
        while done < k {
            let Some(page) = self.evictable.pop_front() else {
                break;
            };
            self.unhash(page);
            self.free.push_front(page);
            done += 1;
        }
        done
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
    /// `extend_many` over the distinct live requests the picks name.
    ExtendMany(Vec<(usize, Vec<u32>)>, Defect),
    /// `commit_many` over the distinct live requests the picks name (targets as in `Commit`).
    CommitMany(Vec<(usize, u8)>, Defect),
}

/// What spoils a batch. SEMANTICS.md does not order the batch checks, so a batch has one at most.
#[derive(Debug, Clone)]
enum Defect {
    None,
    /// Entry `j % len` named again, at position `j % (len + 1)`.
    Repeat(usize),
    /// A closed request (another cache's when `foreign`) at position `j % (len + 1)`.
    Stale(usize, bool),
    /// `commit_many` only: entry `j % len` commits above `num_tokens` (`above`) or below
    /// `num_computed`.
    BadTarget(usize, bool),
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

fn defect() -> impl Strategy<Value = Defect> {
    prop_oneof![
        6 => Just(Defect::None),
        1 => (0..64usize).prop_map(Defect::Repeat),
        1 => (0..64usize, any::<bool>()).prop_map(|(j, f)| Defect::Stale(j, f)),
        1 => (0..64usize, any::<bool>()).prop_map(|(j, a)| Defect::BadTarget(j, a)),
    ]
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
        2 => (vec((0..64usize, vec(0..3u32, 1..10)), 1..5), defect())
            .prop_map(|(b, d)| Op::ExtendMany(b, d)),
        2 => (vec((0..64usize, any::<u8>()), 1..5), defect())
            .prop_map(|(b, d)| Op::CommitMany(b, d)),
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

/// The commit target of `Op::Commit`: `num_computed + frac % (left + 1)`, or all for `frac >= 192`.
fn target<E>(r: &MReq<E>, frac: u8) -> usize {
    let (n, done) = (r.tokens.len(), r.num_computed);
    if frac >= 192 {
        n
    } else {
        done + frac as usize % (n - done + 1)
    }
}

/// A commit target above `num_tokens` (`above`, or when nothing is computed) or below
/// `num_computed`.
fn bad_target<E>(r: &MReq<E>, above: bool) -> usize {
    if above || r.num_computed == 0 {
        r.tokens.len() + 1
    } else {
        r.num_computed - 1
    }
}

/// A batch entry: the cache's id, the model's, and the payload (tokens or a commit target).
type Entry<T> = (RequestId, Who, T);

/// The distinct live requests the picks name (the first pick of each), with their payloads.
fn distinct<T: Clone>(picks: &[(usize, T)], live: &[(RequestId, usize)]) -> Vec<Entry<T>> {
    let mut batch: Vec<Entry<T>> = Vec::new();
    if live.is_empty() {
        return batch;
    }
    for (i, t) in picks {
        let (id, m) = live[i % live.len()];
        if batch.iter().all(|e| e.0 != id) {
            batch.push((id, Who::Req(m), t.clone()));
        }
    }
    batch
}

/// Repeats an entry of `batch`, or inserts a stale one carrying `filler`, as `defect` says.
fn spoil<T: Clone>(
    batch: &mut Vec<Entry<T>>,
    defect: &Defect,
    closed: &[(RequestId, usize)],
    foreign: RequestId,
    filler: T,
) {
    let len = batch.len();
    match *defect {
        Defect::Repeat(j) if len > 0 => {
            let again = batch[j % len].clone();
            batch.insert(j % (len + 1), again);
        }
        Defect::Stale(j, true) => batch.insert(j % (len + 1), (foreign, Who::Foreign, filler)),
        Defect::Stale(j, false) if !closed.is_empty() => {
            let (id, m) = closed[j % closed.len()];
            batch.insert(j % (len + 1), (id, Who::Req(m), filler));
        }
        _ => {}
    }
}

/// Writes the KV of tokens `done..c` of `id` into their slots, which must lie in pages that no
/// other live request holds.
fn write_kv<C: PrefixCache>(
    cache: &C,
    live: &[(RequestId, usize)],
    kv: &mut HashMap<i64, u64>,
    (id, done, c): (RequestId, usize, usize),
    at: &str,
) -> Result<(), TestCaseError> {
    let p = cache.page_size();
    let v = cache.request(id).unwrap();
    let digests = kv_digests(v.namespace, v.tokens);
    for i in done..c {
        let page = v.pages[i / p];
        for &(o, _) in live {
            let held = o != id && cache.request(o).unwrap().pages.contains(&page);
            prop_assert!(!held, "{}: writes page {} another request holds", at, page);
        }
        kv.insert(v.slot(i), digests[i]);
    }
    Ok(())
}

/// Applies `ops` to the cache and the model, comparing everything after every step.
fn run<C: PrefixCache, I: NaiveIndex>(
    cache: &mut C,
    model: &mut Model<I>,
    abc: &[u32; 3],
    bases: &[Vec<u32>],
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let p = cache.page_size();
    let bases: Vec<Vec<u32>> = bases.iter().map(|b| map(abc, b)).collect();
    let mut live: Vec<(RequestId, usize)> = Vec::new();
    let mut closed: Vec<(RequestId, usize)> = Vec::new();
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
                    let (done, c) = (model.req(m).num_computed, target(model.req(m), *frac));
                    let got = res(cache.commit(id, c));
                    prop_assert_eq!(&got, &model.commit(m, c), "{} to {}", at, c);
                    if got.is_ok() {
                        write_kv(cache, &live, &mut kv, (id, done, c), &at)?;
                    }
                }
            }
            Op::BadCommit(i, above) => {
                if let Some(i) = pick(*i, &live) {
                    let (id, m) = live[i];
                    let c = bad_target(model.req(m), *above);
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
                    closed.push((id, m));
                }
            }
            Op::Stale(i, what) => {
                let (id, want) = if *what >= 6 {
                    (foreign, Ek::Foreign)
                } else if closed.is_empty() {
                    continue;
                } else {
                    (closed[i % closed.len()].0, Ek::Closed)
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
            Op::ExtendMany(picks, defect) => {
                let picks: Vec<(usize, Vec<u32>)> =
                    picks.iter().map(|(i, t)| (*i, map(abc, t))).collect();
                let mut batch = distinct(&picks, &live);
                spoil(&mut batch, defect, &closed, foreign, vec![abc[0]]);
                let ids: Vec<(RequestId, &[u32])> = batch.iter().map(|e| (e.0, &e.2[..])).collect();
                let got = res(cache.extend_many(&ids));
                let whos: Vec<(Who, Vec<u32>)> = batch.iter().map(|e| (e.1, e.2.clone())).collect();
                prop_assert_eq!(got, model.extend_many(&whos), "{}", at);
            }
            Op::CommitMany(picks, defect) => {
                let mut batch: Vec<Entry<usize>> = distinct(picks, &live)
                    .into_iter()
                    .map(|(id, who, frac)| {
                        let Who::Req(m) = who else { unreachable!() };
                        (id, who, target(model.req(m), frac))
                    })
                    .collect();
                if let (Defect::BadTarget(j, above), false) = (defect, batch.is_empty()) {
                    let len = batch.len();
                    let e = &mut batch[j % len];
                    let Who::Req(m) = e.1 else { unreachable!() };
                    e.2 = bad_target(model.req(m), *above);
                }
                spoil(&mut batch, defect, &closed, foreign, 0);
                let done: Vec<usize> = batch
                    .iter()
                    .map(|e| model.get(e.1).map_or(0, |r| r.num_computed))
                    .collect();
                let ids: Vec<(RequestId, usize)> = batch.iter().map(|e| (e.0, e.2)).collect();
                let got = res(cache.commit_many(&ids));
                let whos: Vec<(Who, usize)> = batch.iter().map(|e| (e.1, e.2)).collect();
                prop_assert_eq!(&got, &model.commit_many(&whos), "{}", at);
                if got.is_ok() {
                    for (e, done) in batch.iter().zip(done) {
                        write_kv(cache, &live, &mut kv, (e.0, done, e.2), &at)?;
                    }
                }
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

/// One case: page size, pool size, alphabet, prompts and operations.
fn case() -> impl Strategy<Value = (usize, usize, [u32; 3], Vec<Vec<u32>>, Vec<Op>)> {
    let p = prop_oneof![Just(1usize), Just(2), Just(4)];
    (p, 8..=40usize, alphabet(), bases(), vec(op(), 40..=60))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn radix_cache_follows_the_model((p, pool, abc, bases, ops) in case()) {
        let mut cache = RadixCache::new(pool, p).unwrap();
        run(&mut cache, &mut Model::<RadixPart>::new(pool, p), &abc, &bases, &ops)?;
    }

    #[test]
    fn block_cache_follows_the_model((p, pool, abc, bases, ops) in case()) {
        let mut cache = BlockCache::new(pool, p).unwrap();
        run(&mut cache, &mut Model::<BlockPart>::new(pool, p), &abc, &bases, &ops)?;
    }
}
