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


def check_pool_args(num_pages: int, page_size: int) -> None:
    if num_pages < 1:
        raise ValueError(f"num_pages must be at least 1, got {num_pages}")
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")


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

    def __init__(self, num_pages: int, page_size: int):
        check_pool_args(num_pages, page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0

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

    def _record_query(self, num_tokens: int, num_cached: int) -> None:
        self.queries += 1
        self.query_tokens += num_tokens
        self.hit_tokens += num_cached

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
        k = as_count(num_pages, "num_pages")
        done = 0
        while done < k and self._evict_one():
            done += 1
        return done

    def reset(self) -> int:
        done = 0
        while self._evict_one():
            done += 1
        return done

    def check(self) -> None:
        """The page-count identity, which every model state satisfies."""
        s = self.stats
        assert s.free_pages + s.evictable_pages + s.used_pages == s.num_pages
        assert 0 <= s.used_pages <= s.num_pages

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
        )


# ---------------------------------------------------------------------------------------------
# RadixCache


class RefRadixCache(_RefCache):
    """Page-level model of ``radixkv.RadixCache`` (SEMANTICS.md, "RadixCache").

    Pages of the index carry a pin count (live requests whose published prefix covers them), a
    child count and a last-use time from a logical clock. Free pages form a heap (smallest id
    first). Eviction takes the evictable leaf page with the smallest ``(time, -depth)``; a lazy
    heap of candidates, each checked against the current state when popped, finds it.
    """

    def __init__(self, num_pages: int, page_size: int = 1):
        super().__init__(num_pages, page_size)
        self._free = list(range(num_pages))  # a sorted list is a heap
        self._child: dict[tuple, int] = {}  # (page before or root, page tokens) -> page
        self._key: dict[int, tuple] = {}  # indexed page -> its key in _child
        self._children: dict[int, int] = {}
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

    def _page_tokens(self, toks: list[int], k: int) -> tuple:
        p = self.page_size
        return tuple(toks[k * p : (k + 1) * p])

    def _match(self, toks: list[int], ns: bytes | None) -> list[int]:
        """Index pages of the longest cached prefix of ``toks`` within the match limit."""
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
        if self._pins[page] == 0:
            self._evictable -= 1
        self._pins[page] += 1

    def _unpin(self, page: int) -> None:
        self._pins[page] -= 1
        if self._pins[page] == 0:
            self._evictable += 1
            self._maybe_candidate(page)

    def _maybe_candidate(self, page: int) -> None:
        if self._pins[page] == 0 and self._children[page] == 0:
            heapq.heappush(self._candidates, (self._time[page], -self._depth[page], page))

    def _evict_one(self) -> bool:
        """Evicts the evictable leaf page with the smallest last-use time (deeper first)."""
        while self._candidates:
            time, neg_depth, page = heapq.heappop(self._candidates)
            valid = (
                page in self._key
                and self._pins[page] == 0
                and self._children[page] == 0
                and self._time[page] == time
                and self._depth[page] == -neg_depth
            )
            if not valid:
                continue
            key = self._key.pop(page)
            del self._child[key]
            for d in (self._children, self._pins, self._time, self._depth):
                del d[page]
            before = key[0]
            if isinstance(before, int):
                self._children[before] -= 1
                self._maybe_candidate(before)
            self._evictable -= 1
            heapq.heappush(self._free, page)
            self.evicted_pages += 1
            return True
        return False

    def _allocate(self, count: int) -> list[int]:
        """Evicts what the free set lacks, then takes the ``count`` smallest free ids."""
        for _ in range(count - len(self._free)):
            self._evict_one()
        return [heapq.heappop(self._free) for _ in range(count)]

    def _admit(self, toks: list[int], namespace: Any, ns: bytes | None) -> RefRequest:
        p = self.page_size
        chain = self._match(toks, ns)
        needed = ceil_div(len(toks), p) - len(chain)
        pinned_by_match = sum(1 for page in chain if self._pins[page] == 0)
        available = len(self._free) + self._evictable - pinned_by_match
        if needed > available:
            raise self._out_of_pages(needed, available)
        for page in chain:
            self._pin(page)
        self._touch(chain)
        pages = chain + self._allocate(needed)
        req = RefRequest(self, toks, namespace, ns, pages, len(chain) * p)
        req.chain = list(chain)
        self._record_query(len(toks), req._num_cached)
        return req

    def _publish(self, r: RefRequest, upto: int) -> None:
        """Publishes pages ``[published/P, upto/P)`` of ``r`` in order; duplicates stay private."""
        p = self.page_size
        first, last = r.published // p, upto // p
        if last <= first:
            return
        before: Any = r.chain[-1] if r.chain else ("root", r.ns)
        for k in range(first, last):
            key = (before, self._page_tokens(r._tokens, k))
            page = self._child.get(key)
            if page is None:
                page = r._pages[k]
                self._child[key] = page
                self._key[page] = key
                self._children[page] = 0
                self._pins[page] = 1  # pinned by r from the start: never evictable in between
                self._depth[page] = k
                if isinstance(before, int):
                    self._children[before] += 1
            else:
                r.dups.append(r._pages[k])
                self._pin(page)
            r.chain.append(page)
            before = page
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
        assert self._evictable == sum(1 for n in self._pins.values() if n == 0)
        assert len(self._free) + len(self._key) <= self.num_pages


