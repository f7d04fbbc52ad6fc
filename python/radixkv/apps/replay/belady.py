"""Belady's offline optimum for a prefix cache, and LRU in the same model: the bound a
retention policy is measured against.

The model. Requests are served one at a time in arrival order by a pool of ``num_pages`` pages
of ``page_size`` tokens, like :func:`radixkv.apps.replay.simulate.infinite_bound` but with a bounded
pool. A request of ``n`` tokens hits the longest prefix of its full pages that is cached, less
one page when that would leave no token to compute (as ``admit`` does: at least one token is
computed); it holds ``ceil(n / page_size)`` pages while it runs (the hit ones, shared, and fresh
ones for the rest, the partial last page included); then its full pages stay cached (published)
and the rest are freed. To make room the simulation evicts cached pages that the request does
not hit. A request that could never fit the pool with its output (``ceil((n + max(output, 1) -
1) / page_size) > num_pages``, the rule of :meth:`radixkv.Scheduler.add`) is dropped, as
``radixkv replay`` drops it.

Eviction orders (:data:`POLICIES`):

- ``belady``: the cached page whose next use (the next request whose full pages include it) is
  farthest in the future; never used again counts as farthest. Belady's MIN rule
  (L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", IBM
  Systems Journal 5(2), 1966): for pages of one size where every page a request names must be
  resident, no policy misses fewer pages, so none recomputes fewer prompt tokens in this model.
- ``lru``: the page whose last use is oldest: what :class:`radixkv.RadixCache` does (least
  recently used leaf first), at the same granularity.

Both keep the cache *prefix-closed* (a page is cached only with every page before it in its
prefix), with no extra rule: a request that uses a page uses its parent too, so a parent's next
use is never later than its child's and its last use never older. Ties go to the deeper page
of one request's chain first, and between chains to the one whose last use is older: a parent
whose child ties with it was used since, without the child, so it never goes first. A hit is
then every cached full page of the request (up to the one-token cap).

Speed. Each request's pages form a chain root first whose next uses never decrease, so the
simulation keeps one heap entry per run of equal next use (per request for LRU), evicts from an
entry's deep end and drops an entry lazily once a later request has used its pages again. Work
is a few numpy calls per request and per eviction step, not per page: tens of thousands of
requests of thousands of pages each take seconds.

This bounds what any eviction or retention order can reach *in this model*. The concurrent
replay (``radixkv replay``) also pins the pages of requests in flight and reserves pages for
their outputs, so its LRU can hit less than this model's LRU; compare a policy with the bound
in the same model.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from radixkv.apps.common.trace import TraceRequest
from radixkv.apps.replay.block_keys import BlockKeys, block_keys

#: Eviction orders :func:`simulate` knows.
POLICIES = ("belady", "lru")


@dataclass
class BoundResult:
    """What one offline simulation measured.

    ``requests``: requests served; ``dropped``: requests the pool could never hold;
    ``prompt_tokens``, ``cached_tokens`` and ``computed_tokens`` (recomputed prompt tokens) of
    the served ones (``cached + computed == prompt``); ``evicted_pages``: pages evicted;
    ``served[i]``: whether request ``i`` (in the order given) was served; ``cached[i]``: its
    cached tokens (0 when dropped)."""

    policy: str
    num_pages: int
    page_size: int
    requests: int = 0
    dropped: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    evicted_pages: int = 0
    served: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    cached: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens of the served requests."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def fits(request: TraceRequest, num_pages: int, page_size: int) -> bool:
    """Whether ``request`` with its output fits a pool of ``num_pages`` pages (else dropped)."""
    need = len(request.tokens) + max(request.output_length, 1) - 1
    return -(-need // page_size) <= num_pages


def next_uses(blocks: BlockKeys, num_requests: int) -> np.ndarray:
    """For every page of every request (``blocks.keys``), the index of the next request that
    names the same key, or ``num_requests`` when none does."""
    keys = blocks.keys
    owner = np.repeat(np.arange(num_requests, dtype=np.int64), np.diff(blocks.starts))
    order = np.argsort(keys, kind="stable")  # by key, then by request (a key once per request)
    nxt = np.full(len(keys), num_requests, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = owner[order[1:][same]]
    return nxt


class _Sim:
    """The pool's state during :func:`simulate`."""

    def __init__(self, blocks: BlockKeys, num_pages: int, policy: str, n: int) -> None:
        self.blocks, self.num_pages, self.policy = blocks, num_pages, policy
        self.is_cached = np.zeros(blocks.num_blocks, dtype=bool)
        self.last = np.full(blocks.num_blocks, -1, dtype=np.int64)  # request that used it last
        self.used = 0  # cached pages
        self.evicted = 0
        # Entries (key, request, start, top), smallest first: pages start..top-1 of that
        # request's chain, valid while that request is still their last user and they are
        # cached. key: the last use (lru), minus the next use (belady).
        self.heap: list[tuple[int, int, int, int]] = []
        self.nxt = next_uses(blocks, n) if policy == "belady" else None

    def push(self, r: int) -> None:
        """Entries for request ``r``'s pages, just used by it."""
        s, e = self.blocks.starts[r], self.blocks.starts[r + 1]
        if e == s:
            return
        if self.nxt is None:  # lru: oldest last use first, deepest first
            heapq.heappush(self.heap, (r, r, 0, e - s))
            return
        nu = self.nxt[s:e]  # never decreasing along the chain
        cuts = np.flatnonzero(nu[1:] != nu[:-1]) + 1
        bounds = [0, *cuts.tolist(), e - s]
        for a, b in pairwise(bounds):
            heapq.heappush(self.heap, (-int(nu[a]), r, a, b))

    def evict(self, want: int) -> None:
        """Evicts ``want`` pages in the policy's order (the caller leaves enough evictable)."""
        heap, keys = self.heap, self.blocks.keys
        while want > 0:
            k0, r, a, top = heapq.heappop(heap)
            s = self.blocks.starts[r]
            chain = keys[s + a : s + top]
            # Pages a later request used again (or that are protected now) are a prefix of
            # the chain: they belong to that request's entries. The rest is this entry's.
            stale = np.flatnonzero((self.last[chain] != r) | ~self.is_cached[chain])
            low = a + (int(stale[-1]) + 1 if len(stale) else 0)
            if low >= top:
                continue
            count = min(top - low, want)
            gone = keys[s + top - count : s + top]
            self.is_cached[gone] = False
            self.used -= count
            self.evicted += count
            want -= count
            if top - count > low:
                heapq.heappush(heap, (k0, r, low, top - count))

    def check(self) -> None:
        """Prefix closure and the page count, from scratch."""
        cached = np.flatnonzero(self.is_cached)
        par = self.blocks.parent[cached]
        orphans = cached[(par >= 0) & ~self.is_cached[np.maximum(par, 0)]]
        if len(orphans):
            raise AssertionError(f"cached pages {orphans[:5].tolist()} lost their parent")
        if len(cached) != self.used or self.used > self.num_pages:
            raise AssertionError(
                f"{len(cached)} cached, counted {self.used}, pool {self.num_pages}"
            )


