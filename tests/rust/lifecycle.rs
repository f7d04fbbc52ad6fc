//! The request life cycle, which both indexes share (`Cache<I>` in the core): written once here,
//! run on every cache. Index-specific orders (eviction, splits, hash chains) are in `radix.rs`
//! and `block.rs`. `check()` runs after every operation (the `Ck` wrapper does it).

use radixkv::{BlockCache, Error, PrefixCache, RadixCache};

mod common;
use common::*;

fn radix(num_pages: usize, p: usize) -> Ck<RadixCache> {
    Ck {
        c: RadixCache::new(num_pages, p).unwrap(),
    }
}

fn block(num_pages: usize, p: usize) -> Ck<BlockCache> {
    Ck {
        c: BlockCache::new(num_pages, p).unwrap(),
    }
}

/// A test that runs `$body(make, p)` on the radix cache at page sizes 1 and 4 and on the block
/// cache at 4 and 16; `make(n)` builds an empty cache of `n` pages.
macro_rules! on_every_cache {
    ($name:ident, $body:ident) => {
        #[test]
        fn $name() {
            for p in [1, 4] {
                $body(|n| radix(n, p), p);
            }
            for p in [4, 16] {
                $body(|n| block(n, p), p);
            }
        }
    };
}

// ------------------------------------------------------------------------------------------------

/// A fresh pool hands out its pages in id order; the view reports what was admitted.
fn fresh_admit<C: PrefixCache>(make: impl Fn(usize) -> Ck<C>, p: usize) {
    let mut c = make(16);
    let a = u(p, &[1, 2, 3, 4, 5]);
    let r = c.admit(&a);
    assert_eq!(c.pages(r), vec![0, 1, 2, 3, 4]);
    let v = c.c.request(r).unwrap();
    assert_eq!(
        (v.num_cached, v.num_computed, v.num_tokens()),
        (0, 0, 5 * p)
    );
    assert_eq!((v.tokens, v.namespace, v.page_size), (&a[..], &None, p));
    // Slot of token i: pages[i / P] * P + i % P; pages are 0..5 here, so slot i == i.
    for i in 0..5 * p {
        assert_eq!(v.slot(i), i as i64);
    }
    assert_eq!(c.counts(), (11, 0, 5));
    let s = c.stats();
    assert_eq!((s.num_pages, s.page_size), (16, p));
    assert_eq!(
        (s.queries, s.query_tokens, s.hit_tokens, s.evicted_pages),
        (1, 5 * p as u64, 0, 0)
    );
    assert_eq!(s.hit_rate(), 0.0);
    // Nothing is published before a commit.
    assert_eq!(c.matched(&cat(&a, &u(p, &[9]))), 0);
    let rb = c.admit(&u(p, &[6, 7, 8]));
    assert_eq!(c.pages(rb), vec![5, 6, 7]);
    // A prompt that does not fill its last page still takes a whole page for it.
    let odd = range(5000, 5000 + 2 * p as u32 + 1);
    let ro = c.admit(&odd);
    assert_eq!(c.pages(ro), vec![8, 9, 10]);
    let v = c.c.request(ro).unwrap();
    assert_eq!((v.slot(p), v.slot(2 * p)), (9 * p as i64, 10 * p as i64));
    assert_eq!(c.counts(), (5, 0, 11));
    // Aborting publishes nothing: everything goes back to the free pool.
    for id in [r, rb, ro] {
        c.abort(id);
    }
    assert_eq!(c.counts(), (16, 0, 0));
    assert_eq!(c.matched(&cat(&a, &u(p, &[9]))), 0);
}
on_every_cache!(fresh_admit_takes_pages_in_order, fresh_admit);

