//! RadixCache unit tests with exact page ids and eviction orders (docs/SEMANTICS.md).
//!
//! Most tests run at page sizes 1 and 4 with tokens built from "units": one unit is one page of
//! tokens, so page ids and page counts are the same at both sizes and only token counts scale.
//! `check()` runs after every operation (the `Ck` wrapper does it).

use radixkv::{Error, PrefixCache, RadixCache};

#[macro_use]
mod common;
use common::*;

fn radix(num_pages: usize, p: usize) -> Ck<RadixCache> {
    let c = Ck {
        c: RadixCache::new(num_pages, p).unwrap(),
    };
    c.check();
    c
}

// ------------------------------------------------------------------------------------------------

/// Freed pages go back to the set and the smallest free ids are handed out first again.
#[test]
fn smallest_free_ids_come_first_again() {
    for p in [1, 4] {
        let mut c = radix(16, p);
        let ids: Vec<_> = [u(p, &[1, 2, 3]), u(p, &[4, 5]), u(p, &[6])]
            .iter()
            .map(|t| c.admit(t))
            .collect();
        c.abort(ids[0]);
        c.abort(ids[2]);
        let r = c.admit(&u(p, &[7, 8, 9, 10]));
        assert_eq!(c.pages(r), vec![0, 1, 2, 5]);
    }
}

