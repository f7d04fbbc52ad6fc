//! The sliding-window group of both caches: what a request holds, what a hit needs, what is
//! released, and the invariants `check()` recomputes, at page sizes 1 and 4.

use radixkv::{BlockCache, Error, PrefixCache, RadixCache, RequestId};

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
    let e = RadixCache::with_groups(16, 1, 8, 0, 4, 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("host"), "{e}");
    let c = RadixCache::with_groups(16, 1, 0, 0, 0, 0).unwrap();
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
