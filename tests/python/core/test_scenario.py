"""The agent scenario of the design, step by step, every expected number derived from the rules.

A 128-token system prompt, a 144-token first turn, a 32-token second turn, a 25-token tail that
does not fill a page, two sub-agents forked from the context, and LRU eviction in a small pool.
The rules used (SEMANTICS.md), with ``P`` the page size and ``n`` the prompt length:

- ``limit(n) = floor((n - 1) / P) * P``: at most this much is served, one token is computed;
- ``published(c) = floor(c / P) * P``: what a request with ``c`` tokens computed leaves cached;
- a re-admission finds ``min(published, limit(n))`` when its prompt extends the cached one.
"""

from __future__ import annotations

from typing import Any

import pytest

import radixkv

SYSTEM = list(range(10_000, 10_128))  # 128 tokens
TURN1 = list(range(20_000, 20_144))  # 144 tokens
TURN2 = list(range(30_000, 30_032))  # 32 tokens
TAIL = list(range(40_000, 40_025))  # 25 tokens: not a multiple of 4 or 16
NEXT = list(range(50_000, 50_007))
BRANCH_A = list(range(60_000, 60_040))
BRANCH_B = list(range(70_000, 70_040))

KINDS = [("radix", 1), ("radix", 4), ("block", 16)]


def new_cache(kind: str, page_size: int, num_pages: int) -> Any:
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    return cls(num_pages, page_size)


def limit(n: int, p: int) -> int:
    return (n - 1) // p * p


def published(c: int, p: int) -> int:
    return c // p * p


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def run_turn(cache: Any, prompt: list[int], expect_cached: int) -> Any:
    """Admits ``prompt``, checks what it reused, computes the rest and finishes."""
    assert cache.match_prefix(prompt) == expect_cached
    req = cache.admit(prompt)
    assert req.num_cached == expect_cached
    cache.commit(req, len(prompt))
    cache.finish(req)
    cache.check()
    return req


@pytest.mark.parametrize("kind,p", KINDS, ids=[f"{k}-p{p}" for k, p in KINDS])
def test_multi_turn_reuse(kind, p):
    """Turn after turn, a conversation reuses everything cached before it, to the page."""
    cache = new_cache(kind, p, num_pages=1024)
    turn1 = SYSTEM + TURN1
    assert len(turn1) == 272
    run_turn(cache, turn1, expect_cached=0)

    # The same 272 tokens again: everything is cached, but one token must be computed.
    again = min(published(272, p), limit(272, p))
    assert again == {1: 271, 4: 268, 16: 256}[p]
    req = cache.admit(turn1)
    assert req.num_cached == again
    cache.abort(req)

    # Turn 2 extends turn 1 by 32 tokens: all 272 previous tokens are reused (272 = 17 * 16).
    turn2 = turn1 + TURN2
    assert len(turn2) == 304
    reused = min(published(272, p), limit(304, p))
    assert reused == 272
    before = cache.stats
    run_turn(cache, turn2, expect_cached=reused)
    assert round(100 * reused / len(turn2), 1) == 89.5
    after = cache.stats
    assert after.hit_tokens - before.hit_tokens == 272
    assert after.query_tokens - before.query_tokens == 304
    # ... and the hit rate the cache counts for this turn is that 89.5%.
    turn_hit = (after.hit_tokens - before.hit_tokens) / (after.query_tokens - before.query_tokens)
    assert round(100 * turn_hit, 1) == 89.5

    # A 25-token tail leaves a partial last page: only full pages are published.
    turn3 = turn2 + TAIL
    run_turn(cache, turn3, expect_cached=min(published(304, p), limit(len(turn3), p)))
    turn4 = turn3 + NEXT
    kept = min(published(len(turn3), p), limit(len(turn4), p))
    assert kept == published(329, p)
    assert kept == {1: 329, 4: 328, 16: 320}[p]  # radix P=1 to the token; P=16 to page 20
    run_turn(cache, turn4, expect_cached=kept)

    s = cache.stats
    assert s.queries == 5  # turn 1, its re-admission, turns 2, 3 and 4
    assert s.hit_tokens == again + reused + 304 + kept
    assert s.hit_rate == s.hit_tokens / s.query_tokens


