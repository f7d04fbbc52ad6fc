//! KV events of a cache with state slots: the snapshots' `StateStored` / `StateRemoved` beside
//! the pages' events. A router that replays them alone (pages cached, snapshots findable, by
//! block key) computes exactly the hit `match_prefix` gives, through snapshot and page
//! evictions, `evict_state`, a host tier, aborts and a reset.

use radixkv::{
    block_hashes, BlockCache, BlockHash, CacheEvent, Namespace, PrefixCache, RadixCache,
};
use std::collections::HashSet;

/// What a router knows of one replica, from its events only.
#[derive(Default)]
struct Router {
    pages: HashSet<BlockHash>,
    snaps: HashSet<BlockHash>,
}

impl Router {
    fn apply(&mut self, events: Vec<CacheEvent>, p: usize) {
        for e in events {
            match e {
                CacheEvent::Stored { hashes, .. } => self.pages.extend(hashes),
                CacheEvent::Removed { hashes } => {
                    for h in hashes {
                        assert!(self.pages.remove(&h), "removed a page never stored");
                    }
                }
                CacheEvent::Cleared => {
                    self.pages.clear();
                    self.snaps.clear();
                }
                CacheEvent::StateStored {
                    hash,
                    tokens,
                    parent,
                    ..
                } => {
                    assert_eq!(tokens.len(), p, "a snapshot event carries its last page");
                    assert!(self.pages.contains(&hash), "a snapshot before its page");
                    if let Some(parent) = parent {
                        assert!(self.pages.contains(&parent), "a snapshot before its prefix");
                    }
                    assert!(self.snaps.insert(hash), "a snapshot stored twice");
                }
                CacheEvent::StateRemoved { hashes } => {
                    for h in hashes {
                        assert!(self.snaps.remove(&h), "removed a snapshot never stored");
                    }
                }
                CacheEvent::WindowStored { .. } | CacheEvent::WindowRemoved { .. } => {
                    panic!("a window event from a cache without a window group")
                }
            }
        }
    }

    /// The hit a replica gives `tokens`, as far as the router knows: the longest prefix (of
    /// at most all tokens but one, whole pages) whose pages are all cached and that ends where
    /// a snapshot is.
    fn hit(&self, tokens: &[u32], ns: &Namespace, p: usize) -> usize {
        let keys = block_hashes(&tokens[..(tokens.len() - 1) / p * p], p, ns);
        let cached = keys.iter().take_while(|k| self.pages.contains(*k)).count();
        (1..=cached)
            .rev()
            .find(|&k| self.snaps.contains(&keys[k - 1]))
            .map_or(0, |k| k * p)
    }
}

/// A small deterministic generator (the workload is the same every run).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

/// Sessions over a few shared system prompts, each turn re-sent whole with a reply, snapshots
/// taken at the prompt's end, at a junction and at the end, in a pool and slots small enough
/// that pages and snapshots are evicted; every few steps `evict`, `evict_state` or an abort.
/// After every operation the router's hit equals `match_prefix` on probes of every history.
fn workload(mut c: Box<dyn PrefixCache>, p: usize, seed: u64) {
    let mut rng = Lcg(seed);
    c.record_events(true);
    let mut router = Router::default();
    let systems: Vec<Vec<u32>> = (0..3u32)
        .map(|s| (0..(8 + 4 * s)).map(|i| 10 + s * 100 + i).collect())
        .collect();
    let mut histories: Vec<(Vec<u32>, Namespace)> = Vec::new();
    let mut stored = 0;
    let mut removed = 0;
    for step in 0..240u32 {
        let (mut prompt, ns) = if !histories.is_empty() && rng.below(3) > 0 {
            histories[rng.below(histories.len())].clone()
        } else {
            let ns: Namespace = (rng.below(4) == 0).then(|| b"tenant".to_vec().into());
            (systems[rng.below(systems.len())].clone(), ns)
        };
        prompt.extend((0..1 + rng.below(6) as u32).map(|i| 5000 + step * 16 + i));
        let Ok(r) = c.admit(&prompt, ns.clone()) else {
            continue; // the pool is full of pinned pages: nothing changed
        };
        let v = c.request(r).unwrap();
        let mut wanted = vec![prompt.len() / p * p];
        if v.kv_matched > v.num_cached {
            wanted.push(v.kv_matched / p * p);
        }
        wanted.sort_unstable();
        wanted.dedup();
        for &pos in wanted.iter().filter(|&&pos| pos > v.num_cached) {
            c.take_state(r, pos).unwrap();
        }
        c.release_state(r).unwrap();
        c.commit(r, prompt.len()).unwrap();
        let reply: Vec<u32> = (0..1 + rng.below(5) as u32)
            .map(|i| 9000 + step * 16 + i)
            .collect();
        if c.extend(r, &reply).is_err() || rng.below(10) == 0 {
            c.abort(r).unwrap();
        } else {
            let mut all = prompt.clone();
            all.extend_from_slice(&reply);
            c.commit(r, all.len() - 1).unwrap();
            if (all.len() - 1) % p == 0 {
                c.take_state(r, all.len() - 1).unwrap();
            }
            c.finish(r).unwrap();
            all.pop();
            histories.push((all, ns));
        }
        match rng.below(8) {
            0 => {
                c.evict(1 + rng.below(3));
            }
            1 => {
                let slot = rng.below(c.stats().state_slots) as u32;
                c.evict_state(slot).unwrap();
            }
            _ => {}
        }
        let events = c.drain_events();
        stored += events
            .iter()
            .filter(|e| matches!(e, CacheEvent::StateStored { .. }))
            .count();
        removed += events
            .iter()
            .filter_map(|e| match e {
                CacheEvent::StateRemoved { hashes } => Some(hashes.len()),
                _ => None,
            })
            .sum::<usize>();
        router.apply(events, p);
        c.check().unwrap();
        for (h, ns) in histories.iter().rev().take(12) {
            let mut probe = h.clone();
            probe.push(1);
            assert_eq!(
                router.hit(&probe, ns, p),
                c.match_prefix(&probe, ns).unwrap(),
                "step {step}: the router's hit differs from the cache's"
            );
        }
    }
    assert!(
        stored > 20 && removed > 10,
        "stored {stored}, removed {removed}"
    );
    c.reset();
    router.apply(c.drain_events(), p);
    assert!(router.snaps.is_empty() && router.pages.is_empty());
}

