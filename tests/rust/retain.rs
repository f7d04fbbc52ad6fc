//! Eviction classes and retentions (docs/SEMANTICS.md, "Retention"), with exact eviction
//! orders. `check()` runs after every operation, which recomputes the retention counts.

use radixkv::{BlockCache, Error, PrefixCache, RadixCache, CLASSES};

#[macro_use]
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

/// Computes `t` whole and finishes it with `class` and `retain`; returns the retention id.
fn serve<C: PrefixCache>(c: &mut Ck<C>, t: &[u32], class: u8, retain: f64) -> u64 {
    let id = c.admit(t);
    c.commit(id, t.len());
    let rid = c.c.finish_retained(id, class, retain).unwrap();
    c.check();
    rid
}

/// Whether the whole of `t` but its last page is cached (what an admission of it would find).
fn kept<C: PrefixCache>(c: &Ck<C>, t: &[u32], p: usize) -> bool {
    c.matched(t) == t.len() - p
}

fn classes_evict_lowest_first(p: usize) {
    classes_evict_lowest_first_in(radix(12, p), p);
    classes_evict_lowest_first_in(block(12, p), p);
}

fn classes_evict_lowest_first_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let (a, b, d) = (u(p, &[1, 2, 3]), u(p, &[4, 5, 6]), u(p, &[7, 8, 9]));
    serve(&mut c, &a, 2, 0.0); // oldest, but of the highest class
    serve(&mut c, &b, 0, 0.0);
    serve(&mut c, &d, 1, 0.0);
    assert_eq!(c.evict(3), 3);
    c.check();
    assert!(!kept(&c, &b, p) && kept(&c, &a, p) && kept(&c, &d, p));
    assert_eq!(c.evict(3), 3);
    assert!(!kept(&c, &d, p) && kept(&c, &a, p));
    assert_eq!(c.stats().forced_evictions, 0, "nothing was retained");
}
at_page_sizes!(
    classes_evict_lowest_first,
    classes_evict_lowest_first,
    [1, 4]
);

/// A class only rises: a later, lower finish through the same pages does not lower it.
fn a_class_only_rises(p: usize) {
    a_class_only_rises_in(radix(12, p), p);
    a_class_only_rises_in(block(12, p), p);
}

fn a_class_only_rises_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let trunk = u(p, &[1, 2, 3]);
    serve(&mut c, &trunk, 3, 0.0);
    serve(&mut c, &cat(&trunk, &u(p, &[4])), 0, 0.0); // a branch of the lowest class
    serve(&mut c, &u(p, &[5, 6, 7]), 1, 0.0);
    // The branch's own page goes first, then class 1, and the trunk last.
    assert_eq!(c.matched(&cat(&trunk, &u(p, &[4, 9]))), 4 * p);
    assert_eq!(c.evict(1), 1);
    assert_eq!(c.matched(&cat(&trunk, &u(p, &[4, 9]))), 3 * p);
    assert!(kept(&c, &u(p, &[5, 6, 7]), p));
    assert_eq!(c.evict(3), 3);
    assert!(!kept(&c, &u(p, &[5, 6, 7]), p) && kept(&c, &trunk, p));
}
at_page_sizes!(a_class_only_rises, a_class_only_rises, [1, 4]);

fn retained_pages_go_last_and_are_counted(p: usize) {
    retained_pages_go_last_and_are_counted_in(radix(12, p), p);
    retained_pages_go_last_and_are_counted_in(block(12, p), p);
}

fn retained_pages_go_last_and_are_counted_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let (a, b) = (u(p, &[1, 2, 3]), u(p, &[4, 5, 6]));
    let rid = serve(&mut c, &a, 0, 10.0);
    assert_eq!(rid, 1);
    serve(&mut c, &b, 3, 0.0); // the highest class still goes before a retained page
    assert_eq!(c.stats().retentions, 1);
    assert_eq!(c.evict(3), 3);
    c.check();
    assert!(kept(&c, &a, p) && !kept(&c, &b, p));
    assert_eq!(c.stats().forced_evictions, 0);
    assert_eq!(c.evict(2), 2); // nothing else left: forced, leaf pages first
    c.check();
    assert_eq!(c.stats().forced_evictions, 2);
    assert_eq!(
        c.matched(&a),
        p,
        "the retained trunk goes page by page from its tail"
    );
    assert_eq!(c.evict(1), 1);
    c.check();
    let s = c.stats();
    assert_eq!(
        (s.forced_evictions, s.retentions),
        (3, 0),
        "its node went: the retention too"
    );
    assert!(!c.c.release_retention(rid));
}
at_page_sizes!(
    retained_pages_go_last_and_are_counted,
    retained_pages_go_last_and_are_counted,
    [1, 4]
);

/// Retention never makes an admission fail: a full pool of retained pages still serves a
/// request that needs all of it.
fn retention_never_blocks_an_admission(p: usize) {
    retention_never_blocks_an_admission_in(radix(4, p), p);
    retention_never_blocks_an_admission_in(block(4, p), p);
}

