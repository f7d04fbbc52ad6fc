//! What speculative decoding asks of the core: `truncate` gives back a request's rejected draft
//! tokens (never computed, never published) and their pages, on both indexes; `continuation`
//! reads what the radix tree holds after a sequence, in its own namespace only. `check()` runs
//! after every operation (the `Ck` wrapper does it).

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

/// Drafts past the committed tokens are given back: the pages only they used are free again,
/// the request's tokens end where it says, and nothing past them is ever found cached.
fn truncate_frees_the_draft_pages<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let prompt = u(p, &[1, 2]);
    let r = c.admit(&prompt);
    c.commit(r, 2 * p);
    let free = c.stats().free_pages;
    // The last prompt token's successor and three pages of drafts.
    c.extend(r, &u(p, &[3, 4, 5]));
    assert_eq!(c.stats().free_pages, free - 3);
    // One token of the drafts verified: the KV of 2P + 1 tokens is kept.
    c.commit(r, 2 * p + 1);
    c.c.truncate(r, 2 * p + 1).unwrap();
    c.check();
    let v = c.c.request(r).unwrap();
    assert_eq!(
        (v.num_tokens(), v.num_computed, v.pages.len()),
        (2 * p + 1, 2 * p + 1, 3)
    );
    assert_eq!(c.stats().free_pages, free - 1);
    // The request grows again from there, with other tokens in the freed places.
    c.extend(r, &u(p, &[7, 8])[..2 * p - 1]);
    c.commit(r, 4 * p);
    c.finish(r);
    let mut good = u(p, &[1, 2]);
    good.push(u(p, &[3])[0]); // the verified token
    good.extend_from_slice(&u(p, &[7, 8])[..2 * p - 1]);
    assert_eq!(c.matched(&cat(&good, &[9])), 4 * p);
    let mut drafted = u(p, &[1, 2, 3, 4, 5]);
    drafted.push(9);
    // Only the verified token of the drafted page is shared (a page of its own at P = 1).
    let want = (2 * p + 1) / p * p;
    assert_eq!(c.matched(&drafted), want, "a rejected draft was published");
}

/// Nothing computed may go: `truncate` below `num_computed` or past the tokens is refused and
/// changes nothing.
fn truncate_keeps_what_is_computed<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let r = c.admit(&u(p, &[1, 2]));
    c.commit(r, p + 1);
    for bad in [p, 2 * p + 1] {
        match c.c.truncate(r, bad) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("num_tokens"), "{m}"),
            other => panic!("truncate to {bad}: {other:?}"),
        }
        c.check();
    }
    c.c.truncate(r, p + 1).unwrap();
    c.check();
    c.abort(r);
}

#[test]
fn truncate_on_every_cache() {
    for p in [1, 4] {
        truncate_frees_the_draft_pages(radix(16, p), p);
        truncate_keeps_what_is_computed(radix(16, p), p);
    }
    for p in [4, 16] {
        truncate_frees_the_draft_pages(block(16, p), p);
        truncate_keeps_what_is_computed(block(16, p), p);
    }
}

/// With a window group, the drafts' window pages go back too: truncated before the commit of
/// the verified tokens (as the engine does), at and off page boundaries, on both indexes; the
/// window pool is whole again once the request ends, and only verified tokens are found.
fn truncate_gives_back_window_pages<C: PrefixCache>(mut c: Ck<C>, p: usize) {
    let w = |c: &Ck<C>| c.stats().window_free_pages;
    let prompt = range(0, 2 * p as u32);
    let r = c.admit(&prompt);
    c.commit(r, 2 * p);
    let free = c.stats().free_pages;
    for (kept, drafts) in [(1, 3 * p), (p + 1, p + 2), (p, 2 * p)] {
        // The step's sampled token and its drafts, of which `kept` are verified.
        let at = c.c.request(r).unwrap().num_computed;
        c.extend(r, &range(1000 + at as u32, 1000 + (at + drafts) as u32));
        let (held, drafted) = (w(&c), c.c.request(r).unwrap().pages.len());
        c.c.truncate(r, at + kept).unwrap();
        c.check();
        let pages = (at + kept).div_ceil(p);
        assert_eq!(c.c.request(r).unwrap().pages.len(), pages);
        assert_eq!(c.stats().free_pages, free + 2 - pages);
        assert_eq!(
            w(&c),
            held + drafted - pages,
            "the drafts' window pages came back"
        );
        c.commit(r, at + kept);
        c.extend(r, &[7]); // the token the step sampled after them
    }
    let tokens = c.c.request(r).unwrap().tokens.to_vec();
    let done = tokens.len() - 1;
    c.commit(r, done);
    c.finish(r);
    let total = c.stats().window_free_pages + c.stats().window_evictable_pages;
    assert_eq!(total, 16, "every window page is free or cached");
    let mut other = tokens[..done].to_vec();
    other.push(9999);
    assert_eq!(c.matched(&other), done / p * p);
}

