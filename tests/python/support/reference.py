"""Pure-Python reference models of ``RadixCache`` and ``BlockCache``.

Naive on purpose: each model follows docs/SEMANTICS.md rule by rule, so that it predicts every
page id, every ``num_cached`` and every eviction of the real caches. The property tests run the
two side by side; ``benches/`` imports the models as the pure-Python baseline, so the public
names here (``RefRadixCache``, ``RefBlockCache``, ``RefRequest``, ``RefStats``, ``root_hash``,
``next_hash``, ``ref_block_hashes``) are stable.

The radix model is page-level, as SEMANTICS.md describes it: the index holds at most one page
per key ``(namespace, tokens[0:(k+1)*P])``. The key is stored chained, as ``(key of the page
before, tokens of page k)`` with the page before named by its page id (or by the namespace root
for ``k == 0``): the index is prefix-closed (only leaves are evicted, and a page is published
only below pages its request pins), so a page id names its whole prefix while it is indexed, and
a lookup costs one dict probe per page instead of hashing the whole prefix.

With ``host_pages > 0`` both models add the host tier of SEMANTICS.md ("Host tier"): a second
pool of host pages, a copy log (``drain_copies``) and six more counters. Host pages get internal
ids ``num_pages + h`` (a "gid") so that one dict keys the pages of both tiers; the copy log and
the stats use per-tier ids, as the real caches do.
"""

from __future__ import annotations

import heapq
import operator
import struct
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import blake3
import numpy as np

import radixkv

__all__ = [
    "RefBlockCache",
    "RefRadixCache",
    "RefRequest",
    "RefStats",
    "as_namespace",
    "as_tokens",
    "next_hash",
    "ref_block_hashes",
    "root_hash",
]

TOKEN_LIMIT = 1 << 32
ID_LIMIT = 1 << 31
OFFLOAD = 0  # radixkv.COPY_OFFLOAD: device page src -> host page dst
LOAD = 1  # radixkv.COPY_LOAD: host page src -> device page dst


# ---------------------------------------------------------------------------------------------
# Arguments


def as_tokens(tokens: Any, what: str = "tokens", allow_empty: bool = False) -> list[int]:
    """Token ids as a list of ints; ValueError/TypeError naming ``what`` and the bad value."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"{what} must be token ids, got {type(tokens).__name__}")
    if isinstance(tokens, (list, tuple)):
        out = []
        for i, t in enumerate(tokens):
            try:
                v = operator.index(t)
            except TypeError:
                raise TypeError(f"{what}[{i}] must be an int, got {type(t).__name__}") from None
            if not 0 <= v < TOKEN_LIMIT:
                raise ValueError(f"{what}[{i}] = {v} is not a valid token id")
            out.append(v)
    else:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got an array of shape {list(arr.shape)}")
        if arr.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, got an array of dtype {arr.dtype}")
        out = arr.tolist()
        bad = np.flatnonzero((arr < 0) | (arr >= TOKEN_LIMIT)) if arr.size else []
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"{what}[{i}] = {out[i]} is not a valid token id")
    if not out and not allow_empty:
        raise ValueError(f"{what} must hold at least one token, got an empty sequence")
    return out


def as_namespace(namespace: Any) -> bytes | None:
    """``None``, or the bytes of a str (utf-8) or bytes namespace: ``"a"`` and ``b"a"`` are one."""
    if namespace is None:
        return None
    if isinstance(namespace, str):
        return namespace.encode()
    if isinstance(namespace, bytes):
        return namespace
    raise TypeError(f"namespace must be None, str or bytes, got {type(namespace).__name__}")


def as_count(value: Any, what: str) -> int:
    """A non-negative int argument (``num_computed``, ``num_pages``)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None
    if v < 0:
        raise ValueError(f"{what} must be >= 0, got {v}")
    return v


def check_pool_args(num_pages: int, page_size: int, host_pages: int = 0) -> None:
    if num_pages < 1:
        raise ValueError(f"num_pages must be at least 1, got {num_pages}")
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    if isinstance(host_pages, bool) or not isinstance(host_pages, int):
        raise TypeError(f"host_pages must be an int, got {type(host_pages).__name__}")
    if host_pages < 0:
        raise ValueError(f"host_pages must be >= 0, got {host_pages}")
    if num_pages + host_pages >= ID_LIMIT:
        raise ValueError(
            f"num_pages + host_pages must be below 2**31, got {num_pages} + {host_pages}"
        )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def match_limit(num_tokens: int, page_size: int) -> int:
    """At most this many tokens are served from the cache: whole pages, one token left over."""
    return (num_tokens - 1) // page_size * page_size


