//! BlockCache unit tests with exact page ids and eviction orders (docs/SEMANTICS.md).
//!
//! The block cache keeps two lists of unpinned pages: FREE (never hashed or evicted, reused
//! first, a released page goes to the front) and EVICTABLE (hashed, least recently released at
//! the front, a request releases its pages last to first). Most tests run at page sizes 4 and 16
//! with tokens built from "units" (one unit = one page of tokens), so page ids are the same at
//! both sizes. `check()` runs after every operation.

use radixkv::{BlockCache, Error, PrefixCache};

#[macro_use]
mod common;
use common::*;

fn block(num_pages: usize, p: usize) -> Ck<BlockCache> {
    let c = Ck {
        c: BlockCache::new(num_pages, p).unwrap(),
    };
    c.check();
    c
}

/// Admits, computes and finishes `t`: its full pages end up in EVICTABLE, last page first.
fn cache_prompt(c: &mut Ck<BlockCache>, t: &[u32]) -> Vec<u32> {
    let r = c.admit(t);
    let pages = c.pages(r);
    c.commit(r, t.len());
    c.finish(r);
    pages
}

// ------------------------------------------------------------------------------------------------

fn commit_and_readmit(p: usize) {
    let mut c = block(8, p);
    let a = u(p, &[1, 2, 3, 4]);
    let a9 = cat(&a, &u(p, &[9]));
    let r = c.admit(&a);
    c.commit(r, 2 * p + 1);
    // Only full pages are published.
    assert_eq!(c.matched(&a9), 2 * p);
    assert_eq!(c.counts(), (4, 0, 4));
    c.commit(r, 4 * p);
    assert_eq!(c.matched(&a), 3 * p);
    assert_eq!(c.matched(&a9), 4 * p);
    assert_eq!(c.matched(&a[..2 * p]), p);
    assert_eq!(c.matched(&a[..2 * p + 1]), 2 * p);
    let r2 = c.admit(&a);
    assert_eq!(c.cached(r2), 3 * p);
    assert_eq!(c.pages(r2), vec![0, 1, 2, 4]);
    let s = c.stats();
    assert_eq!(
        (s.queries, s.query_tokens, s.hit_tokens),
        (2, 8 * p as u64, 3 * p as u64)
    );
    assert_eq!(s.hit_rate(), 3.0 / 8.0);
    // r2's page 4 was never hashed: back to the front of FREE. r still holds 0..4.
    c.finish(r2);
    assert_eq!(c.counts(), (4, 0, 4));
    c.finish(r);
    assert_eq!(c.counts(), (4, 4, 0));
    let rx = c.admit(&u(p, &[7]));
    assert_eq!(c.pages(rx), vec![4]);
}

at_page_sizes!(
    commit_publishes_and_readmit_hits,
    commit_and_readmit,
    [4, 16]
);

fn free_list_order(p: usize) {
    let mut c = block(8, p);
    let r1 = c.admit(&u(p, &[1, 2]));
    let r2 = c.admit(&u(p, &[3, 4]));
    assert_eq!((c.pages(r1), c.pages(r2)), (vec![0, 1], vec![2, 3]));
    // Released last page first, each to FREE's front: FREE = [0, 1, 4, 5, 6, 7].
    c.abort(r1);
    // FREE = [2, 3, 0, 1, 4, 5, 6, 7].
    c.abort(r2);
    let r3 = c.admit(&u(p, &[5, 6, 7]));
    assert_eq!(c.pages(r3), vec![2, 3, 0]);
    // Not published (computed nothing): abort and finish free alike.
    c.finish(r3);
    let r4 = c.admit(&u(p, &[8, 9, 10, 11, 12]));
    assert_eq!(c.pages(r4), vec![2, 3, 0, 1, 4]);
    assert_eq!(c.counts(), (3, 0, 5));
}

at_page_sizes!(free_list_order, free_list_order, [4, 16]);

