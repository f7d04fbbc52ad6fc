//! Cache-aware scheduling of the waiting queue.
//!
//! SGLang orders its waiting queue by longest cached prefix (LPM) in Python and falls back to
//! arrival order once more than 128 requests wait; it has no aging. This scheduler is native:
//! the waiting prompts live in a chunk trie ([`crate::sched::waiting`]), so ranking probes the cache once
//! per shared chunk rather than once per request, and the policy stays on at any queue length.
//!
//! Order of service, for every policy:
//! 1. starved requests (waited more than `max_wait` schedule calls), oldest first;
//! 2. higher `priority` first;
//! 3. the policy: `Fcfs` arrival order; `Lpm` longest cached prefix (in the request's own
//!    namespace) first, ties by arrival; `DfsWeight` depth first over the trie of waiting
//!    prompts, cached subtrees first, then the heaviest, so requests sharing a prefix run back
//!    to back.
//!
//! Admission counts against the token budget only the tokens the caller computes in this step,
//! and lets the cache count evictable pages as available. A request is opened on its cached
//! prefix plus what is left of the budget: when its uncached part does not fit, it is admitted
//! in part (chunked prefill), which ends the call, and the caller appends the rest with
//! `extend` over later steps. So the request next in order is always admitted while the pool
//! has pages for its chunk, and no request can block the queue. Under the cache-aware policies, a
//! request whose uncached prefix (a whole chunk or more) is shared with a request admitted in the
//! same call waits one call, so the shared part is computed once and hit afterwards. When the
//! pool cannot hold a request's chunk, `Fcfs` stops; the others skip it, except that a starved
//! request stops the call (nothing behind it takes its pages), which bounds its wait. `add`
//! refuses a request that could never fit the pool.

use crate::cache::request::RequestId;
use crate::cache::{match_limit, PrefixCache};
use crate::error::{invalid, Error, Result};
use crate::wire::hash::Namespace;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;
use waiting::WaitingTrie;

mod waiting;

/// Sort key of a waiting request: starved first (oldest first among them), then higher
/// priority, then the policy's two keys, then arrival.
type RankKey = (bool, u64, Reverse<i32>, Reverse<usize>, usize, u64);

/// Which order the waiting queue is served in (after starvation and priority).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served.
    Fcfs,
    /// Longest cached prefix first.
    Lpm,
    /// Depth first over the waiting prompts' trie, heaviest subtree first.
    DfsWeight,
}

impl std::str::FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fcfs" => Ok(Policy::Fcfs),
            "lpm" => Ok(Policy::Lpm),
            "dfs-weight" => Ok(Policy::DfsWeight),
            _ => Err(invalid(format!(
                "policy must be 'fcfs', 'lpm' or 'dfs-weight', got {s:?}"
            ))),
        }
    }
}

#[derive(Debug)]
struct Waiting {
    tokens: Arc<[u32]>,
    namespace: Namespace,
    priority: i32,
    max_new_tokens: u32,
    /// Schedule call count when the request arrived.
    arrived: u64,
    /// Trie path, root first; chunk `i` is `path[i + 1]`.
    path: Vec<u32>,
    limit: usize,
}

/// A request the scheduler admitted into the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// The id `add` returned.
    pub id: u64,
    /// The cache's request.
    pub request: RequestId,
    /// As given to `add`.
    pub max_new_tokens: u32,
    /// Tokens of the prompt given to `add`; the request holds fewer when admitted in part.
    pub num_tokens: usize,
}

/// A waiting queue that admits requests into a cache in a cache-aware order.
#[derive(Debug)]
pub struct Scheduler {
    policy: Policy,
    max_wait: u64,
    page_size: usize,
    num_pages: usize,
    trie: WaitingTrie,
    waiting: BTreeMap<u64, Waiting>,
    next_id: u64,
    calls: u64,
    waits: WaitHistogram,
}

/// Upper bounds (inclusive) of the wait buckets, in schedule calls; a last bucket takes the rest.
pub const WAIT_BOUNDS: [u64; 12] = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];

/// How long admitted requests waited, in `schedule` calls that passed them over.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitHistogram {
    /// Admissions per bucket of [`WAIT_BOUNDS`] (not cumulative); the last entry counts waits
    /// above the last bound.
    pub counts: [u64; WAIT_BOUNDS.len() + 1],
    /// Sum of the waits.
    pub sum: u64,
}

impl WaitHistogram {
    fn record(&mut self, wait: u64) {
        let b = WAIT_BOUNDS.partition_point(|&ub| ub < wait);
        self.counts[b] += 1;
        self.sum += wait;
    }
}

