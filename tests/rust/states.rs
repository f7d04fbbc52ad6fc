//! State slots (snapshots of a hybrid model's recurrent state) on both indexes: where a hit
//! ends, what evicting a snapshot or a page does, pins, namespaces, the argument checks, and
//! random operation sequences checked by `check()` and against a model of the hit rule.

use proptest::prelude::*;
use radixkv::{BlockCache, Error, Namespace, PrefixCache, RadixCache, RequestId};

/// A radix cache at page size 1 and a block cache at page size 4, each with `slots` state slots.
fn caches(pages: usize, slots: usize) -> Vec<(Box<dyn PrefixCache>, usize)> {
    vec![
        (
            Box::new(
                RadixCache::new(pages, 1)
                    .unwrap()
                    .with_state_slots(slots)
                    .unwrap(),
            ),
            1,
        ),
        (
            Box::new(
                BlockCache::new(pages, 4)
                    .unwrap()
                    .with_state_slots(slots)
                    .unwrap(),
            ),
            4,
        ),
    ]
}

fn toks(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + seed * 1000 + 1).collect()
}

/// Admits `t`, computes all of it, snapshots at each of `at`, finishes; returns the slots.
fn run(c: &mut dyn PrefixCache, t: &[u32], ns: &Namespace, at: &[usize]) -> Vec<Option<u32>> {
    let r = c.admit(t, ns.clone()).unwrap();
    let slots = at.iter().map(|&p| c.take_state(r, p).unwrap()).collect();
    c.commit(r, t.len()).unwrap();
    c.finish(r).unwrap();
    c.check().unwrap();
    slots
}

#[test]
fn a_hit_ends_at_the_last_snapshot_not_where_the_kv_match_does() {
    for (mut c, p) in caches(256, 4) {
        let t = toks(40, 0);
        run(&mut *c, &t, &None, &[3 * p]);
        // The KV of all 40 tokens is cached, but the only snapshot is at 3 pages.
        let mut longer = t.clone();
        longer.extend(toks(8, 9));
        assert_eq!(c.match_prefix(&longer, &None).unwrap(), 3 * p);
        let r = c.admit(&longer, None).unwrap();
        let v = c.request(r).unwrap();
        assert_eq!((v.num_cached, v.kv_matched), (3 * p, 40 / p * p));
        assert!(v.state_slot.is_some());
        let s = c.stats();
        assert_eq!(
            (s.hit_tokens, s.state_hit_tokens),
            (3 * p as u64, 3 * p as u64)
        );
        c.abort(r).unwrap();
        c.check().unwrap();
    }
}

#[test]
fn no_snapshot_no_hit_and_a_snapshot_is_not_found_before_its_commit() {
    for (mut c, p) in caches(256, 4) {
        let t = toks(33, 1);
        run(&mut *c, &t, &None, &[]);
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 0, "KV alone is no hit");
        let r = c.admit(&t, None).unwrap();
        assert_eq!(c.request(r).unwrap().kv_matched, 32 / p * p);
        // Taken before the pages are published: pending.
        assert!(c.take_state(r, 4 * p).unwrap().is_some());
        c.commit(r, 3 * p).unwrap();
        c.check().unwrap();
        assert_eq!(
            c.match_prefix(&t, &None).unwrap(),
            0,
            "pages up to 4 not published"
        );
        // Taken at a published position: still not findable until the next commit.
        assert!(c.take_state(r, 2 * p).unwrap().is_some());
        c.check().unwrap();
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 0);
        c.commit(r, 3 * p).unwrap();
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 2 * p);
        c.commit(r, 4 * p).unwrap();
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 4 * p);
        c.finish(r).unwrap();
        c.check().unwrap();
    }
}