fn lazy_tail_first(p: usize) {
    let mut c = block(6, p);
    let a = u(p, &[1, 2, 3]);
    let a9 = cat(&a, &u(p, &[9]));
    assert_eq!(cache_prompt(&mut c, &a), vec![0, 1, 2]);
    // EVICTABLE = [2, 1, 0], FREE = [3, 4, 5].
    assert_eq!(c.counts(), (3, 3, 0));
    // Never-hashed pages go first, although the cached ones are older.
    let rb = c.admit(&u(p, &[7, 8]));
    assert_eq!(c.pages(rb), vec![3, 4]);
    assert_eq!(c.matched(&a9), 3 * p);
    assert_eq!(c.stats().evicted_pages, 0);
    // FREE = [5]; then EVICTABLE's front: a's tail, page 2, evicted only now.
    let rc = c.admit(&u(p, &[10, 11]));
    assert_eq!(c.pages(rc), vec![5, 2]);
    assert_eq!(c.stats().evicted_pages, 1);
    assert_eq!(c.matched(&a9), 2 * p);
    assert_eq!(c.counts(), (0, 2, 4));
    // evict takes the front (page 1) and puts it at FREE's front.
    assert_eq!(c.evict(1), 1);
    assert_eq!(c.matched(&a9), p);
    assert_eq!(c.counts(), (1, 1, 4));
    let rd = c.admit(&u(p, &[12]));
    assert_eq!(c.pages(rd), vec![1]);
    assert_eq!(c.stats().evicted_pages, 2);
}

at_page_sizes!(
    never_hashed_pages_first_then_chain_tail_before_head,
    lazy_tail_first,
    [4, 16]
);

fn lru_across_requests(p: usize) {
    let mut c = block(8, p);
    let a = u(p, &[1, 2]);
    let b = u(p, &[3, 4]);
    let q = |v: &[u32]| cat(v, &u(p, &[9]));
    let ra = c.admit(&a);
    let rb = c.admit(&b);
    assert_eq!((c.pages(ra), c.pages(rb)), (vec![0, 1], vec![2, 3]));
    c.commit(ra, 2 * p);
    c.commit(rb, 2 * p);
    c.finish(ra);
    c.finish(rb);
    // EVICTABLE = [1, 0, 3, 2].
    assert_eq!(c.counts(), (4, 4, 0));
    // A hit takes its pages out of EVICTABLE: [3, 2].
    let r = c.admit(&q(&a));
    assert_eq!(c.cached(r), 2 * p);
    assert_eq!(c.pages(r), vec![0, 1, 4]);
    assert_eq!(c.counts(), (3, 2, 3));
    assert_eq!(c.evict(1), 1); // b's tail, page 3
    assert_eq!(c.matched(&q(&b)), p);
    assert_eq!(c.matched(&q(&a)), 2 * p);
    // r computed nothing new: page 4 to FREE's front, then 1 and 0 to EVICTABLE's back.
    c.finish(r);
    assert_eq!(c.counts(), (5, 3, 0));
    // EVICTABLE = [2, 1, 0]: b (released longer ago) before a, a's tail before its head.
    assert_eq!(c.evict(2), 2);
    assert_eq!(c.matched(&q(&a)), p);
    assert_eq!(c.matched(&q(&b)), 0);
    // FREE = [1, 2, 4, 3, 5, 6, 7].
    let rn = c.admit(&u(p, &[20, 21, 22, 23]));
    assert_eq!(c.pages(rn), vec![1, 2, 4, 3]);
    assert_eq!(c.stats().evicted_pages, 3);
}

at_page_sizes!(
    lru_order_across_requests_and_hits_leave_the_evictable_list,
    lru_across_requests,
    [4, 16]
);

fn pinned_never_evicted(p: usize) {
    let mut c = block(8, p);
    let a = u(p, &[1, 2, 3, 4]);
    cache_prompt(&mut c, &a);
    // EVICTABLE = [3, 2, 1, 0]; r pins 0 and 1.
    let r = c.admit(&u(p, &[1, 2, 7]));
    assert_eq!(c.pages(r), vec![0, 1, 4]);
    assert_eq!(c.counts(), (3, 2, 3));
    assert_eq!(c.reset(), 2);
    assert_eq!(c.matched(&cat(&a, &u(p, &[9]))), 2 * p);
    assert_eq!(c.evict(8), 0);
    assert_eq!(c.counts(), (5, 0, 3));
    let before = c.stats();
    assert_eq!(
        c.try_admit(&u(p, &[10, 11, 12, 13, 14, 15])),
        Err(Error::OutOfPages {
            needed: 6,
            available: 5
        })
    );
    assert_eq!(c.stats(), before);
    c.commit(r, 3 * p);
    assert_eq!(c.evict(8), 0);
    c.finish(r);
    // Released 4, 1, 0: EVICTABLE = [4, 1, 0].
    assert_eq!(c.counts(), (5, 3, 0));
    assert_eq!(c.evict(1), 1);
    assert_eq!(c.matched(&u(p, &[1, 2, 7, 9])), 2 * p);
}

at_page_sizes!(
    pinned_pages_are_never_evicted,
    pinned_never_evicted,
    [4, 16]
);

