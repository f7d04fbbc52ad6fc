//! The sliding-window group of both caches: what a request holds, what a hit needs, what is
//! released, and the invariants `check()` recomputes, at page sizes 1 and 4.

use radixkv::{BlockCache, CacheEvent, Error, PrefixCache, RadixCache, RequestId};

fn caches(p: usize, window: usize, wpages: usize, pages: usize) -> Vec<Box<dyn PrefixCache>> {
    vec![
        Box::new(RadixCache::with_window(pages, p, window, wpages).unwrap()),
        Box::new(BlockCache::with_window(pages, p, window, wpages).unwrap()),
    ]
}

fn held(c: &dyn PrefixCache, r: RequestId) -> Vec<usize> {
    let v = c.request(r).unwrap();
    v.window_pages
        .iter()
        .enumerate()
        .filter(|(_, &w)| w != u32::MAX)
        .map(|(j, _)| j)
        .collect()
}

fn toks(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + seed * 1000 + 1).collect()
}

#[test]
fn a_request_holds_only_what_its_next_query_reads() {
    for p in [1usize, 4] {
        for mut c in caches(p, 8, 64, 256) {
            let t = toks(40, 0);
            let r = c.admit(&t, None).unwrap();
            assert_eq!(
                held(&*c, r).len(),
                40usize.div_ceil(p),
                "all pages held before compute"
            );
            for n in [1, 5, 17, 33, 39] {
                c.commit(r, n).unwrap();
                c.check().unwrap();
                // A hit at the last computed boundary b reads keys b-7..b: pages from
                // (b + 1 - 8) / p on (the next query, at n >= b, reads from there or later).
                let b = n / p * p;
                let lo = (b + 1).saturating_sub(8) / p;
                assert_eq!(held(&*c, r), (lo..40usize.div_ceil(p)).collect::<Vec<_>>());
            }
            let s = c.stats();
            // In decode, a request holds about window + page_size tokens of window pages.
            let holding = 64 - s.window_free_pages - s.window_evictable_pages;
            assert!(holding * p <= 8 + 2 * p, "{holding} pages of {p} held");
            c.finish(r).unwrap();
            c.check().unwrap();
            assert_eq!(
                c.stats().window_free_pages + c.stats().window_evictable_pages,
                64
            );
        }
    }
}

#[test]
fn a_hit_ends_where_the_window_is_cached() {
    for p in [1usize, 4] {
        for mut c in caches(p, 8, 64, 256) {
            let t = toks(41, 1);
            let r = c.admit(&t, None).unwrap();
            c.commit(r, 41).unwrap();
            c.finish(r).unwrap();
            c.check().unwrap();
            // Every window page was published before release: the whole prompt is a hit.
            let limit = 40 / p * p;
            assert_eq!(c.match_prefix(&t, &None).unwrap(), limit);
            // Evict window pages by filling the window pool with another request's pages.
            let u = toks(64 * p, 2);
            let r2 = c.admit(&u, None);
            let r2 = match r2 {
                Ok(r) => r,
                Err(e) => panic!("{e}"),
            };
            c.commit(r2, 64 * p - 1).unwrap();
            c.check().unwrap();
            // The full pages of `t` are all still cached, its window pages are not.
            assert_eq!(c.match_prefix(&t, &None).unwrap(), 0);
            c.abort(r2).unwrap();
            let before = c.stats();
            let r3 = c.admit(&t, None).unwrap();
            assert_eq!(c.request(r3).unwrap().num_cached, 0);
            let after = c.stats();
            assert_eq!(after.window_cut_hits, before.window_cut_hits + 1);
            assert_eq!(
                after.window_cut_tokens - before.window_cut_tokens,
                limit as u64
            );
            c.abort(r3).unwrap();
            c.check().unwrap();
        }
    }
}

