//! Scheduler orders on small hand-built queues, budgets, starvation and tenant isolation.

use radixkv::{Admitted, BlockCache, Namespace, Policy, PrefixCache, RadixCache, Scheduler};

fn seq(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

/// Admits, computes and finishes `tokens` so that its full pages are cached.
fn warm(cache: &mut dyn PrefixCache, tokens: &[u32], ns: Namespace) {
    let id = cache.admit(tokens, ns).unwrap();
    cache.commit(id, tokens.len()).unwrap();
    cache.finish(id).unwrap();
}

fn ids(out: &[Admitted]) -> Vec<u64> {
    out.iter().map(|a| a.id).collect()
}

fn finish_all(cache: &mut dyn PrefixCache, out: &[Admitted]) {
    for a in out {
        let n = cache.request(a.request).unwrap().num_tokens();
        cache.commit(a.request, n).unwrap();
        cache.finish(a.request).unwrap();
    }
}

fn caches() -> Vec<Box<dyn PrefixCache>> {
    vec![
        Box::new(RadixCache::new(4096, 1).unwrap()),
        Box::new(RadixCache::new(1024, 4).unwrap()),
        Box::new(BlockCache::new(256, 16).unwrap()),
    ]
}

#[test]
fn fcfs_serves_in_arrival_order() {
    for mut cache in caches() {
        let x = seq(0, 512);
        warm(&mut *cache, &x, None);
        let mut s = Scheduler::new(&*cache, Policy::Fcfs, 0);
        let a = s.add(&seq(10_000, 100), None, 0, 8).unwrap();
        let b = s.add(&cat(&x, &seq(20_000, 40)), None, 0, 8).unwrap();
        let c = s.add(&seq(30_000, 100), None, 0, 8).unwrap();
        let out = s.schedule(&mut *cache, 10_000, 10);
        assert_eq!(ids(&out), vec![a, b, c]);
        assert_eq!(out[0].max_new_tokens, 8);
        cache.check().unwrap();
    }
}

#[test]
fn lpm_serves_longest_cached_prefix_first_ties_by_arrival() {
    for mut cache in caches() {
        let x = seq(0, 512);
        warm(&mut *cache, &x, None);
        let mut s = Scheduler::new(&*cache, Policy::Lpm, 0);
        let miss = s.add(&seq(10_000, 100), None, 0, 0).unwrap();
        let half = s
            .add(&cat(&x[..256], &seq(20_000, 40)), None, 0, 0)
            .unwrap();
        let full = s.add(&cat(&x, &seq(30_000, 40)), None, 0, 0).unwrap();
        let miss2 = s.add(&seq(40_000, 100), None, 0, 0).unwrap();
        let full2 = s.add(&cat(&x, &seq(50_000, 40)), None, 0, 0).unwrap();
        let out = s.schedule(&mut *cache, 100_000, 10);
        assert_eq!(ids(&out), vec![full, full2, half, miss, miss2]);
        // Every admission got exactly the prefix the ranking saw.
        let cached: Vec<usize> = out
            .iter()
            .map(|a| cache.request(a.request).unwrap().num_cached)
            .collect();
        assert_eq!(cached, vec![512, 512, 256, 0, 0]);
        cache.check().unwrap();
    }
}

#[test]
fn priority_goes_before_cache_order() {
    let mut cache = RadixCache::new(4096, 1).unwrap();
    let x = seq(0, 512);
    warm(&mut cache, &x, None);
    let mut s = Scheduler::new(&cache, Policy::Lpm, 0);
    let warm_req = s.add(&cat(&x, &[1]), None, 0, 0).unwrap();
    let urgent = s.add(&seq(9_000, 50), None, 5, 0).unwrap();
    let out = s.schedule(&mut cache, 100_000, 10);
    assert_eq!(ids(&out), vec![urgent, warm_req]);
}

#[test]
fn dfs_weight_runs_groups_back_to_back_heaviest_first() {
    let mut cache = RadixCache::new(8192, 1).unwrap();
    let p1 = seq(0, 256);
    let p2 = seq(100_000, 256);
    let mut s = Scheduler::new(&cache, Policy::DfsWeight, 0);
    let a = s.add(&cat(&p2, &[1]), None, 0, 0).unwrap();
    let b = s.add(&cat(&p1, &[2]), None, 0, 0).unwrap();
    let c = s.add(&cat(&p2, &[3]), None, 0, 0).unwrap();
    let d = s.add(&cat(&p1, &[4]), None, 0, 0).unwrap();
    let e = s.add(&cat(&p1, &[5]), None, 0, 0).unwrap();
    // Warm both prefixes so that in-batch sharing does not hold anyone back.
    warm(&mut cache, &p1, None);
    warm(&mut cache, &p2, None);
    let out = s.schedule(&mut cache, 100_000, 10);
    assert_eq!(ids(&out), vec![b, d, e, a, c]);
}

#[test]
fn in_batch_sharing_computes_a_shared_prefix_once() {
    for mut cache in caches() {
        let shared = seq(0, 512);
        let mut s = Scheduler::new(&*cache, Policy::Lpm, 0);
        let a = s.add(&cat(&shared, &seq(70_000, 30)), None, 0, 0).unwrap();
        let b = s.add(&cat(&shared, &seq(80_000, 30)), None, 0, 0).unwrap();
        let other = s.add(&seq(90_000, 64), None, 0, 0).unwrap();
        let first = s.schedule(&mut *cache, 100_000, 10);
        assert_eq!(ids(&first), vec![a, other]);
        finish_all(&mut *cache, &first);
        let second = s.schedule(&mut *cache, 100_000, 10);
        assert_eq!(ids(&second), vec![b]);
        assert_eq!(cache.request(second[0].request).unwrap().num_cached, 512);
        cache.check().unwrap();
    }
}

/// The budget binds: the cached prompts come first (lpm) and the one that does not fit what is
/// left is admitted in part, to exactly the budget.
#[test]
fn budgets_are_never_exceeded() {
    let mut cache = RadixCache::new(4096, 1).unwrap();
    let x = seq(0, 1000);
    warm(&mut cache, &x, None);
    let mut s = Scheduler::new(&cache, Policy::Lpm, 0);
    let mut uncached = Vec::new();
    for i in 0..20u32 {
        let tail = seq(200_000 + i * 1000, 50 + i * 10);
        let prompt = if i % 2 == 0 { cat(&x, &tail) } else { tail };
        uncached.push(prompt.len() - cache.match_prefix(&prompt, &None).unwrap());
        s.add(&prompt, None, 0, 0).unwrap();
    }
    // Uncached parts of the cached prompts 0, 2, 4, 6: 50 + 70 + 90 = 210, then 110 > 90 left.
    let even: Vec<usize> = uncached.iter().step_by(2).take(4).copied().collect();
    assert_eq!(even, vec![50, 70, 90, 110]);
    let out = s.schedule(&mut cache, 300, 5);
    assert_eq!(ids(&out), vec![0, 2, 4, 6]);
    let computed: Vec<usize> = out
        .iter()
        .map(|a| {
            let r = cache.request(a.request).unwrap();
            assert_eq!(r.num_cached, 1000);
            r.num_tokens() - r.num_cached
        })
        .collect();
    assert_eq!(computed, vec![50, 70, 90, 90]);
    assert_eq!(out[3].num_tokens, 1110);
    assert_eq!(s.len(), 16);
    cache.check().unwrap();
}

#[test]
fn a_call_that_admits_nothing_changes_nothing() {
    for mut cache in caches() {
        warm(&mut *cache, &seq(0, 300), None);
        let mut s = Scheduler::new(&*cache, Policy::Lpm, 0);
        s.add(&seq(0, 2_000), None, 0, 0).unwrap();
        let before = cache.stats();
        // No budget.
        assert!(s.schedule(&mut *cache, 0, 10).is_empty());
        assert_eq!(cache.stats(), before);
        // Every page pinned by a live request: not even a one-token chunk fits.
        let pages = before.num_pages * before.page_size;
        let hog = cache.admit(&seq(1_000_000, pages as u32), None).unwrap();
        let pinned = cache.stats();
        assert!(s.schedule(&mut *cache, 1_000_000, 10).is_empty());
        assert_eq!(cache.stats(), pinned);
        assert_eq!(s.len(), 1);
        cache.abort(hog).unwrap();
        cache.check().unwrap();
    }
}

#[test]
fn add_refuses_what_could_never_fit_the_pool() {
    for cache in caches() {
        let st = cache.stats();
        let capacity = st.num_pages * st.page_size;
        let mut s = Scheduler::new(&*cache, Policy::Fcfs, 0);
        // The prompt plus every generated token but the last must fit.
        assert!(s.add(&seq(0, capacity as u32), None, 0, 1).is_ok());
        let err = s.add(&seq(0, capacity as u32), None, 0, 2).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&format!("{capacity} tokens")), "{msg}");
        assert!(
            msg.contains(&format!("only {} pages", st.num_pages)),
            "{msg}"
        );
        assert!(s.add(&seq(0, capacity as u32 + 1), None, 0, 0).is_err());
        assert_eq!(s.len(), 1);
    }
}