#[test]
fn evicting_a_snapshot_keeps_its_pages_and_the_hit_falls_back() {
    for (mut c, p) in caches(256, 2) {
        let t = toks(40, 2);
        let s = run(&mut *c, &t, &None, &[2 * p, 6 * p]);
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 6 * p);
        // A third snapshot elsewhere takes the slot of the one at 2 pages (superseded by the
        // one at 6). Then a hit at 6 refreshes it; the next take evicts u's (it saves 1 page,
        // the one at 6 six).
        let u = toks(20, 3);
        let s2 = run(&mut *c, &u, &None, &[p]);
        assert_eq!(s2[0], s[0], "the superseded snapshot's slot is reused");
        assert_eq!(
            c.drain_freed_states(),
            Vec::<u32>::new(),
            "handed out again"
        );
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 6 * p);
        let r = c.admit(&t, None).unwrap();
        assert_eq!(c.request(r).unwrap().state_slot, s[1]);
        c.abort(r).unwrap(); // unpinned: the snapshot at 6 is the most recent now
        let v = toks(12, 4);
        let s3 = run(&mut *c, &v, &None, &[p]);
        assert_eq!(
            s3[0], s2[0],
            "u's snapshot saves less than the one at 6 pages"
        );
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 6 * p);
        assert_eq!(c.match_prefix(&u, &None).unwrap(), 0);
        // Evicting the slot at 6 leaves its pages: a snapshot at 4 is taken again, and hit.
        let before = c.stats();
        assert!(c.evict_state(s[1].unwrap()).unwrap());
        assert_eq!(
            c.stats().evicted_pages,
            before.evicted_pages,
            "no page evicted"
        );
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 0);
        let r = c.admit(&t, None).unwrap();
        assert_eq!(c.request(r).unwrap().kv_matched, 39 / p * p, "pages kept");
        c.take_state(r, 4 * p).unwrap().unwrap();
        c.commit(r, t.len()).unwrap();
        c.finish(r).unwrap();
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 4 * p);
        // The one at 2 pages, u's, the one at 6 pages (a slot was free for the one at 4).
        assert_eq!(c.stats().evicted_states, 3);
        c.check().unwrap();
    }
}

#[test]
fn evicting_a_page_evicts_the_snapshots_that_need_it() {
    for (mut c, p) in caches(64, 4) {
        let pages = 64;
        let t = toks(10 * p, 6);
        let s = run(&mut *c, &t, &None, &[2 * p, 5 * p, 10 * p]);
        assert_eq!(c.stats().state_free_slots, 1);
        // Evict the last five pages: the snapshots at 10 (and at 5 on the block index, which
        // evicts the chain's tail first too) go; the one at 2 stays.
        assert_eq!(c.evict(5), 5);
        c.check().unwrap();
        let freed = c.drain_freed_states();
        assert_eq!(freed, vec![s[2].unwrap()], "the snapshot at 10 pages went");
        assert_eq!(c.match_prefix(&toks(11 * p, 6), &None).unwrap(), 5 * p);
        assert_eq!(c.evict(1), 1);
        assert_eq!(c.drain_freed_states(), vec![s[1].unwrap()]);
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 2 * p);
        // Filling the pool evicts the rest, and the last snapshot with them.
        let r = c.admit(&toks(pages * p, 7), None).unwrap();
        assert_eq!(c.drain_freed_states(), vec![s[0].unwrap()]);
        assert_eq!(c.stats().evicted_states, 3);
        assert_eq!(c.stats().state_free_slots, 4);
        c.check().unwrap();
        c.abort(r).unwrap();
        assert_eq!(c.reset(), 0);
    }
}

#[test]
fn a_pinned_snapshot_and_its_pages_stay() {
    for (mut c, p) in caches(32, 1) {
        let t = toks(8 * p, 8);
        let s = run(&mut *c, &t, &None, &[4 * p]);
        let r = c.admit(&t, None).unwrap();
        assert_eq!(c.request(r).unwrap().state_slot, s[0]);
        assert_eq!(c.stats().state_pinned_slots, 1);
        // No slot for another snapshot while the only one is pinned.
        let r2 = c.admit(&toks(3 * p, 9), None).unwrap();
        assert_eq!(c.take_state(r2, p).unwrap(), None);
        // Evicting everything evictable keeps the pinned path and the snapshot.
        c.evict(1000);
        assert!(c.drain_freed_states().is_empty());
        c.check().unwrap();
        // Copied: unpinned; now another snapshot may take the slot.
        assert!(c.release_state(r).unwrap());
        assert!(!c.release_state(r).unwrap());
        assert_eq!(c.stats().state_pinned_slots, 0);
        assert_eq!(c.take_state(r2, p).unwrap(), s[0]);
        c.abort(r2).unwrap();
        assert_eq!(
            c.drain_freed_states(),
            vec![s[0].unwrap()],
            "never published"
        );
        c.finish(r).unwrap();
        c.check().unwrap();
    }
}