def simulate(
    requests: Sequence[TraceRequest],
    num_pages: int,
    page_size: int,
    policy: str = "belady",
    blocks: BlockKeys | None = None,
    check: bool = False,
) -> BoundResult:
    """Serves ``requests`` (in the order given; sort them by arrival first) one at a time with
    a pool of ``num_pages`` pages, evicting in ``policy``'s order (:data:`POLICIES`; see the
    module docstring). ``blocks``: their :func:`block_keys` at ``page_size``, when computed
    already (for the served requests only, in order; it is computed when None). ``check``
    verifies prefix closure after every request (slow: tests)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    served = np.fromiter((fits(r, num_pages, page_size) for r in requests), bool, len(requests))
    kept = [r for r, ok in zip(requests, served) if ok]
    if blocks is None:
        blocks = block_keys(kept, page_size)
    elif len(blocks.starts) != len(kept) + 1 or blocks.page_size != page_size:
        raise ValueError(
            f"blocks must hold the keys of the {len(kept)} served requests at page_size "
            f"{page_size}, got {len(blocks.starts) - 1} requests at {blocks.page_size}"
        )
    res = BoundResult(policy, num_pages, page_size, served=served)
    res.dropped = int((~served).sum())
    cached_out = np.zeros(len(requests), dtype=np.int64)
    where = np.flatnonzero(served)
    sim = _Sim(blocks, num_pages, policy, len(kept))
    for r, req in enumerate(kept):
        n = len(req.tokens)
        chain = blocks.of(r)
        present = sim.is_cached[chain]
        run = len(chain) if present.all() else int(np.argmin(present))
        hit = min(run, (n - 1) // page_size)  # pages matched: at least one token computed
        sim.last[chain[:hit]] = r  # pinned: not evictable while it runs
        short = sim.used + (-(-n // page_size) - hit) - num_pages
        if short > 0:
            sim.evict(short)
        fresh = ~sim.is_cached[chain]
        sim.used += int(fresh.sum())
        sim.is_cached[chain] = True
        sim.last[chain] = r
        sim.push(r)
        res.requests += 1
        res.prompt_tokens += n
        res.cached_tokens += hit * page_size
        cached_out[where[r]] = hit * page_size
        if check:
            sim.check()
    res.computed_tokens = res.prompt_tokens - res.cached_tokens
    res.evicted_pages = sim.evicted
    res.cached = cached_out
    return res
