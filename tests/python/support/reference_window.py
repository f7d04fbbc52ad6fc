"""Pure-Python reference of the sliding-window group (SEMANTICS.md, "Sliding-window layers"),
over either reference index: ``RefWindowRadixCache`` and ``RefWindowBlockCache``.

Naive on purpose, rule by rule: window pages are found by the block key of their page; a hit of
``k`` pages needs the index's ``k`` full pages and the window pages of pages
``(k * P + 1 - window) // P .. k``, the longest such ``k`` found from the right; a request holds
the window pages from ``(b + 1 - window) // P`` on, ``b`` its last computed page boundary within
the match limit (``min(num_computed, num_tokens - 1)`` rounded down to a page), and each commit
and extend releases the pages below (published ones stay cached, least recently released
evicted first; the others are freed). A published page whose key another request published
first is swapped for that cached page (held; the private copy freed), so its key stays findable
while the request holds it. With a host tier the window group has one of its own:
a cached window page the pool gives up goes there (a free host page, else the least recently
offloaded one, whose page is dropped), and a hit whose window has pages there takes a fresh
window page for each and logs the load. It predicts every window page id, window copy and
counter of the real caches.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

import radixkv
from reference import (
    RefBlockCache,
    RefRadixCache,
    RefRequest,
    as_tokens,
    ceil_div,
    next_hash,
    root_hash,
)

GONE = -1  # what ``Request.window_pages`` shows for a released page
WOFFLOAD = 4  # radixkv.COPY_WINDOW_OFFLOAD: window page src -> window host page dst
WLOAD = 5  # radixkv.COPY_WINDOW_LOAD: window host page src -> window page dst


class _WindowModel:
    """The window group, mixed in before a reference index."""

    page_size: int

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        host_pages: int = 0,
        *,
        window: int,
        window_pages: int,
        window_host_pages: int | None = None,
    ):
        super().__init__(num_pages, page_size, host_pages)  # type: ignore[call-arg]
        if window < 1 or window_pages < 1:
            raise ValueError(f"window={window} and window_pages={window_pages} must be >= 1")
        whost = host_pages if window_host_pages is None else window_host_pages
        if whost and not host_pages:
            raise ValueError(f"window_host_pages={whost} needs a host tier")
        self.window_host_pages = whost
        self._hfree: list[int] = list(range(whost))  # front first
        self._hlru: OrderedDict[int, None] = OrderedDict()  # least recently offloaded first
        self._hmap: dict[bytes, int] = {}
        self._hkey: dict[int, bytes] = {}
        self._wcopies: list[tuple[int, int, int]] = []
        self.window_offloaded_pages = 0
        self.window_loaded_pages = 0
        self.window = window
        self.window_pages = window_pages
        self._wfree: list[int] = list(range(window_pages))  # front first
        self._wlru: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._wmap: dict[bytes, int] = {}
        self._wkey: dict[int, bytes] = {}
        self._wrefs = [0] * window_pages
        self.window_cut_hits = 0
        self.window_cut_tokens = 0
        self.window_evicted_pages = 0
        self._last: tuple[list[bytes], int] = ([], 0)

    # -- the rules

    def _first_needed(self, t: int) -> int:
        """The first page a query at position ``t`` reads (keys ``t - window < j <= t``)."""
        return max(0, t + 1 - self.window) // self.page_size

    def _keys(self, toks: list[int], ns: bytes | None, count: int) -> list[bytes]:
        p, prev, out = self.page_size, root_hash(self.page_size, ns), []
        for k in range(count):
            prev = next_hash(prev, toks[k * p : (k + 1) * p])
            out.append(prev)
        return out

    def _cut(self, keys: list[bytes], m: int) -> int:
        """The longest hit of at most ``m`` pages whose last window is cached."""
        for k in range(m, 0, -1):
            lo = self._first_needed(k * self.page_size)
            if all(key in self._wmap or key in self._hmap for key in keys[lo:k]):
                return k
        return 0

    def _match(self, toks: list[int], ns: bytes | None, *rest: Any) -> list[int]:
        chain = super()._match(toks, ns, *rest)  # type: ignore[misc]
        keys = self._keys(toks, ns, len(chain))
        k = self._cut(keys, len(chain))
        self._last = (keys[:k], len(chain) - k)
        if rest and rest[0] is not None:
            del rest[0][k:]  # the block index's hashes of the matched pages
        return chain[:k]

    def _take(self) -> int:
        if self._wfree:
            w = self._wfree.pop(0)
        else:
            w, _ = self._wlru.popitem(last=False)
            key = self._wkey.pop(w)
            self._wmap.pop(key)
            if self.window_host_pages:
                self._offload(w, key)
            else:
                self.window_evicted_pages += 1
        self._wrefs[w] = 1
        return w

    def _offload(self, w: int, key: bytes) -> None:
        """Window page ``w`` (of ``key``) to a host page: a free one, else the least recently
        offloaded one (its page dropped); dropped itself when every host page is pinned."""
        if self._hfree:
            h = self._hfree.pop(0)
        elif self._hlru:
            h, _ = self._hlru.popitem(last=False)
            self._hmap.pop(self._hkey.pop(h))
            self.window_evicted_pages += 1
        else:
            self.window_evicted_pages += 1
            return
        self._hmap[key] = h
        self._hkey[h] = key
        self._hlru[h] = None
        self._wcopies.append((WOFFLOAD, w, h))
        self.window_offloaded_pages += 1

    def drain_copies(self) -> Any:
        full = super().drain_copies()  # type: ignore[misc]
        window = np.array(self._wcopies, dtype=np.int32).reshape(-1, 3)
        self._wcopies = []
        return np.concatenate([full, window]).astype(np.int32)

    def _hold(self, w: int) -> None:
        if self._wrefs[w] == 0:
            del self._wlru[w]
        self._wrefs[w] += 1

    def _unhold(self, w: int) -> None:
        self._wrefs[w] -= 1
        if self._wrefs[w] == 0:
            if w in self._wkey:
                self._wlru[w] = None
            else:
                self._wfree.append(w)

    def _wreserve(self, needed: int, pinned: int = 0) -> None:
        available = len(self._wfree) + len(self._wlru) - pinned
        if needed > available:
            raise radixkv.OutOfPages(
                f"out of pages: needs {needed} window pages, only {available} are free or evictable"
            )

    def _advance(self, r: RefRequest) -> None:
        """Publishes the window pages of ``r``'s published pages, then releases what its next
        query no longer reads."""
        p = self.page_size
        while len(r.wkeys) < r.published // p:
            j = len(r.wkeys)
            prev = r.wkeys[-1] if r.wkeys else root_hash(p, r.ns)
            key = next_hash(prev, r._tokens[j * p : (j + 1) * p])
            r.wkeys.append(key)
            w = r._wpages[j]
            if w == GONE:
                continue
            if key in self._wmap:  # published first by another request: hold that page
                cached = self._wmap[key]
                if cached != w:
                    self._hold(cached)
                    r._wpages[j] = cached
                    self._unhold(w)  # the private copy is freed
                continue
            if key in self._hmap:  # this fresh page takes the host copy's place
                h = self._hmap.pop(key)
                del self._hkey[h]
                del self._hlru[h]
                self._hfree.append(h)
            self._wmap[key] = w
            self._wkey[w] = key
        b = min(r._num_computed, len(r._tokens) - 1) // p * p  # the last boundary a hit can end
        lo = min(self._first_needed(b), len(r._wpages))
        while r.wlo < lo:
            self._unhold(r._wpages[r.wlo])
            r._wpages[r.wlo] = GONE
            r.wlo += 1

    # -- the life cycle around the index's

    def _admit(self, toks: list[int], namespace: Any, ns: bytes | None) -> RefRequest:
        p = self.page_size
        self._match(toks, ns)
        keys, cut = self._last
        k = len(keys)
        lo = min(self._first_needed(k * p), k)
        in_pool = [key for key in keys[lo:k] if key in self._wmap]
        pinned = sum(1 for key in in_pool if self._wrefs[self._wmap[key]] == 0)
        loads = k - lo - len(in_pool)
        self._wreserve(ceil_div(len(toks), p) - k + loads, pinned)
        req = super()._admit(toks, namespace, ns)  # type: ignore[misc]
        assert req._num_cached == k * p
        pages = [GONE] * lo
        # The pool's pages held first, the host's pinned (out of the drop order), then loaded.
        on_host = []
        for j in range(lo, k):
            if keys[j] in self._wmap:
                self._hold(self._wmap[keys[j]])
                pages.append(self._wmap[keys[j]])
            else:
                h = self._hmap[keys[j]]
                del self._hlru[h]
                on_host.append((j, h))
                pages.append(GONE)
        for j, h in on_host:
            w = self._take()
            del self._hmap[self._hkey.pop(h)]
            self._hfree.append(h)
            self._wcopies.append((WLOAD, h, w))
            self.window_loaded_pages += 1
            self._wmap[keys[j]] = w
            self._wkey[w] = keys[j]
            pages[j] = w
        while len(pages) < len(req._pages):
            pages.append(self._take())
        req._wpages, req.wlo, req.wkeys = pages, lo, list(keys)
        if cut:
            self.window_cut_hits += 1
            self.window_cut_tokens += cut * p
        return req

    def extend(self, req: Any, tokens: Any) -> None:
        toks = as_tokens(tokens, allow_empty=True)
        r = self._own(req)  # type: ignore[attr-defined]
        before = len(r._pages)
        self._wreserve(ceil_div(len(r._tokens) + len(toks), self.page_size) - before)
        super().extend(req, tokens)  # type: ignore[misc]
        for _ in range(len(r._pages) - before):
            r._wpages.append(self._take())
        self._advance(r)

    def commit(self, req: Any, num_computed: Any) -> None:
        super().commit(req, num_computed)  # type: ignore[misc]
        self._advance(req)

    def finish(self, req: Any) -> None:
        super().finish(req)  # type: ignore[misc]
        self._advance(req)
        for w in req._wpages[req.wlo :]:
            self._unhold(w)

    def abort(self, req: Any) -> None:
        super().abort(req)  # type: ignore[misc]
        for w in req._wpages[req.wlo :]:
            self._unhold(w)

    def reset(self) -> int:
        done = super().reset()  # type: ignore[misc]
        while self._hlru:
            h, _ = self._hlru.popitem(last=False)
            del self._hmap[self._hkey.pop(h)]
            self._hfree.append(h)
            self.window_evicted_pages += 1
        while self._wlru:
            w, _ = self._wlru.popitem(last=False)
            self._wmap.pop(self._wkey.pop(w))
            self._wfree.append(w)
            self.window_evicted_pages += 1
        return done

    @property
    def stats(self) -> Any:
        s = super().stats  # type: ignore[misc]
        s.window = self.window
        s.window_pages = self.window_pages
        s.window_free_pages = len(self._wfree)
        s.window_evictable_pages = len(self._wlru)
        s.window_cut_hits = self.window_cut_hits
        s.window_cut_tokens = self.window_cut_tokens
        s.window_evicted_pages = self.window_evicted_pages
        s.window_host_used_pages = len(self._hmap)
        s.window_offloaded_pages = self.window_offloaded_pages
        s.window_loaded_pages = self.window_loaded_pages
        return s

    def check(self) -> None:
        super().check()  # type: ignore[misc]
        held = sum(1 for n in self._wrefs if n > 0)
        assert held + len(self._wfree) + len(self._wlru) == self.window_pages
        assert len(self._wmap) == len(self._wkey)
        assert (
            len(self._hfree) + len(self._hlru)
            == self.window_host_pages
            == (len(self._hfree) + len(self._hmap))
        )
        assert not set(self._hmap) & set(self._wmap)


class RefWindowRadixCache(_WindowModel, RefRadixCache):
    """``radixkv.RadixCache(..., window=, window_pages=)``."""


class RefWindowBlockCache(_WindowModel, RefBlockCache):
    """``radixkv.BlockCache(..., window=, window_pages=)``."""