#[test]
fn a_branch_inside_the_window_hits_and_one_past_a_gone_window_is_cut() {
    let p = 4;
    for mut c in caches(p, 8, 20, 256) {
        let t = toks(64, 3);
        let r = c.admit(&t, None).unwrap();
        c.commit(r, 64).unwrap();
        c.finish(r).unwrap();
        // Pages 0..16 are all cached in both groups while the window pool has room for them.
        let mut branch = t[..32].to_vec();
        branch.extend(toks(10, 4));
        assert_eq!(c.match_prefix(&branch, &None).unwrap(), 32);
        // Take 16 window pages: the 4 left evictable are the most recently released (the end
        // of `t`), so a branch at token 32 is cut and one at 60 is not.
        let hog = c.admit(&toks(64, 5), None).unwrap();
        assert_eq!(c.stats().window_evictable_pages, 4);
        assert!(c.match_prefix(&branch, &None).unwrap() < 32);
        let mut late = t[..60].to_vec();
        late.push(999_999);
        assert_eq!(c.match_prefix(&late, &None).unwrap(), 60);
        c.abort(hog).unwrap();
        c.check().unwrap();
    }
}

#[test]
fn sharing_counts_and_out_of_pages_changes_nothing() {
    let p = 1;
    for mut c in caches(p, 4, 12, 64) {
        let t = toks(10, 6);
        let a = c.admit(&t, None).unwrap();
        c.commit(a, 10).unwrap();
        let mut t2 = t.clone();
        t2.push(5);
        // Shares a's last window (pages 6..9 held by both).
        let b = c.admit(&t2, None).unwrap();
        assert_eq!(c.request(b).unwrap().num_cached, 10);
        c.check().unwrap();
        let digest = c.state_digest();
        let stats = c.stats();
        match c.admit(&toks(20, 7), None) {
            Err(Error::OutOfPages { .. }) => {}
            other => panic!("expected OutOfPages, got {other:?}"),
        }
        match c.extend(b, &toks(20, 8)) {
            Err(Error::OutOfPages { .. }) => {}
            other => panic!("expected OutOfPages, got {other:?}"),
        }
        assert_eq!(c.state_digest(), digest);
        assert_eq!(c.stats(), stats);
        c.finish(a).unwrap();
        c.finish(b).unwrap();
        c.check().unwrap();
        assert!(c.reset() > 0);
        assert_eq!(c.stats().window_free_pages, 12);
        c.check().unwrap();
    }
}

#[test]
fn bad_window_arguments_are_named() {
    for (w, wp) in [(0, 4), (4, 0)] {
        let e = RadixCache::with_window(16, 1, w, wp)
            .unwrap_err()
            .to_string();
        assert!(e.contains("window"), "{e}");
    }
    let e = RadixCache::with_groups(16, 1, 8, 4, 4, 4, 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("with a disk tier (disk_pages=4)"), "{e}");
    let c = RadixCache::with_groups(16, 1, 0, 0, 0, 0, 0).unwrap();
    assert_eq!(c.window(), (0, 0));
}

#[test]
fn digests_agree_across_equal_runs_and_differ_on_window_state() {
    let run = |evict: bool| {
        let mut c = RadixCache::with_window(64, 2, 6, 16).unwrap();
        let r = c.admit(&toks(20, 9), None).unwrap();
        c.commit(r, 20).unwrap();
        c.finish(r).unwrap();
        if evict {
            let h = c.admit(&toks(20, 10), None).unwrap();
            c.abort(h).unwrap();
        }
        c.state_digest()
    };
    assert_eq!(run(false), run(false));
    assert_ne!(run(false), run(true));
}