fn computed_twice(p: usize) {
    let mut c = block(8, p);
    let a = u(p, &[1, 2, 3]);
    let a9 = cat(&a, &u(p, &[9]));
    let r1 = c.admit(&a);
    let r2 = c.admit(&a);
    assert_eq!((c.pages(r1), c.pages(r2)), (vec![0, 1, 2], vec![3, 4, 5]));
    assert_eq!(c.cached(r2), 0);
    c.commit(r1, 3 * p);
    c.commit(r2, 3 * p);
    assert_eq!((c.pages(r1), c.pages(r2)), (vec![0, 1, 2], vec![3, 4, 5]));
    assert_eq!(c.matched(&a9), 3 * p);
    let r3 = c.admit(&a9);
    assert_eq!(c.pages(r3), vec![0, 1, 2, 6]);
    c.abort(r3);
    // r2's copies are not hashed: FREE's front, last page first, so FREE = [3, 4, 5, 6, 7].
    c.finish(r2);
    assert_eq!(c.counts(), (5, 0, 3));
    c.finish(r1);
    assert_eq!(c.counts(), (5, 3, 0));
    let rx = c.admit(&u(p, &[30, 31]));
    assert_eq!(c.pages(rx), vec![3, 4]);
    c.abort(rx);
    // Only one copy is stored.
    assert_eq!(c.reset(), 3);

    // Published second is the duplicate, whichever was admitted first.
    let mut c = block(8, p);
    let r1 = c.admit(&a);
    let r2 = c.admit(&a);
    c.commit(r2, 2 * p);
    c.commit(r1, 3 * p);
    c.commit(r2, 3 * p);
    // Stored: page 0 and 1 of r2 (first), page 2 of r1 (first for that page).
    let r3 = c.admit(&a9);
    assert_eq!(c.pages(r3), vec![3, 4, 2, 6]);
    c.abort(r3);
    c.finish(r1);
    c.finish(r2);
    // r1 released 2 (hashed), 1, 0 (free); r2 released 5 (free), 4, 3 (hashed).
    assert_eq!(c.counts(), (5, 3, 0));
    let rx = c.admit(&u(p, &[30, 31, 32]));
    assert_eq!(c.pages(rx), vec![5, 0, 1]);
}

at_page_sizes!(
    a_page_computed_twice_is_stored_once,
    computed_twice,
    [4, 16]
);

fn fork(p: usize) {
    let mut c = block(16, p);
    let a = u(p, &[1, 2, 3, 4]);
    let r = c.admit(&a);
    c.commit(r, 2 * p + 1);
    let f1 = c.fork(r);
    assert_eq!(c.cached(f1), 2 * p);
    assert_eq!(c.pages(f1), vec![0, 1, 4, 5]);
    assert_eq!(c.c.request(f1).unwrap().tokens, &a[..]);
    c.commit(r, 4 * p);
    let f2 = c.fork(r);
    assert_eq!(c.cached(f2), 3 * p);
    assert_eq!(c.pages(f2), vec![0, 1, 2, 6]);
    let s = c.stats();
    assert_eq!(
        (s.queries, s.query_tokens, s.hit_tokens),
        (3, 12 * p as u64, 5 * p as u64)
    );
    // Sub-agents diverge from here: their own pages are their own.
    c.extend(f1, &u(p, &[5]));
    c.extend(f2, &u(p, &[6]));
    assert_eq!(c.pages(f1), vec![0, 1, 4, 5, 7]);
    assert_eq!(c.pages(f2), vec![0, 1, 2, 6, 8]);
    let rn = c.admit_in(&a, &ns("t"));
    c.commit(rn, 4 * p);
    let fnn = c.fork(rn);
    assert_eq!(c.c.request(fnn).unwrap().namespace, &ns("t"));
    assert_eq!(c.pages(fnn), vec![9, 10, 11, 13]);
    c.abort(fnn);
    c.abort(rn);
    c.abort(f1);
    c.abort(f2);
    c.abort(r);
    // Stored: r's 4 pages and rn's 4.
    assert_eq!(c.counts(), (8, 8, 0));
}

at_page_sizes!(fork_shares_pages, fork, [4, 16]);