impl Scheduler {
    /// A scheduler for `cache` (it reads the page size and pool size; `schedule` takes the cache
    /// again). `max_wait`: schedule calls after which a waiting request goes ahead of cache
    /// order (0 turns the bound off).
    pub fn new(cache: &dyn PrefixCache, policy: Policy, max_wait: u64) -> Self {
        let stats = cache.stats();
        let page_size = stats.page_size;
        let chunk = page_size * 64usize.div_ceil(page_size);
        Scheduler {
            policy,
            max_wait,
            page_size,
            num_pages: stats.num_pages,
            trie: WaitingTrie::new(chunk),
            waiting: BTreeMap::new(),
            next_id: 0,
            calls: 0,
            waits: WaitHistogram::default(),
        }
    }

    /// The pool-fit rule, written once (the engine checks it with this before queueing): a
    /// request of `num_tokens` prompt tokens could never run when its prompt and every
    /// generated token but the last, `ceil((num_tokens + max(max_new_tokens, 1) - 1) /
    /// page_size)` pages, exceed the pool. `name` says what the error is about.
    pub fn check_fits(&self, name: &str, num_tokens: usize, max_new_tokens: u32) -> Result<()> {
        let written = num_tokens + (max_new_tokens.max(1) as usize) - 1;
        let pages = written.div_ceil(self.page_size);
        if pages > self.num_pages {
            return Err(invalid(format!(
                "{name} of {num_tokens} tokens with max_new_tokens={max_new_tokens} needs {pages} \
                 pages of {} tokens, but the pool has only {} pages: it could never run",
                self.page_size, self.num_pages
            )));
        }
        Ok(())
    }

    /// Queues a prompt; returns its id (ids grow with arrival). Refuses a request that could
    /// never fit the pool ([`Scheduler::check_fits`]).
    pub fn add(
        &mut self,
        tokens: &[u32],
        namespace: Namespace,
        priority: i32,
        max_new_tokens: u32,
    ) -> Result<u64> {
        if tokens.is_empty() {
            return Err(invalid(
                "tokens must hold at least one token, got an empty sequence",
            ));
        }
        self.check_fits("a request", tokens.len(), max_new_tokens)?;
        let id = self.next_id;
        self.next_id += 1;
        let tokens: Arc<[u32]> = tokens.into();
        let limit = match_limit(tokens.len(), self.page_size);
        let path = self
            .trie
            .insert(id, &tokens, &namespace, limit / self.trie.chunk());
        let arrived = self.calls;
        self.waiting.insert(
            id,
            Waiting {
                tokens,
                namespace,
                priority,
                max_new_tokens,
                arrived,
                path,
                limit,
            },
        );
        Ok(id)
    }

    /// Drops a waiting request; returns whether it was waiting.
    pub fn cancel(&mut self, id: u64) -> bool {
        match self.waiting.remove(&id) {
            Some(w) => {
                self.trie.remove(id, &w.path, &w.namespace);
                true
            }
            None => false,
        }
    }

    /// Namespaces of the waiting requests (each costs a trie root while a request uses it).
    pub fn num_namespaces(&self) -> usize {
        self.trie.num_roots()
    }

    /// Number of waiting requests.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    /// How long the requests admitted so far waited (a snapshot).
    pub fn waits(&self) -> WaitHistogram {
        self.waits
    }

    /// Ids of the waiting requests, by arrival.
    pub fn waiting_ids(&self) -> Vec<u64> {
        self.waiting.keys().copied().collect()
    }

    /// Cached prefix of a waiting request as ranked in pass `stamp` (after `match_all`).
    fn estimate(&self, cache: &dyn PrefixCache, id: u64, w: &Waiting, stamp: u64) -> usize {
        if cache.window().1 > 0 {
            // A window can cut a hit short of the full pages the trie matched: ask the cache.
            return cache.match_prefix(&w.tokens, &w.namespace).unwrap_or(0);
        }
        self.trie
            .estimate(cache, id, &w.path, &w.tokens[..w.limit], stamp)
    }

    fn starved(&self, w: &Waiting) -> bool {
        self.max_wait > 0 && self.calls - w.arrived > self.max_wait
    }

    /// The waiting ids in service order, with each one's estimated cached prefix, as a heap:
    /// building it is linear, and a call pops only as far as its budget reaches.
    fn rank(&mut self, cache: &dyn PrefixCache) -> BinaryHeap<Reverse<(RankKey, usize)>> {
        let stamp = self.calls;
        if self.policy != Policy::Fcfs {
            self.trie.match_all(cache, stamp);
        }
        let dfs_rank: HashMap<u64, usize> = match self.policy {
            Policy::DfsWeight => self
                .trie
                .dfs_order(stamp)
                .into_iter()
                .enumerate()
                .map(|(r, id)| (id, r))
                .collect(),
            _ => HashMap::new(),
        };
        self.waiting
            .iter()
            .map(|(&id, w)| {
                let est = match self.policy {
                    Policy::Fcfs => 0,
                    _ => self.estimate(cache, id, w, stamp),
                };
                let starved = self.starved(w);
                let policy_key = match self.policy {
                    Policy::Fcfs => (Reverse(0), 0),
                    Policy::Lpm => (Reverse(est), 0),
                    Policy::DfsWeight => (Reverse(0), dfs_rank[&id]),
                };
                let key = (
                    !starved,
                    if starved { id } else { 0 },
                    Reverse(w.priority),
                    policy_key.0,
                    policy_key.1,
                    id,
                );
                Reverse((key, est))
            })
            .collect()
    }