#[test]
fn lpm_ranks_by_the_hit_the_window_allows() {
    use radixkv::{Policy, Scheduler};
    let p = 4;
    for mut c in caches(p, 8, 24, 256) {
        // `long` is cached in full pages, but another request's pages push its window pages
        // out; `short` is cached whole in both groups.
        let long = toks(64, 11);
        let short = toks(24, 12);
        for t in [&long, &short] {
            let r = c.admit(t, None).unwrap();
            c.commit(r, t.len()).unwrap();
            c.finish(r).unwrap();
        }
        let hog = c.admit(&toks(80, 13), None).unwrap();
        c.commit(hog, 80).unwrap();
        c.finish(hog).unwrap();
        let mut a = long.clone();
        a.push(1);
        let mut b = short.clone();
        b.push(1);
        let (cut_long, hit_short) = (
            c.match_prefix(&a, &None).unwrap(),
            c.match_prefix(&b, &None).unwrap(),
        );
        assert!(cut_long < hit_short, "{cut_long} {hit_short}");
        let mut s = Scheduler::new(&*c, Policy::Lpm, 0);
        let ia = s.add(&a, None, 0, 1).unwrap();
        let ib = s.add(&b, None, 0, 1).unwrap();
        // The trie sees 64 cached tokens for `a`; the cache allows fewer than `b`'s 24.
        let out = s.schedule(&mut *c, 1, 1);
        assert_eq!(out.iter().map(|x| x.id).collect::<Vec<_>>(), vec![ib]);
        let _ = ia;
        for x in &out {
            c.abort(x.request).unwrap();
        }
        c.check().unwrap();
    }
}

/// What a router knows from the events alone: the full pages and the window pages cached.
#[derive(Default)]
struct RouterView {
    full: std::collections::HashSet<radixkv::BlockHash>,
    window: std::collections::HashSet<radixkv::BlockHash>,
}

impl RouterView {
    fn apply(&mut self, events: Vec<CacheEvent>) {
        for e in events {
            match e {
                CacheEvent::Stored { hashes, .. } => self.full.extend(hashes),
                CacheEvent::WindowStored { hashes, .. } => {
                    for h in hashes {
                        assert!(self.window.insert(h), "a window page stored twice");
                    }
                }
                CacheEvent::Removed { hashes } => {
                    for h in hashes {
                        assert!(self.full.remove(&h), "removed a full page never stored");
                    }
                }
                CacheEvent::WindowRemoved { hashes } => {
                    for h in hashes {
                        assert!(self.window.remove(&h), "removed a window page never stored");
                    }
                }
                CacheEvent::Cleared => {
                    self.full.clear();
                    self.window.clear();
                }
                CacheEvent::StateStored { .. } | CacheEvent::StateRemoved { .. } => {
                    panic!("a state event from a cache without state slots")
                }
            }
        }
    }

    /// The hit the window rule allows over the pages these events say are cached.
    fn hit(&self, tokens: &[u32], p: usize, window: usize) -> usize {
        let limit = (tokens.len() - 1) / p * p;
        let keys = radixkv::block_hashes(&tokens[..limit], p, &None);
        let m = keys.iter().take_while(|k| self.full.contains(*k)).count();
        (0..=m)
            .rev()
            .find(|&k| {
                let lo = ((k * p + 1).saturating_sub(window) / p).min(k);
                keys[lo..k].iter().all(|h| self.window.contains(h))
            })
            .unwrap()
            * p
    }
}

#[test]
fn events_tell_a_router_the_hit_the_window_allows() {
    // Agent-like traffic (sessions growing turn by turn, branches, a shared prefix) on a window
    // pool small enough to evict: a router that replays the events predicts every hit.
    for p in [1usize, 4] {
        let wp = if p == 1 { 48 } else { 14 };
        let mut all = caches(p, 8, wp, 400);
        // With a window host tier: moves record nothing, drops from the host record removals.
        all.push(Box::new(
            RadixCache::with_groups(400, p, 50, 0, 8, wp, 12 / p).unwrap(),
        ));
        all.push(Box::new(
            BlockCache::with_groups(400, p, 50, 0, 8, wp, 12 / p).unwrap(),
        ));
        for (i, mut c) in all.into_iter().enumerate() {
            c.record_events(true);
            let mut view = RouterView::default();
            let mut sessions: Vec<Vec<u32>> = (0..5).map(|s| toks(10 + s, s as u32)).collect();
            let mut rng = 7u64;
            for step in 0..120 {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let s = (rng >> 33) as usize % sessions.len();
                let mut t = sessions[s].clone();
                if step % 9 == 4 {
                    t.truncate(t.len() / 2); // a branch from inside the session
                }
                t.extend((0..(rng >> 40) as u32 % 6 + 1).map(|i| i + step * 31 + 5));
                if t.len() > 40 {
                    t = toks(10, step + 100); // the session ends, a new one starts
                }
                view.apply(c.drain_events());
                assert_eq!(
                    view.hit(&t, p, 8),
                    c.match_prefix(&t, &None).unwrap(),
                    "P={p} step {step}"
                );
                let r = c.admit(&t, None).unwrap();
                c.commit(r, t.len()).unwrap();
                c.finish(r).unwrap();
                sessions[s] = t;
                if step == 60 {
                    c.evict(5);
                }
            }
            view.apply(c.drain_events());
            c.check().unwrap();
            let s = c.stats();
            assert_eq!(
                view.window.len(),
                s.window_evictable_pages + s.window_host_used_pages
            );
            assert!(s.window_evicted_pages > 0, "the pool never evicted");
            assert_eq!(i >= 2, s.window_loaded_pages > 0, "{i}: {s:?}");
            c.reset();
            view.apply(c.drain_events());
            assert!(view.full.is_empty() && view.window.is_empty());
        }
    }
}