fn out_of_pages(p: usize) {
    let mut c = block(6, p);
    let a = u(p, &[1, 2, 3, 4]);
    let a9 = cat(&a, &u(p, &[9]));
    cache_prompt(&mut c, &a);
    // EVICTABLE = [3, 2, 1, 0], FREE = [4, 5].
    let s0 = c.stats();
    // The 4 hits would be pinned: 2 + 4 - 4 available.
    assert_eq!(
        c.try_admit(&cat(&a, &u(p, &[5, 6, 7]))),
        Err(Error::OutOfPages {
            needed: 3,
            available: 2
        })
    );
    assert_eq!(
        c.try_admit(&u(p, &[10, 11, 12, 13, 14, 15, 16])),
        Err(Error::OutOfPages {
            needed: 7,
            available: 6
        })
    );
    assert_eq!(c.stats(), s0);
    assert_eq!(c.matched(&a9), 4 * p);
    // 2 hits (taken out of EVICTABLE: [3, 2]), 3 new: FREE's 4 and 5, then page 3.
    let r = c.admit(&u(p, &[1, 2, 8, 9, 10]));
    assert_eq!(c.cached(r), 2 * p);
    assert_eq!(c.pages(r), vec![0, 1, 4, 5, 3]);
    assert_eq!(c.stats().evicted_pages, 1);
    assert_eq!(c.matched(&a9), 3 * p);
    assert_eq!(c.counts(), (0, 1, 5));
    c.extend_short(r, &u(p, &[11, 12]), 2, 1);
    assert_eq!(c.matched(&a9), 3 * p);
    // One token more needs a sixth page: the last evictable one. Filling that page up needs
    // nothing more, although nothing is left.
    c.extend(r, &[1]);
    c.extend(r, &range(2, p as u32 + 1));
    assert_eq!(c.pages(r), vec![0, 1, 4, 5, 3, 2]);
    assert_eq!(c.stats().evicted_pages, 2);
    assert_eq!(c.matched(&a9), 2 * p);
    let s2 = c.stats();
    assert_eq!(
        c.try_admit(&u(p, &[30])),
        Err(Error::OutOfPages {
            needed: 1,
            available: 0
        })
    );
    assert_eq!(
        c.try_fork(r),
        Err(Error::OutOfPages {
            needed: 4,
            available: 0
        })
    );
    assert_eq!(c.stats(), s2);
    c.abort(r);
    assert_eq!(c.counts(), (4, 2, 0));
}

at_page_sizes!(out_of_pages_changes_nothing, out_of_pages, [4, 16]);

fn evict_and_reset_counts(p: usize) {
    let mut c = block(16, p);
    let a = u(p, &[1, 2, 3, 4, 5]);
    let b = u(p, &[6, 7, 8]);
    assert_eq!(cache_prompt(&mut c, &a), vec![0, 1, 2, 3, 4]);
    assert_eq!(cache_prompt(&mut c, &b), vec![5, 6, 7]);
    // EVICTABLE = [4, 3, 2, 1, 0, 7, 6, 5].
    assert_eq!(c.evict(0), 0);
    assert_eq!(c.evict(3), 3);
    assert_eq!(c.matched(&cat(&a, &u(p, &[9]))), 2 * p);
    assert_eq!(c.matched(&cat(&b, &u(p, &[9]))), 3 * p);
    assert_eq!(c.stats().evicted_pages, 3);
    assert_eq!(c.reset(), 5);
    assert_eq!(c.stats().evicted_pages, 8);
    assert_eq!(c.counts(), (16, 0, 0));
    assert_eq!(c.reset(), 0);
    assert_eq!(c.evict(3), 0);
    assert_eq!(c.matched(&cat(&b, &u(p, &[9]))), 0);
    // Each evicted page went to FREE's front, in eviction order: the last evicted comes first.
    let r = c.admit(&u(p, &[40, 41, 42, 43, 44, 45, 46, 47, 48]));
    assert_eq!(c.pages(r), vec![5, 6, 7, 0, 1, 2, 3, 4, 8]);
}

at_page_sizes!(evict_and_reset_counts, evict_and_reset_counts, [4, 16]);