#[test]
fn namespaces_never_share_snapshots() {
    for (mut c, p) in caches(128, 4) {
        let t = toks(10 * p, 10);
        let a: Namespace = Some(b"tenant-a".to_vec().into());
        run(&mut *c, &t, &a, &[5 * p]);
        assert_eq!(c.match_prefix(&t, &a).unwrap(), 5 * p);
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 0);
        let b: Namespace = Some(b"tenant-b".to_vec().into());
        assert_eq!(c.match_prefix(&t, &b).unwrap(), 0);
        run(&mut *c, &t, &None, &[3 * p]);
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 3 * p);
        assert_eq!(c.match_prefix(&t, &a).unwrap(), 5 * p);
    }
}

#[test]
fn bad_arguments_are_named_and_change_nothing() {
    for (mut c, p) in caches(64, 2) {
        let t = toks(10 * p, 11);
        let r = c.admit(&t, None).unwrap();
        let before = c.state_digest();
        for pos in [0, 10 * p + p] {
            let e = c.take_state(r, pos).unwrap_err();
            assert!(e.to_string().contains(&format!("got {pos}")), "{e}");
        }
        if p > 1 {
            let e = c.take_state(r, p + 1).unwrap_err();
            assert!(e.to_string().contains("multiple of page_size"), "{e}");
        }
        assert_eq!(c.state_digest(), before);
        c.take_state(r, 2 * p).unwrap().unwrap();
        assert_eq!(
            c.take_state(r, 2 * p).unwrap(),
            None,
            "taken at 2 pages already"
        );
        c.abort(r).unwrap();
        assert_eq!(c.take_state(r, p).unwrap_err(), Error::ClosedRequest);
    }
    let mut plain = RadixCache::new(16, 1).unwrap();
    let r = plain.admit(&[1, 2, 3], None).unwrap();
    let e = plain.take_state(r, 1).unwrap_err();
    assert!(e.to_string().contains("state_slots=0"), "{e}");
    let e = RadixCache::with_tiers(16, 1, 8, 8)
        .unwrap()
        .with_state_slots(3)
        .unwrap_err();
    assert!(e.to_string().contains("disk tier"), "{e}");
    let e = BlockCache::with_window(16, 4, 8, 8)
        .unwrap()
        .with_state_slots(3)
        .unwrap_err();
    assert!(e.to_string().contains("window group"), "{e}");
}

#[test]
fn state_slots_zero_is_the_cache_as_before() {
    let mut a = RadixCache::new(64, 1).unwrap();
    let mut b = RadixCache::new(64, 1).unwrap().with_state_slots(0).unwrap();
    for c in [&mut a as &mut dyn PrefixCache, &mut b] {
        let t = toks(20, 12);
        let r = c.admit(&t, None).unwrap();
        c.commit(r, 20).unwrap();
        c.finish(r).unwrap();
        assert_eq!(c.match_prefix(&t, &None).unwrap(), 19);
        assert_eq!(c.stats().state_slots, 0);
    }
    assert_eq!(a.state_digest(), b.state_digest());
}

/// Admits `t`, takes its hit's snapshot, snapshots at each of `at`, computes all, finishes;
/// returns the hit's slot and the slots taken.
fn cont(c: &mut dyn PrefixCache, t: &[u32], at: &[usize]) -> (Option<u32>, Vec<Option<u32>>) {
    let r = c.admit(t, None).unwrap();
    let hit = c.request(r).unwrap().state_slot;
    c.release_state(r).unwrap();
    let slots = at.iter().map(|&p| c.take_state(r, p).unwrap()).collect();
    c.commit(r, t.len()).unwrap();
    c.finish(r).unwrap();
    c.check().unwrap();
    (hit, slots)
}

fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    [a, b].concat()
}