#[test]
fn a_paused_session_finds_its_window_on_the_host() {
    // Session A pauses; five other sessions push its window pages out of the window pool. With
    // a window host tier they went to the host and come back for A's next turn; without one the
    // hit is cut to where A's window is still cached.
    for p in [1usize, 4] {
        let wpages = if p == 1 { 40 } else { 12 };
        for host in [0usize, 160 / p] {
            let make: [Box<dyn PrefixCache>; 2] = [
                Box::new(RadixCache::with_groups(400, p, 64, 0, 8, wpages, host).unwrap()),
                Box::new(BlockCache::with_groups(400, p, 64, 0, 8, wpages, host).unwrap()),
            ];
            for mut c in make {
                let a = toks(30, 1);
                let r = c.admit(&a, None).unwrap();
                c.commit(r, 30).unwrap();
                c.finish(r).unwrap();
                for s in 2..7 {
                    let t = toks(30, s);
                    let r = c.admit(&t, None).unwrap();
                    c.commit(r, 30).unwrap();
                    c.finish(r).unwrap();
                }
                c.check().unwrap();
                let stats = c.stats();
                assert_eq!(stats.window_host_used_pages > 0, host > 0);
                let mut next = a.clone();
                next.extend([5, 6, 7]);
                let want = 30 / p * p; // all of A that was published (whole pages)
                let hit = c.match_prefix(&next, &None).unwrap();
                if host == 0 {
                    assert!(hit < want, "P={p}: a window gone from the pool still hit");
                    continue;
                }
                assert_eq!(hit, want, "P={p}: the window on the host was not found");
                c.drain_copies();
                let r = c.admit(&next, None).unwrap();
                assert_eq!(c.request(r).unwrap().num_cached, want);
                let loads: Vec<_> = c
                    .drain_copies()
                    .into_iter()
                    .filter(|x| x.kind == radixkv::CopyKind::WindowLoad)
                    .collect();
                let held: Vec<u32> = c.request(r).unwrap().window_pages.to_vec();
                // One load per page of the hit's window, each into a page the request holds.
                let lo = (want + 1).saturating_sub(8) / p;
                assert_eq!(loads.len(), want / p - lo, "P={p}");
                for x in &loads {
                    assert!(held.contains(&x.dst) && (x.src as usize) < host);
                }
                assert_eq!(c.stats().window_loaded_pages, loads.len() as u64);
                c.check().unwrap();
                c.finish(r).unwrap();
                c.check().unwrap();
            }
        }
    }
}

#[test]
fn window_host_arguments_are_checked() {
    let e = RadixCache::with_groups(16, 1, 0, 0, 4, 8, 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("window_host_pages=4 needs a host tier"), "{e}");
    let e = RadixCache::with_groups(16, 1, 8, 0, 0, 0, 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs a window group"), "{e}");
    let c = BlockCache::with_groups(16, 4, 8, 0, 4, 8, 4).unwrap();
    assert_eq!(c.window_host_pages(), 4);
}