/// The agent loop: a 128-token system prompt, a 144-token first turn (272 tokens, whole pages at
/// both sizes), a 32-token tool result (304), a 25-token decoded tail (329), two forked
/// sub-agents. The block cache reuses only full pages: of 329 computed tokens it keeps
/// floor(329 / P) * P.
fn agent_scenario(p: usize) {
    let pages = |a: usize, b: usize| -> Vec<u32> { (a as u32..b as u32).collect() };
    let mut c = block(1024 / p * 4, p);
    let prompt1 = cat(&range(10_000, 10_128), &range(20_000, 20_144));
    assert_eq!(cache_prompt(&mut c, &prompt1), pages(0, 272 / p));
    assert_eq!(c.counts().1, 272 / p);

    let prompt2 = cat(&prompt1, &range(30_000, 30_032));
    let r2 = c.admit(&prompt2);
    assert_eq!(c.cached(r2), 272);
    assert_eq!(c.pages(r2), pages(0, 304 / p));
    assert_eq!(c.counts().1, 0);
    c.commit(r2, 304);
    for i in 0..25 {
        c.extend(r2, &[40_000 + i]);
        c.commit(r2, 305 + i as usize);
    }
    let n: usize = 329;
    let np = n.div_ceil(p);
    assert_eq!(c.pages(r2), pages(0, np));
    let published = n / p * p;
    let r2_tokens = c.c.request(r2).unwrap().tokens.to_vec();
    assert_eq!(c.matched(&cat(&r2_tokens, &[1])), published);

    // Two sub-agents share the full pages of the computed context.
    let cached = published.min((n - 1) / p * p);
    let f1 = c.fork(r2);
    let f2 = c.fork(r2);
    assert_eq!((c.cached(f1), c.cached(f2)), (cached, cached));
    let own = np - cached / p;
    assert_eq!(
        c.pages(f1),
        cat(&pages(0, cached / p), &pages(np, np + own))
    );
    assert_eq!(
        c.pages(f2),
        cat(&pages(0, cached / p), &pages(np + own, np + 2 * own))
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
    assert_eq!(c.counts().2, 0);
    // A sub-agent's own part is cached from where its pages stopped being shared.
    assert_eq!(c.matched(&cat(&t1, &[1])), (n + 40) / p * p);
    assert_eq!(c.matched(&cat(&t2, &[1])), (n + 40) / p * p);
    assert_eq!(c.matched(&cat(&prompt2, &[7; 16])), 304);
    // The next turn reuses the full pages of the 329 computed tokens only.
    let prompt3 = cat(&r2_tokens, &range(70_000, 70_016));
    let r3 = c.admit(&prompt3);
    assert_eq!(c.cached(r3), published);
    let s = c.stats();
    assert_eq!(
        s.hit_tokens,
        (272 + 2 * cached + published) as u64,
        "hits: turn 2, two forks, turn 3"
    );
}

at_page_sizes!(agent_scenario, agent_scenario, [4, 16]);

/// Sub-agents in a pool that holds the shared context and three 16-token branches. Every
/// sub-agent re-pins and re-releases the trunk, so the oldest branch is always at EVICTABLE's
/// front: it is the one reused, page by page in release order (last page first).
fn agent_small_pool(p: usize) {
    let trunk = cat(&range(10_000, 10_128), &range(20_000, 20_176));
    let (tp, bp) = (304 / p, 16 / p);
    let mut c = block(tp + 3 * bp, p);
    cache_prompt(&mut c, &trunk);
    let task = |k: u32| cat(&trunk, &range(30_000 + 100 * k, 30_016 + 100 * k));
    let fresh =
        |k: usize| -> Vec<u32> { ((tp + k * bp) as u32..(tp + (k + 1) * bp) as u32).collect() };
    for k in 0..6u32 {
        let s = c.admit(&task(k));
        assert_eq!(c.cached(s), 304);
        let own = c.pages(s)[tp..].to_vec();
        let want = if k < 3 {
            fresh(k as usize)
        } else {
            fresh(k as usize - 3).into_iter().rev().collect()
        };
        assert_eq!(own, want, "sub-agent {k}");
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
    assert_eq!(c.matched(&cat(&trunk, &[5])), 304);
    assert_eq!(c.counts(), (0, tp + 3 * bp, 0));
}

at_page_sizes!(
    agent_small_pool_evicts_branches_not_the_trunk,
    agent_small_pool,
    [4, 16]
);

/// DESIGN.md: `fork(req)` shares every full page of `req`'s computed prefix; SEMANTICS.md: "the
/// fork finds at least every full page of req's computed prefix". Here `r` computed three full
/// pages, the first two as duplicates of `q`'s copies. Once `q` is gone and its unpinned copies
/// are evicted, the chain is cut at its head although `r` still holds that KV.
fn fork_after_duplicates(p: usize) {
    let mut c = block(16, p);
    let a = u(p, &[1, 2]);
    let ax = cat(&u(p, &[1, 2, 3]), &[7]);
    let q = c.admit(&a);
    let r = c.admit(&ax);
    assert_eq!((c.pages(q), c.pages(r)), (vec![0, 1], vec![2, 3, 4, 5]));
    c.commit(q, 2 * p);
    c.commit(r, 3 * p);
    c.finish(q);
    c.evict(16);
    let f = c.fork(r);
    assert_eq!(
        c.cached(f),
        3 * p,
        "fork of a request holding 3 computed full pages"
    );
}

at_page_sizes!(
    fork_shares_every_computed_page_even_after_duplicates,
    fork_after_duplicates,
    [4, 16]
);