#[test]
fn truncate_with_a_window_group() {
    for p in [1, 4] {
        let c = RadixCache::with_groups(32, p, 0, 0, 2 * p + 1, 16, 0).unwrap();
        truncate_gives_back_window_pages(Ck { c }, p);
    }
    let c = BlockCache::with_groups(32, 4, 0, 0, 9, 16, 0).unwrap();
    truncate_gives_back_window_pages(Ck { c }, 4);
}

/// A commit releases the window pages below what the request's next query reads; a truncate
/// after it, to the committed length at a page boundary, would need one of them again: refused,
/// naming it, and nothing changes. Before the commit the same truncate is taken.
#[test]
fn truncate_after_the_commit_that_released_a_window_page_is_refused() {
    let mut c = RadixCache::with_groups(16, 4, 0, 0, 8, 16, 0).unwrap();
    let r = c.admit(&range(0, 8), None).unwrap();
    c.commit(r, 8).unwrap();
    c.extend(r, &range(8, 14)).unwrap();
    c.commit(r, 12).unwrap();
    match c.truncate(r, 12) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("window page 0"), "{m}"),
        other => panic!("{other:?}"),
    }
    c.check().unwrap();
    assert_eq!(c.request(r).unwrap().num_tokens(), 14);
    let s = c.admit(&range(0, 8), None).unwrap();
    c.extend(s, &range(20, 26)).unwrap();
    c.truncate(s, 12).unwrap();
    c.commit(s, 12).unwrap();
    c.check().unwrap();
}

/// A retried prompt finds the reply an earlier request cached after it, from inside a page or
/// at a page boundary; a sequence the tree does not hold, or another namespace, finds nothing.
#[test]
fn continuation_reads_what_follows_in_the_namespace() {
    for p in [1, 4] {
        let mut c = radix(64, p);
        let earlier = u(p, &[1, 2, 3, 4, 5, 6]);
        let a = c.admit_in(&earlier, &ns("a"));
        c.commit(a, earlier.len());
        c.finish(a);
        let stats = c.stats();
        let at = |n: usize, max: usize| c.c.continuation(&earlier[..n], &ns("a"), max);
        assert_eq!(at(2 * p, 3 * p), earlier[2 * p..5 * p]);
        assert_eq!(at(2 * p + 1, 100), earlier[2 * p + 1..]);
        assert_eq!(at(1, 2), earlier[1..3]);
        assert!(at(6 * p, 4).is_empty(), "nothing is cached past the end");
        assert!(c.c.continuation(&earlier[..p], &ns("b"), 4).is_empty());
        assert!(c.c.continuation(&earlier[..p], &None, 4).is_empty());
        let mut other = earlier[..2 * p].to_vec();
        other.push(9999);
        assert!(c.c.continuation(&other, &ns("a"), 4).is_empty());
        assert_eq!(
            c.stats().queries,
            stats.queries,
            "a continuation is no query"
        );
        // A later reply after the same prompt is the most recently used: it is the draft.
        let later = cat(&earlier[..3 * p], &u(p, &[7, 8]));
        let b = c.admit_in(&later, &ns("a"));
        c.commit(b, later.len());
        c.finish(b);
        assert_eq!(
            c.c.continuation(&earlier[..3 * p], &ns("a"), 2 * p),
            later[3 * p..]
        );
        // Through a split edge and into a child: the earlier path again once it was used last.
        let again = c.admit_in(&earlier, &ns("a"));
        c.commit(again, earlier.len());
        c.finish(again);
        let want = &earlier[2 * p..];
        assert_eq!(c.c.continuation(&earlier[..2 * p], &ns("a"), 4 * p), want);
        c.check();
    }
}

#[test]
fn a_block_cache_has_no_continuation() {
    let mut c = block(16, 4);
    let t = u(4, &[1, 2, 3]);
    run(&mut c.c, &t);
    assert!(c.c.continuation(&t[..4], &None, 8).is_empty());
}