@pytest.mark.parametrize("kind,p", KINDS, ids=[f"{k}-p{p}" for k, p in KINDS])
def test_sub_agents_share_the_trunk_and_eviction_takes_branches_first(kind, p):
    """Two forks of a 304-token context share its full pages; under pressure the pool gives up
    the least recently finished branch first, then the other, and the shared trunk last."""
    trunk = SYSTEM + TURN1 + TURN2
    n = len(trunk)
    assert n % p == 0  # 304 = 19 * 16: the whole trunk is published
    trunk_pages = n // p
    shared = limit(n, p) // p  # pages a fork reuses: 303, 75, 18
    own = ceil_div(n + len(BRANCH_A), p) - shared  # pages a sub-agent allocates
    branch_pages = published(n + len(BRANCH_A), p) // p - trunk_pages  # it leaves cached
    num_pages = trunk_pages + 2 * own + 4
    cache = new_cache(kind, p, num_pages)

    parent = cache.admit(trunk)
    cache.commit(parent, n)
    assert cache.match_prefix([*trunk, 1]) == n  # the whole trunk is published, as said above
    a = cache.fork(parent)
    b = cache.fork(parent)
    for child in (a, b):
        assert child.num_cached == shared * p
        assert child.num_computed == shared * p
        assert child.pages.tolist()[:shared] == parent.pages.tolist()[:shared]
    private = [set(r.pages.tolist()[shared:]) for r in (parent, a, b)]
    assert private[0].isdisjoint(private[1]) and private[1].isdisjoint(private[2])
    assert private[0].isdisjoint(private[2])

    cache.extend(a, BRANCH_A)
    cache.extend(b, BRANCH_B)
    assert cache.stats.used_pages == trunk_pages + 2 * own
    # B computes first, A last; but A finishes first, so A's branch is least recently used.
    cache.commit(b, b.num_tokens)
    cache.commit(a, a.num_tokens)
    cache.finish(a)
    cache.finish(b)
    cache.finish(parent)
    cache.check()
    s = cache.stats
    assert s.used_pages == 0
    assert s.evictable_pages == trunk_pages + 2 * branch_pages

    a_tokens, b_tokens, probe = trunk + BRANCH_A, trunk + BRANCH_B, [*trunk, 1]
    # Probing A last must not make A recently used: match_prefix changes nothing, LRU included.
    assert cache.match_prefix(probe) == n
    assert cache.match_prefix(b_tokens) == limit(len(b_tokens), p)
    assert cache.match_prefix(a_tokens) == limit(len(a_tokens), p)

    # Another agent arrives needing every free page and branch_pages more: A's branch goes.
    other = cache.admit(list(range(90_000, 90_000 + (s.free_pages + branch_pages) * p)), "other")
    assert other.num_cached == 0
    assert cache.stats.evicted_pages == branch_pages
    assert cache.match_prefix(a_tokens) == n
    assert cache.match_prefix(b_tokens) == limit(len(b_tokens), p)
    assert cache.match_prefix(probe) == n

    # Then B's branch; the trunk is still whole.
    assert cache.evict(branch_pages) == branch_pages
    assert cache.match_prefix(b_tokens) == n
    assert cache.match_prefix(probe) == n
    assert cache.stats.evictable_pages == trunk_pages

    # Only now does the trunk shrink, from its tail.
    assert cache.evict(1) == 1
    assert cache.match_prefix(probe) == n - p
    assert cache.match_prefix([*SYSTEM, 1]) == len(SYSTEM)
    cache.abort(other)
    cache.check()


@pytest.mark.parametrize("kind,p", KINDS, ids=[f"{k}-p{p}" for k, p in KINDS])
def test_concurrent_duplicate_prefill_keeps_the_first_copy(kind, p):
    """Two requests compute the same uncached prompt at once: the first to publish wins; the
    other's pages stay private and are freed when it ends, and later requests hit the winner."""
    prompt = SYSTEM + TURN1
    cache = new_cache(kind, p, num_pages=4 * ceil_div(len(prompt), p))
    first, second = cache.admit(prompt), cache.admit(prompt)
    assert first.num_cached == second.num_cached == 0
    cache.commit(second, len(prompt))  # second publishes first
    cache.commit(first, len(prompt))
    winner = second.pages.tolist()
    loser = first.pages.tolist()
    cache.finish(first)
    cache.finish(second)
    s = cache.stats
    full = published(len(prompt), p) // p
    assert s.evictable_pages == full
    assert s.free_pages == s.num_pages - full
    again = cache.admit(prompt)
    reused = limit(len(prompt), p) // p
    assert again.pages.tolist()[:reused] == winner[:reused]
    assert set(again.pages.tolist()[:reused]).isdisjoint(loser)
    cache.check()