/// Bad arguments, closed and foreign requests: an error, and nothing changed.
fn errors_change_nothing<C: PrefixCache>(make: impl Fn(usize) -> Ck<C>, p: usize) {
    let mut c = make(8);
    assert!(matches!(c.try_admit(&[]), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        c.c.match_prefix(&[], &None),
        Err(Error::InvalidArgument(_))
    ));
    let a = u(p, &[1, 2]);
    let r = c.admit(&cat(&a, &[7]));
    c.commit(r, 2 * p);
    let s = c.stats();
    let n = 2 * p + 1;
    assert!(matches!(
        c.try_commit(r, n + 1),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        c.try_commit(r, 2 * p - 1),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(c.stats(), s);
    assert_eq!(c.c.request(r).unwrap().num_computed, 2 * p);
    c.commit(r, 2 * p); // the same value again is fine
    c.finish(r);
    let s = c.stats();
    assert_eq!(c.try_commit(r, n), Err(Error::ClosedRequest));
    assert_eq!(c.try_extend(r, &[4]), Err(Error::ClosedRequest));
    assert_eq!(c.try_fork(r), Err(Error::ClosedRequest));
    assert_eq!(c.c.finish(r), Err(Error::ClosedRequest));
    assert_eq!(c.c.abort(r), Err(Error::ClosedRequest));
    assert!(matches!(c.c.request(r), Err(Error::ClosedRequest)));
    c.check();
    assert_eq!(c.stats(), s);
    // A new request may reuse the slot; the old handle stays dead.
    let r2 = c.admit(&cat(&a, &[5]));
    assert_eq!(c.cached(r2), 2 * p);
    assert_eq!(c.c.finish(r), Err(Error::ClosedRequest));
    assert_eq!(c.cached(r2), 2 * p);
    // A request of another cache.
    let mut other = make(8);
    let o = other.admit(&a);
    let s = c.stats();
    assert_eq!(c.try_commit(o, 1), Err(Error::ForeignRequest));
    assert_eq!(c.try_extend(o, &[1]), Err(Error::ForeignRequest));
    assert_eq!(c.try_fork(o), Err(Error::ForeignRequest));
    assert_eq!(c.c.finish(o), Err(Error::ForeignRequest));
    assert_eq!(c.c.abort(o), Err(Error::ForeignRequest));
    assert!(matches!(c.c.request(o), Err(Error::ForeignRequest)));
    c.check();
    assert_eq!(c.stats(), s);
    assert_eq!(other.pages(o), vec![0, 1]);
    other.finish(o);
}
on_every_cache!(errors_change_nothing_on_any_cache, errors_change_nothing);

#[test]
fn bad_pool_arguments_are_refused() {
    for (n, p) in [(0, 1), (1, 0), (4, 1 << 17)] {
        assert!(matches!(
            RadixCache::new(n, p),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            BlockCache::new(n, p),
            Err(Error::InvalidArgument(_))
        ));
    }
}

/// `extend_many` extends in order and stops before the first request the pool cannot supply.
fn extend_many<C: PrefixCache>(make: impl Fn(usize) -> Ck<C>, p: usize) {
    let mut c = make(8);
    let (r1, r2, r3) = (
        c.admit(&u(p, &[1])),
        c.admit(&u(p, &[2])),
        c.admit(&u(p, &[3])),
    );
    // 5 pages free: r1 takes 3 of them, r2 needs 3 more and stops the call; r3 is not reached.
    let (t1, t2, t3) = (u(p, &[4, 5, 6]), u(p, &[7, 8, 9]), u(p, &[10]));
    let done = c.c.extend_many(&[(r1, &t1), (r2, &t2), (r3, &t3)]).unwrap();
    c.check();
    assert_eq!(done, 1);
    assert_eq!(c.pages(r1), vec![0, 3, 4, 5]);
    assert_eq!((c.pages(r2), c.pages(r3)), (vec![1], vec![2]));
    assert_eq!(c.counts(), (2, 0, 6));
    // Everything fits: the whole batch.
    let (t2, t3) = (u(p, &[7]), u(p, &[10]));
    assert_eq!(c.c.extend_many(&[(r2, &t2), (r3, &t3)]).unwrap(), 2);
    assert_eq!((c.pages(r2), c.pages(r3)), (vec![1, 6], vec![2, 7]));
    assert_eq!(c.c.extend_many(&[]).unwrap(), 0);
    // A repeated, closed or foreign request is refused before anything changes.
    let s = c.stats();
    let one = [0u32];
    let repeated = c.c.extend_many(&[(r1, &one), (r1, &one)]);
    assert!(
        matches!(repeated, Err(Error::InvalidArgument(_))),
        "{repeated:?}"
    );
    c.finish(r3);
    let s_closed = c.stats();
    assert_eq!(
        c.c.extend_many(&[(r1, &one), (r3, &one)]),
        Err(Error::ClosedRequest)
    );
    let mut other = make(4);
    let o = other.admit(&[1]);
    assert_eq!(
        c.c.extend_many(&[(r1, &one), (o, &one)]),
        Err(Error::ForeignRequest)
    );
    c.check();
    assert_eq!(c.stats(), s_closed);
    assert_eq!(s.used_pages, s_closed.used_pages + 2);
    assert_eq!(c.c.request(r1).unwrap().num_tokens(), 4 * p);
}
on_every_cache!(extend_many_stops_at_the_first_short_request, extend_many);

/// `commit_many` checks every pair first: all or nothing.
fn commit_many<C: PrefixCache>(make: impl Fn(usize) -> Ck<C>, p: usize) {
    let mut c = make(16);
    let (a, b) = (u(p, &[1, 2, 3]), u(p, &[4, 5]));
    let (ra, rb) = (c.admit(&a), c.admit(&b));
    let s = c.stats();
    for bad in [
        vec![(ra, 2 * p), (rb, 2 * p + 1)], // past the end of rb
        vec![(ra, 2 * p), (ra, 3 * p)],     // ra twice
    ] {
        assert!(matches!(
            c.c.commit_many(&bad),
            Err(Error::InvalidArgument(_))
        ));
        c.check();
        assert_eq!(c.stats(), s);
        assert_eq!(c.c.request(ra).unwrap().num_computed, 0);
    }
    c.c.commit_many(&[(ra, 2 * p), (rb, 2 * p)]).unwrap();
    c.check();
    assert_eq!(c.c.request(ra).unwrap().num_computed, 2 * p);
    assert_eq!(c.c.request(rb).unwrap().num_computed, 2 * p);
    // Both published their computed full pages.
    assert_eq!(c.matched(&cat(&a, &[9])), 2 * p);
    assert_eq!(c.matched(&cat(&b, &[9])), 2 * p);
    // Going back is refused for the whole batch.
    assert!(matches!(
        c.c.commit_many(&[(rb, 2 * p), (ra, p)]),
        Err(Error::InvalidArgument(_))
    ));
    c.finish(rb);
    assert_eq!(
        c.c.commit_many(&[(ra, 3 * p), (rb, 2 * p)]),
        Err(Error::ClosedRequest)
    );
    assert_eq!(c.c.request(ra).unwrap().num_computed, 2 * p);
    c.finish(ra);
}
on_every_cache!(commit_many_is_all_or_nothing, commit_many);

/// Namespaces never share pages, whatever their tokens; `None` and `""` are different ones.
fn namespaces<C: PrefixCache>(make: impl Fn(usize) -> Ck<C>, p: usize) {
    let mut c = make(32);
    let a = u(p, &[1, 2, 3, 4]);
    let a9 = cat(&a, &u(p, &[9]));
    let a98 = cat(&a9, &u(p, &[8]));
    let r = c.admit_in(&a, &None);
    c.commit(r, 4 * p);
    c.finish(r);
    assert_eq!(c.matched_in(&a9, &None), 4 * p);
    assert_eq!(c.matched_in(&a9, &ns("a")), 0);
    // The empty namespace is not the None namespace.
    assert_eq!(c.matched_in(&a9, &ns("")), 0);
    let r2 = c.admit_in(&a9, &ns("a"));
    assert_eq!(c.cached(r2), 0);
    assert_eq!(c.pages(r2), vec![4, 5, 6, 7, 8]);
    assert_eq!(c.c.request(r2).unwrap().namespace, &ns("a"));
    c.commit(r2, 5 * p);
    c.finish(r2);
    assert_eq!(c.counts(), (23, 9, 0));
    assert_eq!(c.matched_in(&a98, &ns("a")), 5 * p);
    assert_eq!(c.matched_in(&a98, &None), 4 * p);
    assert_eq!(c.matched_in(&a98, &ns("b")), 0);
    // Two namespaces computing the same tokens at once: no duplicates, two copies.
    let r3 = c.admit_in(&a9, &ns("b"));
    let r4 = c.admit_in(&a9, &ns(""));
    assert_eq!(c.pages(r3), vec![9, 10, 11, 12, 13]);
    assert_eq!(c.pages(r4), vec![14, 15, 16, 17, 18]);
    assert_eq!(c.cached(r4), 0);
    c.commit(r3, 5 * p);
    c.commit(r4, 5 * p);
    c.finish(r3);
    c.finish(r4);
    assert_eq!(c.matched_in(&a98, &ns("b")), 5 * p);
    assert_eq!(c.matched_in(&a98, &ns("")), 5 * p);
    assert_eq!(c.matched_in(&a98, &None), 4 * p);
    assert_eq!(c.counts(), (13, 19, 0));
}
on_every_cache!(namespaces_never_share, namespaces);