# ---------------------------------------------------------------------------------------------
# Block hashes (DESIGN.md, spec radixkv.block.v1)


def root_hash(page_size: int, namespace: bytes | None) -> bytes:
    """``h_root``: the chain's start for a page size and a (normalized) namespace."""
    tag, ns = (0, b"") if namespace is None else (1, namespace)
    data = b"radixkv.block.v1" + struct.pack("<IBI", page_size, tag, len(ns)) + ns
    return blake3.blake3(data).digest()


def next_hash(prev: bytes, page: list[int]) -> bytes:
    """``h_i = blake3_keyed(key=h_{i-1}, data=le32 of each token of page i)``."""
    return blake3.blake3(struct.pack(f"<{len(page)}I", *page), key=prev).digest()


def ref_block_hashes(tokens: Any, page_size: int = 16, namespace: Any = None) -> list[bytes]:
    """What ``radixkv.block_hashes`` must return: one digest per full page."""
    toks = as_tokens(tokens, allow_empty=True)
    prev = root_hash(page_size, as_namespace(namespace))
    out = []
    for k in range(len(toks) // page_size):
        prev = next_hash(prev, toks[k * page_size : (k + 1) * page_size])
        out.append(prev)
    return out


# ---------------------------------------------------------------------------------------------
# Shared parts


@dataclass
class RefStats:
    """Same fields as ``radixkv.CacheStats``."""

    num_pages: int
    page_size: int
    free_pages: int
    evictable_pages: int
    used_pages: int
    queries: int
    query_tokens: int
    hit_tokens: int
    evicted_pages: int
    host_pages: int = 0
    host_free_pages: int = 0
    host_hit_tokens: int = 0
    offloaded_pages: int = 0
    loaded_pages: int = 0
    host_evicted_pages: int = 0
    # Retention is not modelled here (tests/python/test_retention.py checks it against a twin
    # cache, tests/rust/retain.rs by exact orders): the walks that use this model never retain.
    retentions: int = 0
    forced_evictions: int = 0
    expired_retentions: int = 0
    # Nor the disk tier (tests/rust/robust.rs drives it against a KV oracle): these walks have
    # none, and its counters stay 0.
    disk_pages: int = 0
    disk_free_pages: int = 0
    disk_written_pages: int = 0
    disk_fetched_pages: int = 0
    disk_evicted_pages: int = 0
    disk_bad_pages: int = 0
    # The window group (reference_window.py sets them; 0 without one).
    window: int = 0
    window_pages: int = 0
    window_free_pages: int = 0
    window_evictable_pages: int = 0
    window_cut_hits: int = 0
    window_cut_tokens: int = 0
    window_evicted_pages: int = 0
    window_host_used_pages: int = 0
    window_offloaded_pages: int = 0
    window_loaded_pages: int = 0
    state_slots: int = 0
    state_free_slots: int = 0
    state_pinned_slots: int = 0
    state_hit_tokens: int = 0
    taken_states: int = 0
    evicted_states: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["hit_rate"] = self.hit_rate
        return d


class RefRequest:
    """A live request of a reference cache; same attributes as ``radixkv.Request``.

    After ``finish``/``abort`` every attribute but ``namespace``, ``closed`` and ``cache`` raises
    ``radixkv.InvalidRequest``, like the real one.
    """

    def __init__(self, cache, tokens, namespace, ns, pages, num_cached):
        self.cache = cache
        self.namespace = namespace
        self.ns = ns
        self._tokens = tokens
        self._pages = pages
        self._num_cached = num_cached
        self._num_computed = num_cached
        # Tokens whose pages the index has seen published (page aligned, <= num_computed).
        self.published = num_cached
        # Radix: index pages of tokens[0:published], pinned. Private duplicates of index pages.
        self.chain: list[int] = []
        self.dups: list[int] = []
        # Block: hashes of the first full pages, computed as needed; (position, stored copy)
        # of each page published by another request first, pinned in place of its duplicate.
        self.hashes: list[bytes] = []
        self.stored: list[tuple[int, int]] = []
        # With a window group (reference_window.py): window page per page (-1: released), the
        # first held page, the block keys of the published pages.
        self._wpages: list[int] = []
        self.wlo = 0
        self.wkeys: list[bytes] = []
        self.closed = False

    def _live(self):
        if self.closed:
            raise radixkv.InvalidRequest("the request is closed (finished or aborted)")
        return self

    @property
    def tokens(self) -> list[int]:
        return list(self._live()._tokens)

    @property
    def pages(self) -> list[int]:
        return list(self._live()._pages)

    @property
    def num_tokens(self) -> int:
        return len(self._live()._tokens)

    @property
    def num_cached(self) -> int:
        return self._live()._num_cached

    @property
    def num_computed(self) -> int:
        return self._live()._num_computed

    @property
    def window_pages(self) -> list[int]:
        return list(self._live()._wpages)

    @property
    def slots(self) -> list[int]:
        p = self.cache.page_size
        pages = self._live()._pages
        return [pages[i // p] * p + i % p for i in range(len(self._tokens))]

    def __repr__(self) -> str:
        if self.closed:
            return "RefRequest(closed)"
        return (
            f"RefRequest(num_tokens={len(self._tokens)}, num_cached={self._num_cached}, "
            f"num_computed={self._num_computed})"
        )


class _RefCache:
    """What both models share: argument checks, the request life cycle and the counters."""

    def __init__(self, num_pages: int, page_size: int, host_pages: int = 0):
        check_pool_args(num_pages, page_size, host_pages)
        self.num_pages = num_pages
        self.page_size = page_size
        self.host_pages = host_pages
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0
        self.host_hit_tokens = 0
        self.offloaded_pages = 0
        self.loaded_pages = 0
        self.host_evicted_pages = 0
        # (kind, src, dst) rows not drained yet; ids per tier.
        self._copies: list[tuple[int, int, int]] = []

    def drain_copies(self) -> np.ndarray:
        """The copy log as an int32 array of shape [N, 3] (kind, src, dst); empties it."""
        out = np.array(self._copies, dtype=np.int32).reshape(-1, 3)
        self._copies = []
        return out

    def _log(self, kind: int, src: int, dst: int) -> None:
        self._copies.append((kind, src, dst))

    def _own(self, req: Any) -> RefRequest:
        if not isinstance(req, RefRequest) or req.cache is not self:
            raise radixkv.InvalidRequest("the request belongs to another cache")
        return req._live()

    def _out_of_pages(self, needed: int, available: int):
        return radixkv.OutOfPages(
            f"out of pages: needs {needed} pages, only {available} are free or evictable"
        )

    def admit(self, tokens: Any, namespace: Any = None) -> RefRequest:
        toks = as_tokens(tokens)
        ns = as_namespace(namespace)
        return self._admit(toks, namespace, ns)

    def fork(self, req: Any) -> RefRequest:
        """Exactly ``admit(req.tokens, req.namespace)``."""
        r = self._own(req)
        return self._admit(list(r._tokens), r.namespace, r.ns)

    def _record_query(self, num_tokens: int, num_cached: int, host_tokens: int = 0) -> None:
        self.queries += 1
        self.query_tokens += num_tokens
        self.hit_tokens += num_cached
        self.host_hit_tokens += host_tokens

    def _host_free_count(self) -> int:
        return 0

    def extend(self, req: Any, tokens: Any) -> None:
        toks = as_tokens(tokens, allow_empty=True)
        r = self._own(req)
        needed = ceil_div(len(r._tokens) + len(toks), self.page_size) - len(r._pages)
        available = self._free_count() + self._evictable_count()
        if needed > available:
            raise self._out_of_pages(needed, available)
        r._pages.extend(self._allocate(needed))
        r._tokens.extend(toks)

    def commit(self, req: Any, num_computed: Any) -> None:
        c = as_count(num_computed, "num_computed")
        r = self._own(req)
        if c > len(r._tokens):
            raise ValueError(f"num_computed must be at most num_tokens ({len(r._tokens)}), got {c}")
        if c < r._num_computed:
            raise ValueError(f"num_computed must not decrease (it is {r._num_computed}), got {c}")
        r._num_computed = c
        self._publish(r, c // self.page_size * self.page_size)

    def finish(self, req: Any) -> None:
        r = self._own(req)
        self._publish(r, r._num_computed // self.page_size * self.page_size)
        self._release(r)
        r.closed = True

    def abort(self, req: Any) -> None:
        r = self._own(req)
        self._release(r)
        r.closed = True

    def match_prefix(self, tokens: Any, namespace: Any = None) -> int:
        toks = as_tokens(tokens)
        return len(self._match(toks, as_namespace(namespace))) * self.page_size

    def evict(self, num_pages: Any) -> int:
        return self._evict_pages(as_count(num_pages, "num_pages"))

    def _evict_pages(self, k: int) -> int:
        """Up to ``k`` device evictions (without a host tier: dropped), one page at a time."""
        done = 0
        while done < k and self._evict_one():
            done += 1
        return done

    def reset(self) -> int:
        """Drops every host page, then every evictable device page (none offloaded)."""
        done = self._drop_all_host()
        while self._evict_one():
            done += 1
        return done

    def _drop_all_host(self) -> int:
        return 0

    def check(self) -> None:
        """The page-count identity, which every model state satisfies."""
        s = self.stats
        assert s.free_pages + s.evictable_pages + s.used_pages == s.num_pages
        assert 0 <= s.used_pages <= s.num_pages
        assert 0 <= s.host_free_pages <= s.host_pages

    @property
    def stats(self) -> RefStats:
        free, evictable = self._free_count(), self._evictable_count()
        return RefStats(
            num_pages=self.num_pages,
            page_size=self.page_size,
            free_pages=free,
            evictable_pages=evictable,
            used_pages=self.num_pages - free - evictable,
            queries=self.queries,
            query_tokens=self.query_tokens,
            hit_tokens=self.hit_tokens,
            evicted_pages=self.evicted_pages,
            host_pages=self.host_pages,
            host_free_pages=self._host_free_count(),
            host_hit_tokens=self.host_hit_tokens,
            offloaded_pages=self.offloaded_pages,
            loaded_pages=self.loaded_pages,
            host_evicted_pages=self.host_evicted_pages,
        )


# ---------------------------------------------------------------------------------------------
# RadixCache


class RefRadixCache(_RefCache):
    """Page-level model of ``radixkv.RadixCache`` (SEMANTICS.md, "RadixCache").

    Pages of the index carry a pin count (live requests whose published prefix covers them),
    counts of child pages per tier and a last-use time from a logical clock. Free pages form a
    heap (smallest id first). Eviction takes the evictable device leaf page with the smallest
    ``(time, -depth)``; a lazy heap of candidates, each checked against the current state when
    popped, finds it.

    The tree's edges matter only with a host tier (a device eviction moves a whole edge's tail at
    once), so only then ``_next`` links each page to the next page of its edge. A publish makes
    its new pages one edge; an edge splits where an admission's match or a publish's run ends
    inside it, where a new branch leaves its middle, and where its tail goes down to the host.
    """

    def __init__(self, num_pages: int, page_size: int = 1, host_pages: int = 0):
        super().__init__(num_pages, page_size, host_pages)
        self._free = list(range(num_pages))  # a sorted list is a heap
        self._host_free = list(range(host_pages))
        self._child: dict[tuple, int] = {}  # (page before or root, page tokens) -> page
        self._key: dict[int, tuple] = {}  # indexed page -> its key in _child
        # Child pages on the device and on the host (a host page has host children only).
        self._children: dict[int, int] = {}
        self._host_children: dict[int, int] = {}
        self._next: dict[int, int] = {}  # page -> the next page of the same edge
        self._pins: dict[int, int] = {}
        self._time: dict[int, int] = {}
        self._depth: dict[int, int] = {}
        self._candidates: list[tuple[int, int, int]] = []  # (time, -depth, page)
        self._evictable = 0
        self._clock = 0

    def _free_count(self) -> int:
        return len(self._free)

    def _evictable_count(self) -> int:
        return self._evictable

    def _host_free_count(self) -> int:
        return len(self._host_free)

    def _page_tokens(self, toks: list[int], k: int) -> tuple:
        p = self.page_size
        return tuple(toks[k * p : (k + 1) * p])

    def _match(self, toks: list[int], ns: bytes | None) -> list[int]:
        """Index pages (of either tier) of the longest cached prefix within the match limit."""
        before: Any = ("root", ns)
        chain = []
        for k in range(match_limit(len(toks), self.page_size) // self.page_size):
            page = self._child.get((before, self._page_tokens(toks, k)))
            if page is None:
                break
            chain.append(page)
            before = page
        return chain

    def _touch(self, chain: list[int]) -> None:
        """One clock tick; every page of ``chain`` (a pinned prefix) gets it as last use."""
        self._clock += 1
        for page in chain:
            self._time[page] = self._clock

    def _pin(self, page: int) -> None:
        if self._pins[page] == 0 and page < self.num_pages:
            self._evictable -= 1
        self._pins[page] += 1

    def _unpin(self, page: int) -> None:
        self._pins[page] -= 1
        if self._pins[page] == 0:
            self._evictable += 1
            self._maybe_candidate(page)

    def _device_leaf(self, page: int) -> bool:
        """An unpinned device page with no child page on the device."""
        n = self.num_pages
        return page < n and self._pins[page] == 0 and self._children[page] == 0

    def _maybe_candidate(self, page: int) -> None:
        if self._device_leaf(page):
            heapq.heappush(self._candidates, (self._time[page], -self._depth[page], page))

    def _pop_leaf(self) -> int | None:
        """The evictable device leaf page with the smallest last-use time (deeper first)."""
        while self._candidates:
            time, neg_depth, page = heapq.heappop(self._candidates)
            if (
                page in self._key
                and self._device_leaf(page)
                and self._time[page] == time
                and self._depth[page] == -neg_depth
            ):
                return page
        return None

    def _remove(self, page: int) -> None:
        """Takes a leaf page (of either tier) out of the index; its id is the caller's."""
        key = self._key.pop(page)
        del self._child[key], self._pins[page], self._time[page], self._depth[page]
        children = self._children.pop(page) + self._host_children.pop(page)
        assert children == 0, "only leaf pages leave the index"
        device = page < self.num_pages
        if device:
            self._evictable -= 1
        before = key[0]
        if isinstance(before, int):
            (self._children if device else self._host_children)[before] -= 1
            if self.host_pages:
                self._next.pop(page, None)
                if self._next.get(before) == page:
                    del self._next[before]
            self._maybe_candidate(before)

    def _move(self, old: int, new: int) -> None:
        """Renames an index page (it changes tier): its key, its children's keys, its edge."""
        key = self._key.pop(old)
        self._key[new] = key
        self._child[key] = new
        for c in [c for c, ck in self._key.items() if ck[0] == old]:  # naive: scans the index
            ck = self._key[c]
            del self._child[ck]
            nk = (new, ck[1])
            self._key[c] = nk
            self._child[nk] = c
        for d in (self._pins, self._time, self._depth, self._children, self._host_children):
            d[new] = d.pop(old)
        if old in self._next:
            self._next[new] = self._next.pop(old)
        before = key[0]
        if isinstance(before, int):
            n_dev = self.num_pages
            if (old < n_dev) != (new < n_dev):
                step = 1 if new < n_dev else -1
                self._children[before] += step
                self._host_children[before] -= step
            if self._next.get(before) == old:
                self._next[before] = new

    def _edge_of(self, leaf: int) -> list[int]:
        """The pages of ``leaf``'s edge, top down (``leaf`` ends it)."""
        edge = [leaf]
        while True:
            before = self._key[edge[0]][0]
            if isinstance(before, int) and self._next.get(before) == edge[0]:
                edge.insert(0, before)
            else:
                return edge

    def _evict_one(self) -> bool:
        """Drops the evictable device leaf page with the smallest last-use time (no offload)."""
        page = self._pop_leaf()
        if page is None:
            return False
        self._remove(page)
        heapq.heappush(self._free, page)
        self.evicted_pages += 1
        return True

    def _evict_pages(self, k: int) -> int:
        return self._evict_down(k) if self.host_pages else super()._evict_pages(k)

    def _evict_down(self, wanted: int) -> int:
        """Device eviction with a host tier (SEMANTICS.md, "RadixCache with a host tier")."""
        n_dev = self.num_pages
        done = 0
        while done < wanted:
            leaf = self._pop_leaf()
            if leaf is None:
                break
            edge = self._edge_of(leaf)
            n = len(edge)
            take = min(wanted - done, n)
            if len(self._host_free) < take:
                self._drop_host(take - len(self._host_free))
            k = min(take, len(self._host_free))
            parent = self._key[edge[0]][0]
            for page in reversed(edge[n - take + k :]):  # the deepest take - k are dropped
                assert not self._children[page] and not self._host_children[page]
                self._remove(page)
                heapq.heappush(self._free, page)
                self.evicted_pages += 1
            if k and n - take:
                del self._next[edge[n - take - 1]]  # the pages going down form the lower edge
            hosts = [heapq.heappop(self._host_free) for _ in range(k)]
            for page, h in zip(edge[n - take : n - take + k], hosts):
                self._move(page, n_dev + h)
                self._evictable -= 1
                heapq.heappush(self._free, page)
                self._log(OFFLOAD, page, h)
                self.offloaded_pages += 1
                self.evicted_pages += 1
            done += take
            top = edge[n - take - 1] if n > take else parent
            if isinstance(top, int):
                self._maybe_candidate(top)  # it may have become a device leaf
        return done

    def _drop_host(self, count: int) -> int:
        """Drops up to ``count`` host leaf pages, least recently used first, none of them being
        loaded (pinned by the admission in progress)."""
        n_dev = self.num_pages

        def leaf(g: int) -> bool:
            return g >= n_dev and not self._host_children[g] and self._pins[g] == 0

        leaves = [(self._time[g], g) for g in self._key if leaf(g)]
        heapq.heapify(leaves)
        dropped = 0
        while dropped < count and leaves:
            time, page = heapq.heappop(leaves)
            # Two host leaves never share a last use, so the tie rule never decides.
            assert not leaves or leaves[0][0] > time, "two host leaves share a last use"
            parent = self._key[page][0]
            self._remove(page)
            heapq.heappush(self._host_free, page - n_dev)
            self.host_evicted_pages += 1
            dropped += 1
            if isinstance(parent, int) and leaf(parent):
                heapq.heappush(leaves, (self._time[parent], parent))
        return dropped

    def _drop_all_host(self) -> int:
        return self._drop_host(self.host_pages)

    def _allocate(self, count: int) -> list[int]:
        """Evicts what the free set lacks, then takes the ``count`` smallest free ids."""
        short = count - len(self._free)
        if short > 0 and self.host_pages:
            self._evict_down(short)
        else:
            for _ in range(short):
                self._evict_one()
        return [heapq.heappop(self._free) for _ in range(count)]

    def _admit(self, toks: list[int], namespace: Any, ns: bytes | None) -> RefRequest:
        p, n_dev = self.page_size, self.num_pages
        chain = self._match(toks, ns)
        host = [page for page in chain if page >= n_dev]
        needed = ceil_div(len(toks), p) - len(chain)
        pinned_by_match = sum(1 for page in chain if page < n_dev and self._pins[page] == 0)
        available = len(self._free) + self._evictable - pinned_by_match
        if len(host) + needed > available:
            raise self._out_of_pages(len(host) + needed, available)
        if chain and chain[-1] in self._next:  # (edges are tracked with a host tier only)
            del self._next[chain[-1]]  # a match ending inside an edge splits it
        for page in chain:
            self._pin(page)
        new = self._allocate(len(host) + needed)
        for g, d in zip(host, new):
            self._move(g, d)
            heapq.heappush(self._host_free, g - n_dev)
            self._log(LOAD, g - n_dev, d)
            self.loaded_pages += 1
        chain = chain[: len(chain) - len(host)] + new[: len(host)]
        self._touch(chain)
        pages = chain + new[len(host) :]
        req = RefRequest(self, toks, namespace, ns, pages, len(chain) * p)
        req.chain = list(chain)
        self._record_query(len(toks), req._num_cached, len(host) * p)
        return req

    def _publish(self, r: RefRequest, upto: int) -> None:
        """Publishes pages ``[published/P, upto/P)`` of ``r`` in order; duplicates of device
        pages stay private, host copies give way to ``r``'s pages."""
        p, n_dev = self.page_size, self.num_pages
        first, last = r.published // p, upto // p
        if last <= first:
            return
        before: Any = r.chain[-1] if r.chain else ("root", r.ns)
        fresh = False  # ``before`` is a page this publish added
        for k in range(first, last):
            key = (before, self._page_tokens(r._tokens, k))
            page = self._child.get(key)
            if page is None:
                page = r._pages[k]
                self._child[key] = page
                self._key[page] = key
                self._children[page] = 0
                self._host_children[page] = 0
                self._pins[page] = 1  # pinned by r from the start: never evictable in between
                self._depth[page] = k
                if isinstance(before, int):
                    self._children[before] += 1
                    if self.host_pages:  # edges matter only with a host tier
                        if fresh:
                            self._next[before] = page
                        else:
                            self._next.pop(before, None)  # a branch leaving an edge's middle
                fresh = True
            elif page >= n_dev:
                own = r._pages[k]
                self._move(page, own)
                heapq.heappush(self._host_free, page - n_dev)
                self._pins[own] = 1
                page = own
                fresh = False
            else:
                r.dups.append(r._pages[k])
                self._pin(page)
                fresh = False
            r.chain.append(page)
            before = page
        if not fresh:
            self._next.pop(before, None)  # the run ended inside an edge: it splits there
        r.published = last * p
        self._touch(r.chain)

    def _release(self, r: RefRequest) -> None:
        self._touch(r.chain)
        for page in r.chain:
            self._unpin(page)
        for page in r.dups + r._pages[r.published // self.page_size :]:
            heapq.heappush(self._free, page)

    def check(self) -> None:
        """Recounts the evictable pages from scratch (a self-check of the model)."""
        super().check()
        n_dev = self.num_pages
        device = [g for g in self._key if g < n_dev]
        assert self._evictable == sum(1 for g in device if self._pins[g] == 0)
        assert len(self._free) + len(device) <= n_dev
        assert len(self._host_free) + len(self._key) - len(device) == self.host_pages
        for g, nxt in self._next.items():
            assert (g < n_dev) == (nxt < n_dev), "an edge on two tiers"
        for g in self._key:
            if g >= n_dev:
                assert self._pins[g] == 0 and self._children[g] == 0


# ---------------------------------------------------------------------------------------------
# BlockCache


class RefBlockCache(_RefCache):
    """Model of ``radixkv.BlockCache`` (SEMANTICS.md, "BlockCache").

    Page records carry a refcount and at most one hash; ``_map`` holds hash -> page. Unpinned
    pages sit in FREE or EVICTABLE, ordered dicts used as lists (front = first key). A request
    publishing a page whose hash the map holds already keeps its page private and pins the stored
    copy in its place (``RefRequest.stored``) until it ends.

    With a host tier, host page ``h`` is ``num_pages + h`` in ``_map`` and ``_hash``, and sits
    in HOST_FREE or HOST_EVICTABLE (least recently offloaded at the front).
    """

    def __init__(self, num_pages: int, page_size: int = 16, host_pages: int = 0):
        super().__init__(num_pages, page_size, host_pages)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._map: dict[bytes, int] = {}
        self._hash: list[bytes | None] = [None] * (num_pages + host_pages)
        self._ref = [0] * num_pages
        self._host_free: OrderedDict[int, None] = OrderedDict.fromkeys(range(host_pages))
        self._host_evictable: OrderedDict[int, None] = OrderedDict()

    def _free_count(self) -> int:
        return len(self._free)

    def _evictable_count(self) -> int:
        return len(self._evictable)

    def _host_free_count(self) -> int:
        return len(self._host_free)

    def _match(self, toks: list[int], ns: bytes | None, hashes: list | None = None) -> list[int]:
        """Pages (device ids, or ``num_pages + h`` for host pages) of the longest run of leading
        full-page hashes present in the map."""
        p = self.page_size
        prev = root_hash(p, ns)
        hits = []
        for k in range(match_limit(len(toks), p) // p):
            h = next_hash(prev, toks[k * p : (k + 1) * p])
            page = self._map.get(h)
            if page is None:
                break
            hits.append(page)
            if hashes is not None:
                hashes.append(h)
            prev = h
        return hits

    def _set_hash(self, page: int, h: bytes) -> None:
        self._hash[page] = h
        self._map[h] = page

    def _take_hash(self, page: int) -> bytes:
        """Clears ``page``'s hash (still in the map: the caller moves or drops it)."""
        h = self._hash[page]
        assert h is not None
        self._hash[page] = None
        return h

    def _down(self, page: int) -> None:
        """Device page ``page`` (just taken from EVICTABLE) is evicted: its hash goes to a host
        page (HOST_FREE's front, else HOST_EVICTABLE's front, dropping that one's hash), or is
        dropped when the host tier has no page to give."""
        h = self._take_hash(page)
        self.evicted_pages += 1
        n_dev = self.num_pages
        if self._host_free:
            host, _ = self._host_free.popitem(last=False)
        elif self._host_evictable:
            host, _ = self._host_evictable.popitem(last=False)
            del self._map[self._take_hash(n_dev + host)]
            self.host_evicted_pages += 1
        else:
            del self._map[h]
            return
        self._set_hash(n_dev + host, h)
        self._host_evictable[host] = None
        self._log(OFFLOAD, page, host)
        self.offloaded_pages += 1

    def _allocate(self, count: int) -> list[int]:
        """FREE's front page, or else EVICTABLE's front page, whose hash is evicted."""
        out = []
        for _ in range(count):
            if self._free:
                page, _ = self._free.popitem(last=False)
            else:
                page, _ = self._evictable.popitem(last=False)
                self._down(page)
            self._ref[page] = 1
            out.append(page)
        return out

    def _evict_one(self, down: bool = False) -> bool:
        """EVICTABLE's front page to FREE's front; its hash dropped, or offloaded if ``down``."""
        if not self._evictable:
            return False
        page, _ = self._evictable.popitem(last=False)
        if down:
            self._down(page)
        else:
            del self._map[self._take_hash(page)]
            self.evicted_pages += 1
        self._free[page] = None
        self._free.move_to_end(page, last=False)
        return True

    def _evict_pages(self, k: int) -> int:
        done = 0
        while done < k and self._evict_one(down=True):
            done += 1
        return done

    def _drop_all_host(self) -> int:
        """Drops every host page: HOST_EVICTABLE's front to HOST_FREE's front, one by one."""
        done = 0
        while self._host_evictable:
            host, _ = self._host_evictable.popitem(last=False)
            del self._map[self._take_hash(self.num_pages + host)]
            self._host_free[host] = None
            self._host_free.move_to_end(host, last=False)
            self.host_evicted_pages += 1
            done += 1
        return done

    def _host_to_free(self, host: int) -> None:
        self._host_free[host] = None
        self._host_free.move_to_end(host, last=False)

    def _admit(self, toks: list[int], namespace: Any, ns: bytes | None) -> RefRequest:
        p, n_dev = self.page_size, self.num_pages
        hashes: list[bytes] = []
        hits = self._match(toks, ns, hashes)
        host = [page for page in hits if page >= n_dev]
        needed = ceil_div(len(toks), p) - len(hits)
        pinned_by_match = sum(1 for page in hits if page < n_dev and self._ref[page] == 0)
        available = len(self._free) + len(self._evictable) - pinned_by_match
        if len(host) + needed > available:
            raise self._out_of_pages(len(host) + needed, available)
        for page in hits:
            if page < n_dev:
                self._pin(page)
        for page in host:
            del self._host_evictable[page - n_dev]
        new = self._allocate(len(host) + needed)
        loads = iter(new[: len(host)])
        pages = []
        for page in hits:
            if page >= n_dev:
                d = next(loads)
                self._set_hash(d, self._take_hash(page))
                self._host_to_free(page - n_dev)
                self._log(LOAD, page - n_dev, d)
                self.loaded_pages += 1
                page = d
            pages.append(page)
        pages += new[len(host) :]
        req = RefRequest(self, toks, namespace, ns, pages, len(hits) * p)
        req.hashes = hashes
        self._record_query(len(toks), req._num_cached, len(host) * p)
        return req

    def _publish(self, r: RefRequest, upto: int) -> None:
        p, n_dev = self.page_size, self.num_pages
        first, last = r.published // p, upto // p
        while len(r.hashes) < last:
            k = len(r.hashes)
            prev = r.hashes[-1] if r.hashes else root_hash(p, r.ns)
            r.hashes.append(next_hash(prev, r._tokens[k * p : (k + 1) * p]))
        for k in range(first, last):
            h = r.hashes[k]
            copy = self._map.get(h)
            if copy is None:
                self._set_hash(r._pages[k], h)
            elif copy >= n_dev:
                # Published again: r's page takes the hash from the host copy (no copy).
                self._take_hash(copy)
                del self._host_evictable[copy - n_dev]
                self._host_to_free(copy - n_dev)
                self._set_hash(r._pages[k], h)
            else:
                # r's page stays private (a duplicate); r pins the stored copy in its place.
                self._pin(copy)
                r.stored.append((k, copy))
        r.published = max(r.published, last * p)

    def _pin(self, page: int) -> None:
        if self._ref[page] == 0:
            del self._evictable[page]
        self._ref[page] += 1

    def _unpin(self, page: int) -> None:
        """At refcount 0 a hashed page goes to EVICTABLE's back, others to FREE's front."""
        self._ref[page] -= 1
        if self._ref[page] == 0:
            if self._hash[page] is not None:
                self._evictable[page] = None
            else:
                self._free[page] = None
                self._free.move_to_end(page, last=False)

    def _release(self, r: RefRequest) -> None:
        """Tail first; where r holds a duplicate, the stored copy first, then r's own page."""
        stored = dict(r.stored)
        for k in reversed(range(len(r._pages))):
            if k in stored:
                self._unpin(stored[k])
            self._unpin(r._pages[k])

    def check(self) -> None:
        """Hash ownership and list membership agree (a self-check of the model)."""
        super().check()
        assert len(self._map) == sum(1 for h in self._hash if h is not None)
        for h, page in self._map.items():
            assert self._hash[page] == h
        for page in self._evictable:
            assert self._ref[page] == 0 and self._hash[page] is not None
        for page in self._free:
            assert self._ref[page] == 0 and self._hash[page] is None
        n_dev = self.num_pages
        assert len(self._host_free) + len(self._host_evictable) == self.host_pages
        for host in self._host_evictable:
            assert self._hash[n_dev + host] is not None
        for host in self._host_free:
            assert self._hash[n_dev + host] is None