#[test]
fn a_prompt_end_snapshot_superseded_by_its_request_end_one_is_evicted_first() {
    for (mut c, p) in caches(256, 3) {
        let u = toks(4 * p, 3);
        let b = run(&mut *c, &u, &None, &[p]);
        // The prompt-end snapshot (2 pages) goes cold once the request-end one (6) is there.
        let t = toks(6 * p, 2);
        let a = run(&mut *c, &t, &None, &[2 * p, 6 * p]);
        // All 3 slots held; u's snapshot is the least recently used, but the cold one goes.
        let e = run(&mut *c, &toks(3 * p, 4), &None, &[p]);
        assert_eq!(e[0], a[0], "the superseded snapshot's slot is taken");
        assert_eq!(c.match_prefix(&u, &None).unwrap(), p, "u's snapshot stays");
        assert_ne!(b[0], e[0]);
        let within = cat(&t[..3 * p], &toks(p, 5));
        assert_eq!(c.match_prefix(&within, &None).unwrap(), 0);
        assert_eq!(c.match_prefix(&cat(&t, &toks(p, 5)), &None).unwrap(), 6 * p);
    }
}

#[test]
fn the_snapshot_a_request_continued_from_goes_cool_once_it_finishes_with_its_own() {
    for (mut c, p) in caches(256, 5) {
        let d = toks(4 * p, 5);
        run(&mut *c, &d, &None, &[p]);
        let t = toks(8 * p, 2);
        let a = run(&mut *c, &t, &None, &[8 * p]);
        // The next turn hits the snapshot at 8 pages (refreshing it), then publishes its own:
        // the one at 8 goes cool, after the cold ones and before d's, though more recent.
        let t2 = cat(&t, &toks(4 * p, 6));
        let (hit, _) = cont(&mut *c, &t2, &[12 * p]);
        assert_eq!(hit, a[0]);
        let y = run(&mut *c, &toks(6 * p, 8), &None, &[2 * p, 6 * p]);
        let e = run(&mut *c, &toks(3 * p, 4), &None, &[p]);
        assert_eq!(e[0], y[0], "the cold one first, though it went there later");
        let f = run(&mut *c, &toks(3 * p, 9), &None, &[p]);
        assert_eq!(f[0], a[0], "then the cool one");
        assert_eq!(c.match_prefix(&d, &None).unwrap(), p);
        assert_eq!(c.match_prefix(&cat(&t, &toks(p, 7)), &None).unwrap(), 0);
        assert_eq!(
            c.match_prefix(&cat(&t2, &toks(p, 7)), &None).unwrap(),
            12 * p
        );
    }
}

#[test]
fn a_junction_snapshot_stays_warm_when_superseded() {
    for (mut c, p) in caches(256, 3) {
        let sys = toks(4 * p, 7);
        let a = run(&mut *c, &cat(&sys, &toks(4 * p, 8)), &None, &[8 * p]);
        // b's KV match runs over the shared system prompt: a junction, snapshotted there.
        let b = cat(&sys, &toks(4 * p, 9));
        let r = c.admit(&b, None).unwrap();
        assert_eq!(c.request(r).unwrap().kv_matched, 4 * p);
        let j = c.take_state(r, 4 * p).unwrap();
        c.take_state(r, 8 * p).unwrap();
        c.commit(r, 8 * p).unwrap();
        c.finish(r).unwrap();
        // Two requests continued past the junction: it stays warm, and the LRU goes first.
        let e = run(&mut *c, &toks(3 * p, 4), &None, &[p]);
        assert_eq!(e[0], a[0]);
        assert_ne!(e[0], j);
        let third = cat(&sys, &toks(4 * p, 10));
        assert_eq!(c.match_prefix(&third, &None).unwrap(), 4 * p);
    }
}

#[test]
fn a_snapshot_two_requests_continued_from_stays_warm() {
    for (mut c, p) in caches(256, 3) {
        let t = toks(8 * p, 2);
        let a = run(&mut *c, &t, &None, &[8 * p]);
        // Two sub-agents branch from it: the first makes it cold, the second's hit warm again,
        // and with two continuations it stays warm.
        let (h1, s1) = cont(&mut *c, &cat(&t, &toks(4 * p, 11)), &[12 * p]);
        let (h2, _) = cont(&mut *c, &cat(&t, &toks(4 * p, 12)), &[12 * p]);
        assert_eq!((h1, h2), (a[0], a[0]));
        let e = run(&mut *c, &toks(3 * p, 4), &None, &[p]);
        assert_eq!(e[0], s1[0], "the first branch's, least recently used");
        let turn = cat(&t, &toks(4 * p, 13));
        assert_eq!(c.match_prefix(&turn, &None).unwrap(), 8 * p);
    }
}