#[test]
fn a_router_replaying_the_events_finds_the_hits_the_cache_gives() {
    for seed in 1..4 {
        workload(
            Box::new(
                RadixCache::new(160, 1)
                    .unwrap()
                    .with_state_slots(6)
                    .unwrap(),
            ),
            1,
            seed,
        );
        workload(
            Box::new(BlockCache::new(40, 4).unwrap().with_state_slots(5).unwrap()),
            4,
            seed,
        );
        workload(
            Box::new(
                RadixCache::with_host(120, 2, 40)
                    .unwrap()
                    .with_state_slots(6)
                    .unwrap(),
            ),
            2,
            seed,
        );
    }
}

#[test]
fn a_snapshot_is_announced_on_the_page_its_prefix_ends_after_that_page() {
    for (mut c, p) in [
        (
            Box::new(RadixCache::new(64, 1).unwrap().with_state_slots(2).unwrap())
                as Box<dyn PrefixCache>,
            1,
        ),
        (
            Box::new(BlockCache::new(32, 4).unwrap().with_state_slots(2).unwrap()),
            4,
        ),
    ] {
        let ns: Namespace = Some(b"a".to_vec().into());
        let t: Vec<u32> = (1..=6 * p as u32).collect();
        c.record_events(true);
        let r = c.admit(&t, ns.clone()).unwrap();
        c.take_state(r, 4 * p).unwrap();
        assert!(c.drain_events().is_empty(), "pending: not announced");
        c.commit(r, 6 * p).unwrap();
        let keys = block_hashes(&t, p, &ns);
        let events = c.drain_events();
        let at = events
            .iter()
            .position(|e| matches!(e, CacheEvent::StateStored { .. }))
            .unwrap();
        assert!(matches!(events[at - 1], CacheEvent::Stored { .. }));
        assert_eq!(
            events[at],
            CacheEvent::StateStored {
                namespace: ns.clone(),
                parent: Some(keys[2]),
                hash: keys[3],
                tokens: t[3 * p..4 * p].to_vec(),
            }
        );
        c.finish(r).unwrap();
        c.drain_events();
        // Evicting it names the same key; recording off drops what was not drained.
        let slot = (0..2).find(|&s| c.evict_state(s).unwrap()).unwrap();
        assert_eq!(
            c.drain_events(),
            vec![CacheEvent::StateRemoved {
                hashes: vec![keys[3]]
            }]
        );
        assert!(!c.evict_state(slot).unwrap());
        c.record_events(false);
        let r = c.admit(&t, ns.clone()).unwrap();
        c.take_state(r, 5 * p).unwrap();
        c.commit(r, 6 * p).unwrap();
        c.finish(r).unwrap();
        assert!(c.drain_events().is_empty());
    }
}