# ---------------------------------------------------------------------------------------------
# BlockCache


class RefBlockCache(_RefCache):
    """Model of ``radixkv.BlockCache`` (SEMANTICS.md, "BlockCache").

    Page records carry a refcount and at most one hash; ``_map`` holds hash -> page. Unpinned
    pages sit in FREE or EVICTABLE, ordered dicts used as lists (front = first key). A request
    publishing a page whose hash the map holds already keeps its page private and pins the stored
    copy in its place (``RefRequest.stored``) until it ends.
    """

    def __init__(self, num_pages: int, page_size: int = 16):
        super().__init__(num_pages, page_size)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._map: dict[bytes, int] = {}
        self._hash: list[bytes | None] = [None] * num_pages
        self._ref = [0] * num_pages

    def _free_count(self) -> int:
        return len(self._free)

    def _evictable_count(self) -> int:
        return len(self._evictable)

    def _match(self, toks: list[int], ns: bytes | None, hashes: list | None = None) -> list[int]:
        """Pages of the longest run of leading full-page hashes present in the map."""
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

    def _unhash(self, page: int) -> None:
        del self._map[self._hash[page]]
        self._hash[page] = None
        self.evicted_pages += 1

    def _allocate(self, count: int) -> list[int]:
        """FREE's front page, or else EVICTABLE's front page, whose hash is dropped."""
        out = []
        for _ in range(count):
            if self._free:
                page, _ = self._free.popitem(last=False)
            else:
                page, _ = self._evictable.popitem(last=False)
                self._unhash(page)
            self._ref[page] = 1
            out.append(page)
        return out

    def _evict_one(self) -> bool:
        if not self._evictable:
            return False
        page, _ = self._evictable.popitem(last=False)
        self._unhash(page)
        self._free[page] = None
        self._free.move_to_end(page, last=False)
        return True

    def _admit(self, toks: list[int], namespace: Any, ns: bytes | None) -> RefRequest:
        p = self.page_size
        hashes: list[bytes] = []
        hits = self._match(toks, ns, hashes)
        needed = ceil_div(len(toks), p) - len(hits)
        pinned_by_match = sum(1 for page in hits if self._ref[page] == 0)
        available = len(self._free) + len(self._evictable) - pinned_by_match
        if needed > available:
            raise self._out_of_pages(needed, available)
        for page in hits:
            self._pin(page)
        pages = hits + self._allocate(needed)
        req = RefRequest(self, toks, namespace, ns, pages, len(hits) * p)
        req.hashes = hashes
        self._record_query(len(toks), req._num_cached)
        return req

    def _publish(self, r: RefRequest, upto: int) -> None:
        p = self.page_size
        first, last = r.published // p, upto // p
        while len(r.hashes) < last:
            k = len(r.hashes)
            prev = r.hashes[-1] if r.hashes else root_hash(p, r.ns)
            r.hashes.append(next_hash(prev, r._tokens[k * p : (k + 1) * p]))
        for k in range(first, last):
            h = r.hashes[k]
            copy = self._map.get(h)
            if copy is None:
                self._map[h] = r._pages[k]
                self._hash[r._pages[k]] = h
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
        for page in self._evictable:
            assert self._ref[page] == 0 and self._hash[page] is not None
        for page in self._free:
            assert self._ref[page] == 0 and self._hash[page] is None