fn retention_never_blocks_an_admission_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    serve(&mut c, &u(p, &[1, 2, 3]), 0, f64::INFINITY);
    let id = c.admit(&u(p, &[5, 6, 7, 8]));
    assert_eq!(c.cached(id), 0);
    let s = c.stats();
    assert_eq!((s.forced_evictions, s.retentions, s.used_pages), (3, 0, 4));
    c.abort(id);
    c.check();
}
at_page_sizes!(
    retention_never_blocks_an_admission,
    retention_never_blocks_an_admission,
    [1, 4]
);

fn retentions_expire_by_the_caches_clock(p: usize) {
    retentions_expire_by_the_caches_clock_in(radix(12, p), p);
    retentions_expire_by_the_caches_clock_in(block(12, p), p);
}

fn retentions_expire_by_the_caches_clock_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let (a, b) = (u(p, &[1, 2, 3]), u(p, &[4, 5, 6]));
    c.c.set_time(100.0).unwrap();
    serve(&mut c, &a, 0, 10.0); // until 110
    serve(&mut c, &b, 0, 0.0);
    assert_eq!(c.c.set_time(109.5).unwrap(), 0);
    assert_eq!(c.c.set_time(110.0).unwrap(), 1);
    c.check();
    let s = c.stats();
    assert_eq!((s.retentions, s.expired_retentions), (0, 1));
    // Plain LRU again: the older one goes first.
    assert_eq!(c.evict(3), 3);
    assert!(!kept(&c, &a, p) && kept(&c, &b, p));
    assert_eq!(c.stats().forced_evictions, 0);
    assert_eq!(c.c.now(), 110.0);
    let err = c.c.set_time(50.0).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("50"), "{err}");
    assert!(c.c.set_time(f64::NAN).is_err());
    assert_eq!(c.c.now(), 110.0, "a refused time changes nothing");
}
at_page_sizes!(
    retentions_expire_by_the_caches_clock,
    retentions_expire_by_the_caches_clock,
    [1, 4]
);

fn released_retentions_are_plain_lru_again(p: usize) {
    released_retentions_are_plain_lru_again_in(radix(12, p), p);
    released_retentions_are_plain_lru_again_in(block(12, p), p);
}

fn released_retentions_are_plain_lru_again_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let (a, b) = (u(p, &[1, 2, 3]), u(p, &[4, 5, 6]));
    let rid = serve(&mut c, &a, 0, f64::INFINITY);
    serve(&mut c, &b, 0, 0.0);
    assert!(c.c.release_retention(rid));
    assert!(!c.c.release_retention(rid), "released once");
    c.check();
    assert_eq!(c.evict(3), 3);
    assert!(!kept(&c, &a, p) && kept(&c, &b, p));
}
at_page_sizes!(
    released_retentions_are_plain_lru_again,
    released_retentions_are_plain_lru_again,
    [1, 4]
);

/// Two sessions share a trunk: a split keeps each retention exact, and releasing one leaves
/// the other's path retained.
fn shared_trunks_split_and_stay_exact(p: usize) {
    shared_trunks_split_and_stay_exact_in(radix(16, p), p);
    shared_trunks_split_and_stay_exact_in(block(16, p), p);
}

fn shared_trunks_split_and_stay_exact_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let one = u(p, &[1, 2, 3, 4]);
    let two = u(p, &[1, 2, 7, 8]); // splits `one`'s edge after two pages
    let r1 = serve(&mut c, &one, 0, f64::INFINITY);
    let r2 = serve(&mut c, &two, 0, f64::INFINITY);
    serve(&mut c, &u(p, &[9, 10, 11]), 0, 0.0);
    assert!(c.c.release_retention(r1));
    c.check();
    // `one`'s own tail is plain LRU again, and older than the unretained prompt.
    assert_eq!(c.evict(2), 2);
    c.check();
    assert_eq!(c.matched(&one), 2 * p);
    assert!(kept(&c, &two, p) && kept(&c, &u(p, &[9, 10, 11]), p));
    assert_eq!(c.stats().forced_evictions, 0);
    assert!(c.c.release_retention(r2));
    c.check();
}
at_page_sizes!(
    shared_trunks_split_and_stay_exact,
    shared_trunks_split_and_stay_exact,
    [1, 4]
);

/// A later turn of the session extends the retained path and takes over with its own.
fn a_later_turn_takes_over(p: usize) {
    a_later_turn_takes_over_in(radix(16, p), p);
    a_later_turn_takes_over_in(block(16, p), p);
}

fn a_later_turn_takes_over_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let turn1 = u(p, &[1, 2, 3]);
    let turn2 = cat(&turn1, &u(p, &[4, 5]));
    c.c.set_time(0.0).unwrap();
    serve(&mut c, &turn1, 0, 5.0);
    serve(&mut c, &turn2, 0, 50.0);
    assert_eq!(
        c.c.set_time(10.0).unwrap(),
        1,
        "the first turn's retention expired"
    );
    serve(&mut c, &u(p, &[8, 9, 10]), 0, 0.0);
    assert_eq!(c.evict(3), 3);
    assert!(
        kept(&c, &turn2, p),
        "the second turn's retention still holds the whole path"
    );
    c.check();
}
at_page_sizes!(a_later_turn_takes_over, a_later_turn_takes_over, [1, 4]);