/// A prompt longer than the budget is admitted in part and finished by `extend`; no policy lets
/// it block the requests behind it.
#[test]
fn chunked_admission_lets_a_long_prompt_through() {
    for policy in [Policy::Fcfs, Policy::Lpm, Policy::DfsWeight] {
        for mut cache in caches() {
            let long = seq(0, 3_000);
            let mut s = Scheduler::new(&*cache, policy, 0);
            let big = s.add(&long, None, 0, 0).unwrap();
            let small = s.add(&seq(900_000, 100), None, 0, 0).unwrap();
            let first = s.schedule(&mut *cache, 512, 10);
            // The long prompt is next in order under every policy (nothing is cached): it takes
            // the whole budget and ends the call.
            assert_eq!(ids(&first), vec![big], "{policy:?}");
            let a = first[0];
            assert_eq!(a.num_tokens, 3_000);
            let r = cache.request(a.request).unwrap();
            assert_eq!((r.num_cached, r.num_tokens()), (0, 512));
            // The caller computes it over later steps, 512 tokens at a time.
            let mut done = 512;
            cache.commit(a.request, done).unwrap();
            while done < long.len() {
                let next = (done + 512).min(long.len());
                cache.extend(a.request, &long[done..next]).unwrap();
                cache.commit(a.request, next).unwrap();
                done = next;
            }
            cache.finish(a.request).unwrap();
            let second = s.schedule(&mut *cache, 512, 10);
            assert_eq!(ids(&second), vec![small], "{policy:?}");
            finish_all(&mut *cache, &second);
            // Every full page of the long prompt is cached.
            let p = cache.page_size();
            let full = 3_000 / p * p;
            assert_eq!(cache.match_prefix(&cat(&long, &[7]), &None).unwrap(), full);
            cache.check().unwrap();
        }
    }
}