#[test]
fn evict_state_evicts_a_published_unpinned_snapshot_only() {
    for (mut c, p) in caches(256, 2) {
        let t = toks(8 * p, 2);
        let s = run(&mut *c, &t, &None, &[2 * p, 6 * p]);
        let (s0, s1) = (s[0].unwrap(), s[1].unwrap());
        let before = c.stats();
        assert!(c.evict_state(s1).unwrap());
        c.check().unwrap();
        assert_eq!(c.stats().evicted_states, before.evicted_states + 1);
        assert_eq!(c.drain_freed_states(), vec![s1]);
        assert!(!c.evict_state(s1).unwrap(), "a free slot");
        // The pages stay: the KV match still runs to 8 pages, the hit falls back to 2.
        let r = c.admit(&t, None).unwrap();
        let v = c.request(r).unwrap();
        assert_eq!((v.num_cached, v.kv_matched), (2 * p, 7 * p));
        assert!(!c.evict_state(s0).unwrap(), "pinned by r's hit");
        let pending = c.take_state(r, 4 * p).unwrap().unwrap();
        assert!(!c.evict_state(pending).unwrap(), "pending");
        c.release_state(r).unwrap();
        assert!(c.evict_state(s0).unwrap());
        c.abort(r).unwrap();
        c.check().unwrap();
        let e = c.evict_state(2).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        assert!(e.to_string().contains("got 2"), "{e}");
        assert_eq!(c.stats().state_free_slots, 2);
    }
}

/// Requests on `sys` with their own tails (seeds `seeds`), each snapshotted at its end (8
/// pages) and, for the first that finds `sys`'s KV without a snapshot, at the junction (4
/// pages); returns the junction's slot.
fn hub(c: &mut dyn PrefixCache, sys: &[u32], p: usize, seeds: &[u32]) -> Option<u32> {
    let mut j = None;
    for &seed in seeds {
        let t = cat(sys, &toks(4 * p, seed));
        let r = c.admit(&t, None).unwrap();
        let v = c.request(r).unwrap();
        let (kv, hit) = (v.kv_matched, v.num_cached);
        c.release_state(r).unwrap();
        if kv >= 4 * p && hit < 4 * p {
            j = c.take_state(r, 4 * p).unwrap();
        }
        c.take_state(r, 8 * p).unwrap();
        c.commit(r, 8 * p).unwrap();
        c.finish(r).unwrap();
        c.check().unwrap();
    }
    j
}

#[test]
fn a_hub_four_requests_went_past_outlives_the_warm_snapshots() {
    for (mut c, p) in caches(256, 8) {
        let sys = toks(4 * p, 30);
        let j = hub(&mut *c, &sys, p, &[31, 32, 33, 34]);
        assert!(j.is_some());
        // 5 held (the hub and 4 request ends), 3 free; 3 + 4 more takes, each saving more
        // than a request end does past the hub: the 4 request ends go, the hub (used before
        // the last of them) stays.
        for seed in 40..47 {
            run(&mut *c, &toks(5 * p, seed), &None, &[5 * p]);
        }
        assert_eq!(
            c.match_prefix(&cat(&sys, &toks(4 * p, 35)), &None).unwrap(),
            4 * p
        );
        assert_eq!(
            c.match_prefix(&cat(&cat(&sys, &toks(4 * p, 34)), &toks(p, 1)), &None)
                .unwrap(),
            4 * p,
            "the last request's end was evicted"
        );
    }
}