#[test]
fn bad_classes_and_durations_are_refused_and_change_nothing() {
    let mut c = radix(8, 1);
    let id = c.admit(&[1, 2, 3]);
    c.commit(id, 3);
    for (class, retain) in [(CLASSES, 0.0), (0, -1.0), (0, f64::NAN)] {
        let err = c.c.finish_retained(id, class, retain).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(
            c.c.request(id).is_ok(),
            "a refused finish leaves the request open"
        );
    }
    assert_eq!(c.c.finish_retained(id, CLASSES - 1, 0.0).unwrap(), 0);
    c.check();
    b_check_errors();
}

fn b_check_errors() {
    let mut b = block(8, 1);
    let id = b.admit(&[1, 2, 3]);
    b.commit(id, 3);
    let err = b.c.finish_retained(id, CLASSES, 0.0).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(b.c.finish_retained(id, 1, 5.0).unwrap() > 0);
    b.check();
}

#[test]
fn the_digest_covers_classes_and_retentions() {
    let digest = |class: u8, retain: f64, radix_index: bool| {
        if radix_index {
            let mut c = radix(8, 1);
            serve(&mut c, &[1, 2, 3], class, retain);
            c.c.state_digest()
        } else {
            let mut c = block(8, 1);
            serve(&mut c, &[1, 2, 3], class, retain);
            c.c.state_digest()
        }
    };
    for r in [true, false] {
        let plain = digest(0, 0.0, r);
        assert_eq!(plain, digest(0, 0.0, r));
        assert_ne!(plain, digest(1, 0.0, r));
        assert_ne!(plain, digest(0, 5.0, r));
        assert_ne!(digest(0, 5.0, r), digest(0, 6.0, r));
    }
}

/// `retain_prefix`: a breakpoint inside a cached prompt retains exactly its whole pages, as a
/// finish would, with no admission: the counters, the page states and what is evicted before
/// the retained prefix do not change; the retention expires by the clock like any other.
fn a_prefix_is_retained_without_an_admission(p: usize) {
    a_prefix_is_retained_without_an_admission_in(radix(12, p), p);
    a_prefix_is_retained_without_an_admission_in(block(12, p), p);
}

fn a_prefix_is_retained_without_an_admission_in<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let a = u(p, &[1, 2, 3, 4, 5, 6]);
    let b = u(p, &[7, 8, 9]);
    serve(&mut c, &a, 0, 0.0);
    serve(&mut c, &b, 0, 0.0);
    let before = c.stats();
    // a breakpoint half a page past the third page: the three whole pages are held
    let cut = 3 * p + p / 2;
    assert_eq!(
        c.c.retain_prefix(&a[..cut], &None, 0, 10.0).unwrap(),
        (1, 3 * p)
    );
    c.check();
    let after = c.stats();
    assert_eq!(after.retentions, 1);
    assert_eq!(
        (after.queries, after.query_tokens, after.hit_tokens),
        (before.queries, before.query_tokens, before.hit_tokens),
        "a retention is no admission"
    );
    assert_eq!(
        (after.free_pages, after.evictable_pages, after.used_pages),
        (before.free_pages, before.evictable_pages, before.used_pages)
    );
    // nothing cached, or nothing asked for: no retention, nothing changed
    assert_eq!(
        c.c.retain_prefix(&u(p, &[40, 41]), &None, 0, 10.0).unwrap(),
        (0, 0)
    );
    assert_eq!(c.c.retain_prefix(&a, &None, 0, 0.0).unwrap(), (0, 0));
    assert_eq!(
        c.c.retain_prefix(&a, &Some(b"other".to_vec().into_boxed_slice()), 0, 10.0)
            .unwrap(),
        (0, 0)
    );
    assert_eq!(c.stats(), after);
    // everything else goes first, the older rest of `a` included; nothing was forced
    assert_eq!(c.evict(6), 6);
    assert_eq!(c.matched(&a), 3 * p, "exactly the retained prefix is left");
    assert_eq!(c.matched(&b), 0);
    assert_eq!(c.stats().forced_evictions, 0);
    assert_eq!(c.c.set_time(10.0).unwrap(), 1, "expired by the clock");
    c.check();
    assert_eq!(c.stats().retentions, 0);
    for (class, retain) in [(CLASSES, 1.0), (0, -1.0), (0, f64::NAN)] {
        let err = c.c.retain_prefix(&a, &None, class, retain).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    }
    assert!(c.c.retain_prefix(&[], &None, 0, 1.0).is_err(), "no tokens");
    c.check();
}
at_page_sizes!(
    a_prefix_is_retained_without_an_admission,
    a_prefix_is_retained_without_an_admission,
    [1, 4]
);