fn commit_and_readmit(p: usize) {
    let mut c = radix(16, p);
    let a = u(p, &[1, 2, 3, 4, 5]);
    let a9 = cat(&a, &u(p, &[9]));
    let r = c.admit(&a);
    c.commit(r, 2 * p);
    assert_eq!(c.matched(&a9), 2 * p);
    // Published pages of a live request are pinned: not evictable.
    assert_eq!(c.counts(), (11, 0, 5));
    assert_eq!(c.evict(16), 0);
    c.commit(r, 5 * p);
    // At most floor((n - 1) / P) * P tokens come from the cache.
    assert_eq!(c.matched(&a), 4 * p);
    assert_eq!(c.matched(&a9), 5 * p);
    assert_eq!(c.matched(&a[..3 * p]), 2 * p);
    assert_eq!(c.matched(&a[..3 * p + 1]), 3 * p);
    let r2 = c.admit(&a);
    assert_eq!(c.cached(r2), 4 * p);
    assert_eq!(c.c.request(r2).unwrap().num_computed, 4 * p);
    assert_eq!(c.pages(r2), vec![0, 1, 2, 3, 5]);
    let s = c.stats();
    assert_eq!(
        (s.queries, s.query_tokens, s.hit_tokens),
        (2, 10 * p as u64, 4 * p as u64)
    );
    assert_eq!(s.hit_rate(), 0.4);
    assert_eq!(c.counts(), (10, 0, 6));
    // r2 computed nothing beyond its hit: finishing frees its private page 5.
    c.finish(r2);
    assert_eq!(c.counts(), (11, 0, 5));
    c.finish(r);
    assert_eq!(c.counts(), (11, 5, 0));
    let r3 = c.admit(&a9);
    assert_eq!(c.cached(r3), 5 * p);
    assert_eq!(c.pages(r3), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(c.counts(), (10, 0, 6));
}

at_page_sizes!(
    commit_publishes_and_readmit_hits,
    commit_and_readmit,
    [1, 4]
);

#[test]
fn partial_pages_are_never_published_p4() {
    let mut c = radix(16, 4);
    let a = range(100, 120); // 20 tokens, 5 pages
    let r = c.admit(&a);
    c.commit(r, 3);
    assert_eq!(c.matched(&a), 0);
    c.commit(r, 9);
    assert_eq!(c.matched(&a), 8);
    c.commit(r, 11);
    assert_eq!(c.matched(&a), 8);
    // The probe's own match limit: floor((n - 1) / 4) * 4.
    assert_eq!(c.matched(&a[..9]), 8);
    assert_eq!(c.matched(&a[..8]), 4);
    assert_eq!(c.matched(&a[..5]), 4);
    assert_eq!(c.matched(&a[..4]), 0);
    // A divergence inside a page rounds the hit down to that page's start.
    let b = cat(&a[..6], &[7, 7, 7]);
    assert_eq!(c.matched(&b), 4);
    // finish publishes the full pages of what is computed (11 tokens: 2 pages).
    c.finish(r);
    assert_eq!(c.counts(), (14, 2, 0));
    let rb = c.admit(&b);
    assert_eq!(c.cached(rb), 4);
    // Page 0 is shared, the rest comes from the smallest free ids (2, 3, ...).
    assert_eq!(c.pages(rb), vec![0, 2, 3]);
    // Extending inside the last partial page needs no new page.
    c.extend(rb, &[8, 8, 8]);
    assert_eq!(c.pages(rb), vec![0, 2, 3]);
    c.extend(rb, &[8]);
    assert_eq!(c.pages(rb), vec![0, 2, 3, 4]);
}

#[test]
fn token_exact_match_p1() {
    let mut c = radix(32, 1);
    let a = range(100, 110);
    let r = c.admit(&a);
    c.commit(r, 7);
    assert_eq!(c.matched(&a), 7);
    let b = cat(&a[..5], &[1, 2]);
    assert_eq!(c.matched(&b), 5);
    c.commit(r, 10);
    assert_eq!(c.matched(&a), 9);
    c.finish(r);
    let rb = c.admit(&b);
    assert_eq!(c.cached(rb), 5);
    assert_eq!(c.pages(rb), vec![0, 1, 2, 3, 4, 10, 11]);
}

fn split(p: usize) {
    let mut c = radix(16, p);
    let a = u(p, &[1, 2, 3, 4, 5, 6]);
    let ra = c.admit(&a);
    assert_eq!(c.pages(ra), vec![0, 1, 2, 3, 4, 5]);
    c.commit(ra, 6 * p);
    c.finish(ra);
    let b = u(p, &[1, 2, 3, 7, 8]);
    let rb = c.admit(&b);
    assert_eq!(c.cached(rb), 3 * p);
    assert_eq!(c.pages(rb), vec![0, 1, 2, 6, 7]);
    c.commit(rb, 5 * p);
    c.finish(rb);
    // Both branches stay cached, sharing the trunk.
    assert_eq!(c.matched(&cat(&a, &u(p, &[9]))), 6 * p);
    assert_eq!(c.matched(&cat(&b, &u(p, &[9]))), 5 * p);
    assert_eq!(c.matched(&u(p, &[1, 2, 3, 9])), 3 * p);
    assert_eq!(c.matched(&u(p, &[1, 2, 9])), 2 * p);
    assert_eq!(c.matched(&u(p, &[9, 1, 2])), 0);
    assert_eq!(c.counts(), (8, 8, 0));
    let rc = c.admit(&u(p, &[1, 2, 3, 7, 8, 10]));
    assert_eq!(c.cached(rc), 5 * p);
    assert_eq!(c.pages(rc), vec![0, 1, 2, 6, 7, 8]);
    let rd = c.admit(&u(p, &[1, 2, 3, 4, 5, 6, 11]));
    assert_eq!(c.cached(rd), 6 * p);
    assert_eq!(c.pages(rd), vec![0, 1, 2, 3, 4, 5, 9]);
    // A split in the middle of the second branch's edge.
    let re = c.admit(&u(p, &[1, 2, 3, 7, 12]));
    assert_eq!(c.cached(re), 4 * p);
    assert_eq!(c.pages(re), vec![0, 1, 2, 6, 10]);
    c.abort(rc);
    c.abort(rd);
    c.abort(re);
    assert_eq!(c.counts(), (8, 8, 0));
    assert_eq!(c.matched(&cat(&b, &u(p, &[9]))), 5 * p);
}

at_page_sizes!(split_on_divergence_keeps_both_branches, split, [1, 4]);

#[test]
fn split_inside_a_page_branches_at_the_page_start_p4() {
    let mut c = radix(16, 4);
    let a = range(0, 16);
    let ra = c.admit(&a);
    c.commit(ra, 16);
    c.finish(ra);
    let b = cat(&a[..6], &[90, 91, 92]);
    let rb = c.admit(&b);
    assert_eq!(c.cached(rb), 4);
    assert_eq!(c.pages(rb), vec![0, 4, 5]);
    c.commit(rb, 9);
    c.finish(rb);
    // Page 4 (tokens a[4..6] + [90, 91]) is a branch beside page 1; page 5 was partial: freed.
    assert_eq!(c.counts(), (11, 5, 0));
    assert_eq!(c.matched(&cat(&a, &[1])), 16);
    assert_eq!(c.matched(&cat(&b[..8], &[0])), 8);
    assert_eq!(c.matched(&cat(&b, &[93, 94])), 8);
    let rc = c.admit(&cat(&b[..8], &[1, 2, 3, 4, 5]));
    assert_eq!(c.pages(rc), vec![0, 4, 5, 6]);
}

fn lru_order(p: usize) {
    let mut c = radix(16, p);
    let t = [1, 2, 3, 4];
    let x = u(p, &[1, 2, 3, 4, 11, 12, 13]);
    let y = u(p, &[1, 2, 3, 4, 21, 22, 23]);
    let z = u(p, &[1, 2, 3, 4, 31, 32, 33]);
    let q = |v: &[u32]| cat(v, &u(p, &[99]));
    let rx = c.admit(&x);
    assert_eq!(c.pages(rx), vec![0, 1, 2, 3, 4, 5, 6]);
    c.commit(rx, 7 * p);
    c.finish(rx);
    let ry = c.admit(&y);
    assert_eq!(c.pages(ry), vec![0, 1, 2, 3, 7, 8, 9]);
    c.commit(ry, 7 * p);
    c.finish(ry);
    let rz = c.admit(&z);
    assert_eq!(c.pages(rz), vec![0, 1, 2, 3, 10, 11, 12]);
    c.commit(rz, 7 * p);
    c.finish(rz);
    // Touch x again: use order is now y (oldest), z, x (newest).
    let rq = c.admit(&q(&x));
    assert_eq!(c.pages(rq), vec![0, 1, 2, 3, 4, 5, 6, 13]);
    c.abort(rq);
    assert_eq!(c.counts(), (3, 13, 0));
    // Least recently used leaf first, deepest page of the edge first.
    assert_eq!(c.evict(2), 2); // y's pages 9, 8
    assert_eq!(c.matched(&q(&y)), 5 * p);
    assert_eq!(c.matched(&q(&z)), 7 * p);
    assert_eq!(c.matched(&q(&x)), 7 * p);
    assert_eq!(c.evict(2), 2); // y's page 7, then z's page 12
    assert_eq!(c.matched(&q(&y)), 4 * p);
    assert_eq!(c.matched(&q(&z)), 6 * p);
    assert_eq!(c.matched(&q(&x)), 7 * p);
    assert_eq!(c.stats().evicted_pages, 4);
    assert_eq!(c.counts(), (7, 9, 0));
    // Free now: {7, 8, 9, 12, 13, 14, 15}; the smallest go first, no eviction needed.
    let rw = c.admit(&u(p, &[50, 51, 52]));
    assert_eq!(c.pages(rw), vec![7, 8, 9]);
    assert_eq!(c.stats().evicted_pages, 4);
    // Six pages with four free: evict z's 11 and 10 first, then take the smallest six.
    let rv = c.admit(&u(p, &[60, 61, 62, 63, 64, 65]));
    assert_eq!(c.pages(rv), vec![10, 11, 12, 13, 14, 15]);
    assert_eq!(c.stats().evicted_pages, 6);
    assert_eq!(c.matched(&q(&z)), 4 * p);
    assert_eq!(c.matched(&q(&x)), 7 * p);
    assert_eq!(c.counts(), (0, 7, 9));
    c.abort(rw);
    c.abort(rv);
    assert_eq!(c.counts(), (9, 7, 0));
    // Only x's branch is left above the trunk: it goes first, the trunk after it.
    assert_eq!(c.evict(3), 3);
    assert_eq!(c.matched(&q(&x)), 4 * p);
    assert_eq!(c.evict(1), 1);
    assert_eq!(c.matched(&q(&u(p, &t))), 3 * p);
    assert_eq!(c.stats().evicted_pages, 10);
    let r = c.admit(&u(p, &[70, 71]));
    assert_eq!(c.pages(r), vec![3, 4]);
}

at_page_sizes!(lru_leaf_eviction_order, lru_order, [1, 4]);

fn trunk_outlives_branches(p: usize) {
    let mut c = radix(16, p);
    let t = u(p, &[1, 2, 3]);
    let a = u(p, &[1, 2, 3, 4, 5]);
    let b = u(p, &[1, 2, 3, 6, 7]);
    let w = u(p, &[8, 9]);
    let q = |v: &[u32]| cat(v, &u(p, &[99]));
    for (tokens, pages) in [
        (&a, vec![0, 1, 2, 3, 4]),
        (&b, vec![0, 1, 2, 5, 6]),
        (&w, vec![7, 8]),
    ] {
        let r = c.admit(tokens);
        assert_eq!(c.pages(r), pages);
        c.commit(r, tokens.len());
        c.finish(r);
    }
    // Use order: a, then b (which also touched the trunk), then w.
    assert_eq!(c.evict(2), 2);
    assert_eq!(c.matched(&q(&a)), 3 * p);
    assert_eq!(c.matched(&q(&b)), 5 * p);
    assert_eq!(c.evict(2), 2);
    assert_eq!(c.matched(&q(&b)), 3 * p);
    // Now the trunk is a leaf, last used with b: older than w, so it goes before w.
    assert_eq!(c.evict(1), 1);
    assert_eq!(c.matched(&q(&t)), 2 * p);
    assert_eq!(c.matched(&q(&w)), 2 * p);
    let r = c.admit(&u(p, &[30]));
    assert_eq!(c.pages(r), vec![2]);
}

at_page_sizes!(
    shared_trunk_outlives_its_branches,
    trunk_outlives_branches,
    [1, 4]
);

fn pinned_never_evicted(p: usize) {
    let mut c = radix(12, p);
    let a = u(p, &[1, 2, 3, 4, 5, 6]);
    let ra = c.admit(&a);
    c.commit(ra, 6 * p);
    c.finish(ra);
    assert_eq!(c.counts(), (6, 6, 0));
    let b = u(p, &[1, 2, 3, 9, 10]);
    let r = c.admit(&b);
    assert_eq!(c.cached(r), 3 * p);
    assert_eq!(c.pages(r), vec![0, 1, 2, 6, 7]);
    assert_eq!(c.counts(), (4, 3, 5));
    // Only a's unpinned tail (pages 3, 4, 5) can go.
    assert_eq!(c.reset(), 3);
    assert_eq!(c.matched(&cat(&a, &u(p, &[99]))), 3 * p);
    assert_eq!(c.counts(), (7, 0, 5));
    assert_eq!(c.evict(5), 0);
    let before = c.stats();
    assert_eq!(
        c.try_admit(&u(p, &[20, 21, 22, 23, 24, 25, 26, 27])),
        Err(Error::OutOfPages {
            needed: 8,
            available: 7
        })
    );
    assert_eq!(c.stats(), before);
    c.commit(r, 5 * p);
    assert_eq!(c.counts(), (7, 0, 5));
    assert_eq!(c.evict(10), 0);
    assert_eq!(c.matched(&cat(&b, &u(p, &[99]))), 5 * p);
    c.finish(r);
    assert_eq!(c.counts(), (7, 5, 0));
    assert_eq!(c.reset(), 5);
    assert_eq!(c.counts(), (12, 0, 0));
    assert_eq!(c.stats().evicted_pages, 8);
    assert_eq!(c.matched(&cat(&b, &u(p, &[99]))), 0);
}

at_page_sizes!(pinned_pages_are_never_evicted, pinned_never_evicted, [1, 4]);

fn computed_twice(p: usize) {
    let a = u(p, &[1, 2, 3, 4, 5, 6]);
    let a7 = cat(&a, &u(p, &[7]));
    let first: Vec<u32> = (0..6).collect();
    let second: Vec<u32> = (6..12).collect();

    // r1 publishes first: its copy stays, r2's copy stays private to r2.
    let mut c = radix(16, p);
    let r1 = c.admit(&a);
    let r2 = c.admit(&a);
    assert_eq!((c.pages(r1), c.pages(r2)), (first.clone(), second.clone()));
    assert_eq!(c.cached(r2), 0);
    c.commit(r1, 6 * p);
    c.commit(r2, 6 * p);
    assert_eq!((c.pages(r1), c.pages(r2)), (first.clone(), second.clone()));
    assert_eq!(c.counts(), (4, 0, 12));
    assert_eq!(c.matched(&a7), 6 * p);
    let r3 = c.admit(&a7);
    assert_eq!(c.pages(r3), vec![0, 1, 2, 3, 4, 5, 12]);
    c.abort(r3);
    // r2's duplicates are freed when it ends; r1 still pins the stored copy.
    c.finish(r2);
    assert_eq!(c.counts(), (10, 0, 6));
    let rx = c.admit(&u(p, &[30]));
    assert_eq!(c.pages(rx), vec![6]);
    c.abort(rx);
    c.finish(r1);
    assert_eq!(c.counts(), (10, 6, 0));
    assert_eq!(c.reset(), 6);

    // r2 publishes first: now r2's pages are the stored copy.
    let mut c = radix(16, p);
    let r1 = c.admit(&a);
    let r2 = c.admit(&a);
    c.commit(r2, 6 * p);
    c.commit(r1, 6 * p);
    assert_eq!((c.pages(r1), c.pages(r2)), (first.clone(), second.clone()));
    let r3 = c.admit(&a7);
    assert_eq!(c.pages(r3), vec![6, 7, 8, 9, 10, 11, 12]);
    c.abort(r3);
    c.finish(r1);
    assert_eq!(c.counts(), (10, 0, 6));
    let rx = c.admit(&u(p, &[30]));
    assert_eq!(c.pages(rx), vec![0]);
    c.abort(rx);
    c.finish(r2);
    assert_eq!(c.counts(), (10, 6, 0));

    // Partly the same: the shared head is a duplicate, the rest a new branch.
    let mut c = radix(16, p);
    let r1 = c.admit(&a);
    let b = u(p, &[1, 2, 3, 7, 8]);
    let r2 = c.admit(&b);
    assert_eq!(c.pages(r2), vec![6, 7, 8, 9, 10]);
    c.commit(r1, 6 * p);
    c.commit(r2, 5 * p);
    assert_eq!(c.pages(r2), vec![6, 7, 8, 9, 10]);
    let r3 = c.admit(&u(p, &[1, 2, 3, 7, 8, 9]));
    assert_eq!(c.cached(r3), 5 * p);
    assert_eq!(c.pages(r3), vec![0, 1, 2, 9, 10, 11]);
    c.abort(r3);
    c.finish(r2);
    // Pages 6, 7, 8 were duplicates (freed); 9, 10 are r2's branch, now unpinned.
    assert_eq!(c.counts(), (8, 2, 6));
    let rx = c.admit(&u(p, &[40, 41, 42, 43]));
    assert_eq!(c.pages(rx), vec![6, 7, 8, 11]);
    c.abort(rx);
    c.finish(r1);
    assert_eq!(c.counts(), (8, 8, 0));
}

at_page_sizes!(a_page_computed_twice_is_stored_once, computed_twice, [1, 4]);

fn fork(p: usize) {
    let mut c = radix(32, p);
    let a = u(p, &[1, 2, 3, 4, 5, 6]);
    let r = c.admit(&a);
    c.commit(r, 3 * p);
    let f1 = c.fork(r);
    assert_eq!(c.cached(f1), 3 * p);
    assert_eq!(c.pages(f1), vec![0, 1, 2, 6, 7, 8]);
    let v = c.c.request(f1).unwrap();
    assert_eq!((v.tokens, v.num_computed), (&a[..], 3 * p));
    c.commit(r, 6 * p);
    let f2 = c.fork(r);
    assert_eq!(c.cached(f2), 5 * p);
    assert_eq!(c.pages(f2), vec![0, 1, 2, 3, 4, 9]);
    // A fork is an admission of the same tokens now: f1 computed only 3 pages, but r published 6.
    let f3 = c.fork(f1);
    assert_eq!(c.cached(f3), 5 * p);
    assert_eq!(c.pages(f3), vec![0, 1, 2, 3, 4, 10]);
    let s = c.stats();
    assert_eq!(
        (s.queries, s.query_tokens, s.hit_tokens),
        (4, 24 * p as u64, 13 * p as u64)
    );
    c.extend(r, &u(p, &[7]));
    assert_eq!(c.pages(r), vec![0, 1, 2, 3, 4, 5, 11]);
    c.commit(r, 7 * p);
    let f4 = c.fork(r);
    assert_eq!(c.cached(f4), 6 * p);
    assert_eq!(c.pages(f4), vec![0, 1, 2, 3, 4, 5, 12]);
    // Forks with namespaces keep their namespace.
    let rn = c.admit_in(&a, &ns("t"));
    c.commit(rn, 6 * p);
    let fnn = c.fork(rn);
    assert_eq!(c.c.request(fnn).unwrap().namespace, &ns("t"));
    assert_eq!(c.cached(fnn), 5 * p);
    assert_eq!(c.pages(fnn)[..5], c.pages(rn)[..5]);
    for id in [r, f1, f2, f3, f4, rn, fnn] {
        c.finish(id);
    }
    // Stored: r's 7 pages and rn's 6; every fork's private copy was a duplicate or unpublished.
    assert_eq!(c.counts(), (19, 13, 0));
}

at_page_sizes!(fork_shares_pages, fork, [1, 4]);

#[test]
fn fork_shares_only_full_computed_pages_p4() {
    let mut c = radix(16, 4);
    let a = range(0, 10);
    let r = c.admit(&a);
    c.commit(r, 6);
    let f = c.fork(r);
    assert_eq!(c.cached(f), 4);
    assert_eq!(c.pages(f), vec![0, 3, 4]);
    c.commit(r, 10);
    let g = c.fork(r);
    assert_eq!(c.cached(g), 8);
    assert_eq!(c.pages(g), vec![0, 1, 5]);
}

fn out_of_pages(p: usize) {
    let mut c = radix(8, p);
    let a = u(p, &[1, 2, 3, 4, 5, 6]);
    let a99 = cat(&a, &u(p, &[99]));
    let ra = c.admit(&a);
    c.commit(ra, 6 * p);
    c.finish(ra);
    assert_eq!(c.counts(), (2, 6, 0));
    let s0 = c.stats();
    // The 6 pages the match would pin do not count as available: 2 + 6 - 6.
    assert_eq!(
        c.try_admit(&cat(&a, &u(p, &[7, 8, 9]))),
        Err(Error::OutOfPages {
            needed: 3,
            available: 2
        })
    );
    assert_eq!(c.stats(), s0);
    assert_eq!(
        c.try_admit(&u(p, &[20, 21, 22, 23, 24, 25, 26, 27, 28])),
        Err(Error::OutOfPages {
            needed: 9,
            available: 8
        })
    );
    assert_eq!(c.stats(), s0);
    assert_eq!(c.matched(&a99), 6 * p);
    // 3 pinned by the match: 2 + 6 - 3 = 5 available, 4 needed; evicts a's 5 and 4.
    let rb = c.admit(&u(p, &[1, 2, 3, 7, 8, 9, 10]));
    assert_eq!(c.cached(rb), 3 * p);
    assert_eq!(c.pages(rb), vec![0, 1, 2, 4, 5, 6, 7]);
    assert_eq!(c.stats().evicted_pages, 2);
    assert_eq!(c.matched(&a99), 4 * p);
    assert_eq!(c.counts(), (0, 1, 7));
    c.extend_short(rb, &u(p, &[11, 12]), 2, 1);
    assert_eq!(c.matched(&a99), 4 * p);
    c.extend(rb, &u(p, &[11]));
    assert_eq!(c.pages(rb), vec![0, 1, 2, 4, 5, 6, 7, 3]);
    assert_eq!(c.stats().evicted_pages, 3);
    assert_eq!(c.matched(&a99), 3 * p);
    let s2 = c.stats();
    assert_eq!(
        c.try_admit(&u(p, &[30])),
        Err(Error::OutOfPages {
            needed: 1,
            available: 0
        })
    );
    // A fork is an admission too: rb's 3 cached pages are pinned already, 5 more are needed.
    assert_eq!(
        c.try_fork(rb),
        Err(Error::OutOfPages {
            needed: 5,
            available: 0
        })
    );
    assert_eq!(c.stats(), s2);
    assert_eq!(c.pages(rb), vec![0, 1, 2, 4, 5, 6, 7, 3]);
    c.abort(rb);
    assert_eq!(c.counts(), (5, 3, 0));
}

at_page_sizes!(out_of_pages_changes_nothing, out_of_pages, [1, 4]);

fn evict_and_reset_counts(p: usize) {
    let mut c = radix(16, p);
    let a = u(p, &[1, 2, 3, 4, 5]);
    let b = u(p, &[6, 7, 8]);
    for t in [&a, &b] {
        let r = c.admit(t);
        c.commit(r, t.len());
        c.finish(r);
    }
    assert_eq!(c.counts(), (8, 8, 0));
    assert_eq!(c.evict(0), 0);
    assert_eq!(c.evict(3), 3); // a is older: its pages 4, 3, 2
    assert_eq!(c.stats().evicted_pages, 3);
    assert_eq!(c.matched(&cat(&a, &u(p, &[9]))), 2 * p);
    assert_eq!(c.matched(&cat(&b, &u(p, &[9]))), 3 * p);
    assert_eq!(c.reset(), 5);
    assert_eq!(c.stats().evicted_pages, 8);
    assert_eq!(c.counts(), (16, 0, 0));
    assert_eq!(c.reset(), 0);
    assert_eq!(c.evict(4), 0);
    assert_eq!(c.stats().evicted_pages, 8);
    assert_eq!(c.matched(&cat(&b, &u(p, &[9]))), 0);
    // evict asks for more than there is: returns what it did.
    let r = c.admit(&b);
    c.commit(r, 3 * p);
    c.finish(r);
    assert_eq!(c.evict(100), 3);
    assert_eq!(c.stats().evicted_pages, 11);
}

at_page_sizes!(evict_and_reset_counts, evict_and_reset_counts, [1, 4]);

/// The agent loop of the design: a 128-token system prompt, a 144-token first turn, a 32-token
/// tool result, a 25-token decoded tail, two forked sub-agents.
fn agent_scenario(p: usize) {
    let pages = |a: usize, b: usize| -> Vec<u32> { (a as u32..b as u32).collect() };
    let mut c = radix(1024, p);
    let sys = range(10_000, 10_128);
    let turn1 = range(20_000, 20_144);
    let prompt1 = cat(&sys, &turn1);
    assert_eq!(prompt1.len(), 272);
    let r1 = c.admit(&prompt1);
    assert_eq!(c.cached(r1), 0);
    assert_eq!(c.pages(r1), pages(0, 272 / p));
    c.commit(r1, 272);
    c.finish(r1);
    assert_eq!(c.counts(), (1024 - 272 / p, 272 / p, 0));

    let prompt2 = cat(&prompt1, &range(30_000, 30_032));
    assert_eq!(prompt2.len(), 304);
    let r2 = c.admit(&prompt2);
    assert_eq!(c.cached(r2), 272);
    assert_eq!(c.pages(r2), pages(0, 304 / p));
    let s = c.stats();
    assert_eq!((s.query_tokens, s.hit_tokens), (576, 272));
    c.commit(r2, 304);
    // Decode a 25-token tail, one token a step.
    for i in 0..25 {
        c.extend(r2, &[40_000 + i]);
        c.commit(r2, 305 + i as usize);
    }
    let n: usize = 329;
    assert_eq!(c.pages(r2), pages(0, n.div_ceil(p)));
    let published = n / p * p;
    assert_eq!(
        c.matched(&cat(c.c.request(r2).unwrap().tokens, &[1])),
        published
    );

    // Two sub-agents forked from the live context share the same pages.
    let cached = (n - 1) / p * p;
    let f1 = c.fork(r2);
    let f2 = c.fork(r2);
    let np = n.div_ceil(p);
    assert_eq!((c.cached(f1), c.cached(f2)), (cached, cached));
    let mut shared = c.pages(r2);
    shared.truncate(cached / p);
    assert_eq!(c.pages(f1)[..cached / p], shared[..]);
    assert_eq!(c.pages(f2)[..cached / p], shared[..]);
    // Their own pages beyond the shared prefix are new ones.
    assert_eq!(
        c.pages(f1)[cached / p..],
        pages(np, np + np - cached / p)[..]
    );
    assert_eq!(
        c.pages(f2)[cached / p..],
        pages(2 * np - cached / p, 3 * np - 2 * cached / p)[..]
    );
    c.extend(f1, &range(50_000, 50_040));
    c.extend(f2, &range(60_000, 60_040));
    c.commit(f1, n + 40);
    c.commit(f2, n + 40);
    let t1 = c.c.request(f1).unwrap().tokens.to_vec();
    let t2 = c.c.request(f2).unwrap().tokens.to_vec();
    c.finish(f1);
    c.finish(f2);
    c.finish(r2);
    assert_eq!(c.matched(&cat(&t1, &[1])), (n + 40) / p * p);
    assert_eq!(c.matched(&cat(&t2, &[1])), (n + 40) / p * p);
    assert_eq!(c.matched(&cat(&prompt2, &[7, 7, 7, 7])), 304);
    assert_eq!(c.counts().2, 0);
    // The main agent's next turn reuses its whole computed context.
    let mut prompt3 = t1[..n].to_vec();
    prompt3.extend(range(70_000, 70_016));
    let r3 = c.admit(&prompt3);
    assert_eq!(c.cached(r3), published);
}

at_page_sizes!(agent_scenario, agent_scenario, [1, 4]);

/// Sub-agents in a pool that holds the shared context and three 16-token branches: each new
/// sub-agent evicts the least recently used branch and reuses its page ids; the trunk stays.
fn agent_small_pool(p: usize) {
    let trunk = cat(&range(10_000, 10_128), &range(20_000, 20_176));
    assert_eq!(trunk.len(), 304);
    let (tp, bp) = (304 / p, 16 / p);
    let mut c = radix(tp + 3 * bp, p);
    let r = c.admit(&trunk);
    c.commit(r, 304);
    c.finish(r);
    let task = |k: u32| cat(&trunk, &range(30_000 + 100 * k, 30_016 + 100 * k));
    let branch =
        |k: usize| -> Vec<u32> { ((tp + k * bp) as u32..(tp + (k + 1) * bp) as u32).collect() };
    for k in 0..6u32 {
        let s = c.admit(&task(k));
        assert_eq!(c.cached(s), 304);
        let own = c.pages(s)[tp..].to_vec();
        assert_eq!(own, branch(k as usize % 3), "sub-agent {k}");
        c.commit(s, 320);
        c.finish(s);
        assert_eq!(
            c.stats().evicted_pages,
            (k.saturating_sub(2) as usize * bp) as u64
        );
    }
    for k in 0..6u32 {
        let want = if k < 3 { 304 } else { 320 };
        assert_eq!(c.matched(&cat(&task(k), &[1])), want, "sub-agent {k}");
    }
    assert_eq!(c.matched(&cat(&trunk, &[5, 5])), 304);
    assert_eq!(c.counts(), (0, tp + 3 * bp, 0));
}

at_page_sizes!(
    agent_small_pool_evicts_branches_not_the_trunk,
    agent_small_pool,
    [1, 4]
);