#[test]
fn past_a_quarter_of_the_slots_hot_the_least_recent_hub_goes_first() {
    for (mut c, p) in caches(256, 4) {
        let (sys1, sys2) = (toks(4 * p, 50), toks(4 * p, 60));
        let j1 = hub(&mut *c, &sys1, p, &[51, 52, 53, 54]);
        let j2 = hub(&mut *c, &sys2, p, &[61, 62, 63, 64]);
        assert!(j1.is_some() && j2.is_some());
        // Two hubs of 4 slots: past the quarter, the least recent hub goes before any other.
        let e = run(&mut *c, &toks(3 * p, 70), &None, &[p]);
        assert_eq!(e[0], j1);
        assert_eq!(c.match_prefix(&cat(&sys1, &toks(p, 1)), &None).unwrap(), 0);
        assert_eq!(
            c.match_prefix(&cat(&sys2, &toks(p, 1)), &None).unwrap(),
            4 * p
        );
        let last = cat(&cat(&sys2, &toks(4 * p, 64)), &toks(p, 1));
        assert_eq!(c.match_prefix(&last, &None).unwrap(), 8 * p);
    }
}

/// One step of a random sequence.
#[derive(Debug, Clone)]
enum Op {
    /// Admit prompt `prompt` (of a few sharing prefixes) extended by `extra` tokens, in
    /// namespace `ns`.
    Admit {
        prompt: usize,
        extra: usize,
        ns: bool,
    },
    /// Request `req` (mod live) computes `n` more tokens and snapshots at the end, `take`.
    Step {
        req: usize,
        n: usize,
        take: bool,
    },
    /// Request `req` releases its hit's snapshot.
    Release {
        req: usize,
    },
    /// Finish (or abort) request `req`.
    Close {
        req: usize,
        abort: bool,
    },
    Evict {
        n: usize,
    },
    /// Evict the snapshot in state slot `slot` (past the slots: refused).
    EvictState {
        slot: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..4usize, 0..12usize, any::<bool>())
            .prop_map(|(prompt, extra, ns)| Op::Admit { prompt, extra, ns }),
        4 => (0..8usize, 1..10usize, any::<bool>())
            .prop_map(|(req, n, take)| Op::Step { req, n, take }),
        1 => (0..8usize).prop_map(|req| Op::Release { req }),
        2 => (0..8usize, any::<bool>()).prop_map(|(req, abort)| Op::Close { req, abort }),
        1 => (1..12usize).prop_map(|n| Op::Evict { n }),
        1 => (0..5usize).prop_map(|slot| Op::EvictState { slot }),
    ]
}

/// The hit the model expects: the longest published snapshot in `ns` whose tokens are a
/// prefix of the prompt within the match limit.
fn expected_hit(c: &dyn PrefixCache, t: &[u32], ns: &Namespace, p: usize) -> usize {
    let limit = (t.len() - 1) / p * p;
    c.state_snapshots()
        .into_iter()
        .filter(|(_, s, n)| n == ns && s.len() <= limit && t.starts_with(s))
        .map(|(_, s, _)| s.len())
        .max()
        .unwrap_or(0)
}