#[test]
fn a_chunk_starts_after_the_cached_prefix() {
    for mut cache in caches() {
        let x = seq(0, 1024);
        warm(&mut *cache, &x, None);
        let mut s = Scheduler::new(&*cache, Policy::Fcfs, 0);
        let short = s.add(&seq(500_000, 100), None, 0, 0).unwrap();
        let long = s.add(&cat(&x, &seq(600_000, 900)), None, 0, 0).unwrap();
        let out = s.schedule(&mut *cache, 300, 10);
        assert_eq!(ids(&out), vec![short, long]);
        let r = cache.request(out[1].request).unwrap();
        // 100 tokens went to the short prompt; the long one gets its cached 1,024 and 200 more.
        assert_eq!((r.num_cached, r.num_tokens()), (1024, 1224));
        cache.check().unwrap();
    }
}

#[test]
fn starvation_bound_lets_a_cold_request_through() {
    let hot = seq(0, 1000);
    let run = |max_wait: u64| -> Option<u64> {
        let mut cache = RadixCache::new(4096, 1).unwrap();
        warm(&mut cache, &hot, None);
        let mut s = Scheduler::new(&cache, Policy::Lpm, max_wait);
        let cold = s.add(&seq(500_000, 100), None, 0, 0).unwrap();
        for call in 1..=40u64 {
            // A stream of warm requests: two arrive per call, one is served per call.
            for j in 0..2u32 {
                s.add(&cat(&hot, &[(call as u32) * 10 + j]), None, 0, 0)
                    .unwrap();
            }
            let out = s.schedule(&mut cache, 10_000, 1);
            finish_all(&mut cache, &out);
            if ids(&out) == vec![cold] {
                return Some(call);
            }
        }
        None
    };
    assert_eq!(
        run(0),
        None,
        "without the bound the warm stream starves the cold request"
    );
    let served = run(5).expect("the bound must let the cold request through");
    assert_eq!(
        served, 6,
        "served on the first call after waiting more than 5 calls"
    );
}

#[test]
fn ranking_ignores_other_namespaces() {
    // The same queue, with and without another tenant caching this tenant's prompts.
    let order = |other_tenant_warm: bool| -> Vec<u64> {
        let mut cache = RadixCache::new(8192, 1).unwrap();
        let mine: Namespace = Some(b"tenant-a".to_vec().into());
        let theirs: Namespace = Some(b"tenant-b".to_vec().into());
        let p = seq(0, 700);
        let q = seq(10_000, 300);
        warm(&mut cache, &q, mine.clone());
        if other_tenant_warm {
            warm(&mut cache, &p, theirs.clone());
        }
        let mut s = Scheduler::new(&cache, Policy::Lpm, 0);
        s.add(&cat(&p, &[1]), mine.clone(), 0, 0).unwrap();
        s.add(&cat(&q, &[2]), mine.clone(), 0, 0).unwrap();
        s.add(&cat(&p, &[3]), mine, 0, 0).unwrap();
        ids(&s.schedule(&mut cache, 100_000, 10))
    };
    let alone = order(false);
    assert_eq!(order(true), alone);
    // And caching is on: tenant-a's own cached prompt goes first.
    assert_eq!(alone[0], 1);
}

#[test]
fn cancel_removes_a_waiting_request() {
    let mut cache = RadixCache::new(1024, 1).unwrap();
    let mut s = Scheduler::new(&cache, Policy::DfsWeight, 0);
    let a = s.add(&seq(0, 100), None, 0, 0).unwrap();
    let b = s.add(&seq(0, 120), None, 0, 0).unwrap();
    assert!(s.cancel(a));
    assert!(!s.cancel(a));
    assert_eq!(ids(&s.schedule(&mut cache, 10_000, 10)), vec![b]);
    assert!(s.is_empty());
}