    /// Admits waiting requests in service order while `token_budget` (tokens to compute in this
    /// step), `max_requests` and the cache's pages last. Each is opened on its cached prefix plus
    /// at most what is left of the budget; one whose uncached part does not fit is admitted in
    /// part (`num_tokens` short of its prompt), and the caller extends it over later steps. A call
    /// that admits nothing leaves the cache unchanged.
    pub fn schedule(
        &mut self,
        cache: &mut dyn PrefixCache,
        token_budget: usize,
        max_requests: usize,
    ) -> Vec<Admitted> {
        self.calls += 1;
        let stamp = self.calls;
        let mut out = Vec::new();
        if self.waiting.is_empty() || max_requests == 0 || token_budget == 0 {
            return out;
        }
        let mut ranked = self.rank(cache);
        let chunk = self.trie.chunk();
        let evicted_at_rank = cache.evicted_pages();
        let mut budget = token_budget;
        while let Some(Reverse((key, est))) = ranked.pop() {
            let id = key.5;
            if out.len() >= max_requests || budget == 0 {
                break;
            }
            let w = &self.waiting[&id];
            let stops = self.starved(w) || self.policy == Policy::Fcfs;
            // Admissions never add cached pages, so `est` stays exact unless pages were evicted.
            let cached = if self.policy == Policy::Fcfs || cache.evicted_pages() != evicted_at_rank
            {
                match cache.match_prefix(&w.tokens, &w.namespace) {
                    Ok(m) => m,
                    Err(_) => continue,
                }
            } else {
                est
            };
            let uncached_chunks = (cached / chunk + 1).min(w.path.len())..w.path.len();
            let shared_with_batch = !stops
                && self
                    .trie
                    .any_claimed(&w.path[uncached_chunks.clone()], stamp);
            if shared_with_batch {
                continue;
            }
            // `cached` is whole pages, so the match limit of the shortened prompt keeps it whole.
            let take = (w.tokens.len() - cached)
                .min(budget)
                .min(cache.window_chunk());
            let request = match cache.admit(&w.tokens[..cached + take], w.namespace.clone()) {
                Ok(r) => r,
                Err(_) if stops => break,
                Err(_) => continue,
            };
            budget -= take;
            self.trie.claim(&w.path[uncached_chunks], stamp);
            let w = self.waiting.remove(&id).expect("ranked ids are waiting");
            self.trie.remove(id, &w.path, &w.namespace);
            self.waits.record(stamp - w.arrived - 1);
            out.push(Admitted {
                id,
                request,
                max_new_tokens: w.max_new_tokens,
                num_tokens: w.tokens.len(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RadixCache;

    fn seq(start: u32, len: u32) -> Vec<u32> {
        (start..start + len).collect()
    }

    /// Every chunk under one key: each path stops at its first chunk, and ranking, estimates and
    /// budgets must come out exactly as with distinct keys.
    #[test]
    fn colliding_chunk_keys_keep_estimates_exact() {
        let run = |collide: bool| {
            let mut cache = RadixCache::new(1 << 14, 1).unwrap();
            for warm in [seq(0, 700), seq(10_000, 300)] {
                let r = cache.admit(&warm, None).unwrap();
                cache.commit(r, warm.len()).unwrap();
                cache.finish(r).unwrap();
            }
            let mut s = Scheduler::new(&cache, Policy::Lpm, 0);
            if collide {
                s.trie.key = |_| 7;
            }
            for (i, base) in [seq(10_000, 300), seq(0, 700), seq(50_000, 400), seq(0, 350)]
                .into_iter()
                .enumerate()
            {
                s.add(
                    &[base, seq(90_000 + 100 * i as u32, 40)].concat(),
                    None,
                    0,
                    0,
                )
                .unwrap();
            }
            // Uncached parts: 40, 40, 440 and 40 tokens; a budget of 500 takes the three cached
            // ones in lpm order (700, 350, 300) and leaves 380 tokens for a chunk of the fourth,
            // only if every estimate is exact.
            let out = s.schedule(&mut cache, 500, 10);
            let got: Vec<(u64, usize, usize)> = out
                .iter()
                .map(|a| {
                    let r = cache.request(a.request).unwrap();
                    (a.id, r.num_cached, r.num_tokens())
                })
                .collect();
            let used: usize = out
                .iter()
                .map(|a| {
                    let r = cache.request(a.request).unwrap();
                    r.num_tokens() - r.num_cached
                })
                .sum();
            cache.check().unwrap();
            (got, used)
        };
        let (plain, used) = run(false);
        assert_eq!(
            plain,
            vec![(1, 700, 740), (3, 350, 390), (0, 300, 340), (2, 0, 380)]
        );
        assert_eq!(used, 500);
        assert_eq!(run(true), (plain, used));
    }
}