fn drive(mut c: Box<dyn PrefixCache>, p: usize, ops: Vec<Op>) {
    let shared: Vec<Vec<u32>> = (0..4).map(|i| toks(6 + 5 * i, (i % 2) as u32)).collect();
    let mut live: Vec<RequestId> = Vec::new();
    let mut fresh = 100u32;
    for op in ops {
        match op {
            Op::Admit { prompt, extra, ns } => {
                let mut t = shared[prompt].clone();
                fresh += 1;
                t.extend(toks(extra, fresh));
                let ns: Namespace = ns.then(|| b"x".to_vec().into());
                let want = expected_hit(&*c, &t, &ns, p);
                let before = c.stats();
                match c.admit(&t, ns) {
                    Ok(r) => {
                        let v = c.request(r).unwrap();
                        assert_eq!(v.num_cached, want, "hit ends at the last snapshot");
                        assert!(v.kv_matched >= v.num_cached);
                        assert_eq!(v.state_slot.is_some(), want > 0);
                        live.push(r);
                    }
                    Err(Error::OutOfPages { .. }) => assert_eq!(c.stats(), before),
                    Err(e) => panic!("{e}"),
                }
            }
            Op::Step { req, n, take } if !live.is_empty() => {
                let r = live[req % live.len()];
                let v = c.request(r).unwrap();
                let (done, total) = (v.num_computed, v.num_tokens());
                if done == total {
                    fresh += 1;
                    if c.extend(r, &toks(n, fresh)).is_err() {
                        continue;
                    }
                    continue;
                }
                let to = (done + n).min(total);
                if take && to / p > 0 {
                    let _ = c.take_state(r, to / p * p).unwrap();
                }
                c.commit(r, to).unwrap();
            }
            Op::Release { req } if !live.is_empty() => {
                c.release_state(live[req % live.len()]).unwrap();
            }
            Op::Close { req, abort } if !live.is_empty() => {
                let r = live.remove(req % live.len());
                if abort {
                    c.abort(r).unwrap();
                } else {
                    c.finish(r).unwrap();
                }
            }
            Op::Evict { n } => {
                c.evict(n);
            }
            Op::EvictState { slot } => {
                let before = c.stats();
                let held = c
                    .state_snapshots()
                    .iter()
                    .any(|&(s, _, _)| s as usize == slot);
                match c.evict_state(slot as u32) {
                    Ok(true) => {
                        assert!(held, "only a published snapshot is evicted");
                        assert_eq!(c.stats().evicted_states, before.evicted_states + 1);
                        assert_eq!(c.stats().state_free_slots, before.state_free_slots + 1);
                    }
                    Ok(false) => assert_eq!(c.stats(), before),
                    Err(_) => assert!(slot >= before.state_slots),
                }
            }
            _ => {}
        }
        c.check().unwrap();
        let s = c.stats();
        assert!(s.state_free_slots + s.state_pinned_slots <= s.state_slots);
        assert_eq!(s.state_hit_tokens, s.hit_tokens);
    }
    for r in live {
        c.finish(r).unwrap();
    }
    c.check().unwrap();
    assert_eq!(c.stats().state_pinned_slots, 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn random_sequences_keep_the_invariants_and_the_hit_rule(
        ops in prop::collection::vec(op(), 1..60),
        slots in 1..5usize,
        host in any::<bool>(),
    ) {
        let h = if host { 8 } else { 0 };
        drive(
            Box::new(RadixCache::with_host(40, 1, h).unwrap().with_state_slots(slots).unwrap()),
            1,
            ops.clone(),
        );
        drive(
            Box::new(RadixCache::with_host(24, 2, h).unwrap().with_state_slots(slots).unwrap()),
            2,
            ops.clone(),
        );
        drive(
            Box::new(BlockCache::with_host(24, 2, h).unwrap().with_state_slots(slots).unwrap()),
            2,
            ops,
        );
    }
}

/// Takes a junction snapshot at `at` on `t`'s KV (cached by an earlier request) for a prompt
/// that leaves `t` there; returns its slot.
fn junction(c: &mut dyn PrefixCache, t: &[u32], at: usize, seed: u32) -> Option<u32> {
    let r = c.admit(&cat(&t[..at], &toks(8, seed)), None).unwrap();
    assert_eq!(c.request(r).unwrap().kv_matched, at);
    let slot = c.take_state(r, at).unwrap();
    c.commit(r, at).unwrap();
    c.finish(r).unwrap();
    c.check().unwrap();
    slot
}

#[test]
fn of_the_warm_snapshots_the_one_saving_least_past_its_parent_goes_first() {
    for (mut c, p) in caches(256, 2) {
        // x at 8 pages (a junction, so its continuation leaves it warm), then y a page past it,
        // used later: y saves one page over x, x eight.
        let t = toks(12 * p, 20);
        run(&mut *c, &t, &None, &[]);
        let x = junction(&mut *c, &t, 8 * p, 21);
        let (hit, y) = cont(&mut *c, &cat(&t[..8 * p], &toks(2 * p, 22)), &[9 * p]);
        assert_eq!(hit, x);
        let e = run(&mut *c, &toks(3 * p, 23), &None, &[3 * p]);
        assert_eq!(e[0], y[0], "y goes, though x was used before it");
        let past_y = cat(&cat(&t[..8 * p], &toks(2 * p, 22)), &toks(p, 24));
        assert_eq!(c.match_prefix(&past_y, &None).unwrap(), 8 * p);
    }
}

#[test]
fn a_snapshot_published_below_others_lowers_their_saving() {
    for (mut c, p) in caches(256, 3) {
        let w = run(&mut *c, &toks(3 * p, 25), &None, &[3 * p]);
        // y at 9 pages saves all 9 until the junction x at 8 pages comes below it: then one.
        let t = toks(12 * p, 26);
        let y = run(&mut *c, &t, &None, &[9 * p]);
        junction(&mut *c, &t, 8 * p, 27);
        let e = run(&mut *c, &toks(2 * p, 28), &None, &[2 * p]);
        assert_eq!(e[0], y[0], "y goes, though w (3 pages) was used before it");
        assert_eq!(c.match_prefix(&toks(3 * p + 1, 25), &None).unwrap(), 3 * p);
        let _ = w;
    }
}

#[test]
fn a_snapshot_saves_more_once_the_one_below_it_is_evicted() {
    for (mut c, p) in caches(256, 3) {
        let t = toks(12 * p, 29);
        run(&mut *c, &t, &None, &[]);
        let x = junction(&mut *c, &t, 8 * p, 30);
        let (_, y) = cont(&mut *c, &cat(&t[..8 * p], &toks(2 * p, 31)), &[9 * p]);
        let w = run(&mut *c, &toks(4 * p, 32), &None, &[4 * p]);
        // With x gone, y falls back to nothing: it saves 9 pages, more than w's 4 or v's 5.
        assert!(c.evict_state(x.unwrap()).unwrap());
        run(&mut *c, &toks(5 * p, 33), &None, &[5 * p]);
        let e = run(&mut *c, &toks(2 * p, 34), &None, &[2 * p]);
        assert_eq!(e[0], w[0]);
        let past_y = cat(&cat(&t[..8 * p], &toks(2 * p, 31)), &toks(p, 35));
        assert_eq!(c.match_prefix(&past_y, &None).unwrap(), 9 * p);
        let _ = y;
    }
}

#[test]
fn the_level_rises_with_each_eviction_so_an_unused_big_saving_goes_at_last() {
    for (mut c, p) in caches(512, 2) {
        let big = toks(10 * p, 36);
        run(&mut *c, &big, &None, &[10 * p]);
        // Snapshots of one page each: the first starts at level 0 (priority 1 page), each next
        // one evicts the previous and starts where its priority was, a page higher; the 10th
        // (priority 10 pages) ties with big's, used earlier, which goes at the 11th take.
        for k in 1..=11u32 {
            let e = run(&mut *c, &toks(p, 40 + k), &None, &[p]);
            let kept = c.match_prefix(&cat(&big, &toks(1, 1)), &None).unwrap();
            assert_eq!(kept, if k < 11 { 10 * p } else { 0 }, "take {k}");
            assert!(e[0].is_some());
        }
        assert_eq!(c.stats().evicted_states, 10);
    }
}

#[test]
fn a_hit_restarts_a_snapshot_from_the_level() {
    for (mut c, p) in caches(512, 3) {
        let (x, y) = (toks(10 * p, 50), toks(11 * p, 51));
        run(&mut *c, &x, &None, &[10 * p]);
        run(&mut *c, &y, &None, &[11 * p]);
        // One-page snapshots, each evicting the one before: the 9th leaves the level at 8 pages.
        for k in 1..=9u32 {
            run(&mut *c, &toks(p, 60 + k), &None, &[p]);
        }
        // A hit on x (priority 10 pages) restarts it from the level: 8 + 10 pages.
        let r = c.admit(&cat(&x, &toks(1, 2)), None).unwrap();
        assert_eq!(c.request(r).unwrap().num_cached, 10 * p);
        c.release_state(r).unwrap();
        c.abort(r).unwrap();
        // The next one-page snapshots reach 10 and 11 pages: then y (11) goes, x stays.
        for k in 10..=12u32 {
            run(&mut *c, &toks(p, 60 + k), &None, &[p]);
        }
        assert_eq!(
            c.match_prefix(&cat(&x, &toks(1, 2)), &None).unwrap(),
            10 * p
        );
        assert_eq!(c.match_prefix(&cat(&y, &toks(1, 2)), &None).unwrap(), 0);
    }
}
