"""A KV-correctness oracle: what a cache hit serves is exactly the KV the prefix would produce.

The pool's KV is simulated by one int64 per slot (``num_pages * page_size`` of them). A request
that computes token ``i`` writes into that token's slot a fingerprint of ``(namespace,
tokens[:i+1])``, which is what the real KV of a causal model depends on. Then:

- after every ``admit``/``fork``, each slot the request was served from the cache
  (tokens ``[0, num_cached)``) must hold the fingerprint of the same prefix in the same
  namespace: a hit on the wrong page, a namespace leak or a stale page shows up here;
- after every operation, each live request's computed tokens must still hold its own
  fingerprints: a page handed to another request (or evicted and reused) while still
  referenced gets overwritten by its new owner and shows up here.

Random multi-turn sessions over shared system prompts, in several namespaces (the same tokens in
each), with chunked prefill, decoding, forks, aborts and a pool too small for them all.

With a host tier the simulated pool has a host array too. After every cache call the oracle
drains the copy log and performs it in order, as the owner of the tensors must (an offload copies
the device page's slots to the host page's, a load the other way), then poisons the page it
copied from: the cache hands that page out again at once, so serving it without the copy
(a missing or misordered load or offload) shows up as KV of another prefix.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import pytest

import radixkv
from reference import RefBlockCache, RefRadixCache

MASK64 = (1 << 64) - 1
NAMESPACES = [None, "a", b"a", "b", "", b"\x00"]


def namespace_key(namespace: Any) -> bytes:
    """Equal for equal namespaces (a str is its utf-8 bytes), distinct from None's."""
    if namespace is None:
        return b"none"
    raw = namespace.encode() if isinstance(namespace, str) else namespace
    return b"ns:" + raw


def fingerprints(namespace: Any, tokens: list[int]) -> list[int]:
    """63-bit fingerprint of ``(namespace, tokens[:i+1])`` for every ``i``: a hash chain."""
    h = int.from_bytes(hashlib.blake2b(namespace_key(namespace), digest_size=8).digest(), "little")
    out = []
    for t in tokens:
        h = ((h ^ t) * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E5B9) & MASK64
        h ^= h >> 31
        h = (h * 0xBF58476D1CE4E5B9) & MASK64
        h ^= h >> 29
        out.append(h >> 1)
    return out


OFFLOAD, LOAD = radixkv.COPY_OFFLOAD, radixkv.COPY_LOAD
WOFFLOAD, WLOAD = radixkv.COPY_WINDOW_OFFLOAD, radixkv.COPY_WINDOW_LOAD
POISON = -2  # what a page holds once its KV went to the other tier


class Oracle:
    """The simulated KV pool (device and host) and the requests writing into it."""

    def __init__(self, cache: Any):
        s = cache.stats
        self.cache = cache
        self.page_size = s.page_size
        self.kv = np.full(s.num_pages * s.page_size, -1, dtype=np.int64)
        self.host = np.full(s.host_pages * s.page_size, -1, dtype=np.int64)
        self.live: list[tuple[Any, list[int]]] = []
        self.copies = {OFFLOAD: 0, LOAD: 0, WOFFLOAD: 0, WLOAD: 0}
        # With a window group, its pool too: a window layer's KV of each token (and its host
        # tier's).
        self.window = s.window
        self.wkv = np.full(s.window_pages * s.page_size, -1, dtype=np.int64)
        whost = getattr(cache, "window_host_pages", 0)  # a broken-on-purpose model has none
        self.whost = np.full(whost * s.page_size, -1, dtype=np.int64)

    def window_slots(self, req: Any, start: int, end: int) -> np.ndarray:
        """Window-pool slots of tokens ``start..end`` of ``req``; each page must be held."""
        p = self.page_size
        w = np.asarray(req.window_pages, dtype=np.int64)
        i = np.arange(start, end)
        pages = w[i // p]
        assert (pages >= 0).all(), f"{req!r} reads or writes a released window page"
        return pages * p + i % p

    def window_holds(self, req: Any, fps: list[int], what: str) -> None:
        """The keys the request's next query reads (``num_computed - window < j``) hold its own
        window KV."""
        c = req.num_computed
        lo = max(0, c + 1 - self.window)
        got = self.wkv[self.window_slots(req, lo, c)]
        bad = np.flatnonzero(got != np.array(fps[lo:c], dtype=np.int64))
        assert not len(bad), f"window token {lo + bad[:1]} of {req!r} {what}"

    def sync(self) -> None:
        """Performs the cache's copy log in order, then poisons each page copied from."""
        log = self.cache.drain_copies()
        assert log.dtype == np.int32 and log.ndim == 2 and log.shape[1] == 3, log
        p = self.page_size
        pools = {
            OFFLOAD: (self.kv, self.host),
            LOAD: (self.host, self.kv),
            WOFFLOAD: (self.wkv, self.whost),
            WLOAD: (self.whost, self.wkv),
        }
        for kind, src, dst in log.tolist():
            assert kind in pools, f"unknown copy kind {kind}"
            a, b = pools[kind]
            b[dst * p : (dst + 1) * p] = a[src * p : (src + 1) * p]
            a[src * p : (src + 1) * p] = POISON
            self.copies[kind] += 1

    def fp(self, req: Any) -> list[int]:
        return next(f for r, f in self.live if r is req)

    def admitted(self, req: Any) -> None:
        """The cached prefix of a new request holds the KV of that prefix in its namespace."""
        self.sync()
        fps = fingerprints(req.namespace, [int(t) for t in req.tokens])
        c = req.num_cached
        got = self.kv[np.asarray(req.slots[:c], dtype=np.int64)]
        bad = np.flatnonzero(got != np.array(fps[:c], dtype=np.int64))
        assert not len(bad), f"cached token {bad[:1]} of {req!r} holds KV of another prefix"
        if self.window:
            self.window_holds(req, fps, "holds window KV of another prefix")
        self.live.append((req, fps))

    def compute(self, req: Any, upto: int) -> None:
        """Writes the KV of tokens ``[num_computed, upto)`` into their slots, then commits."""
        fps = self.fp(req)
        start = req.num_computed
        self.kv[np.asarray(req.slots[start:upto], dtype=np.int64)] = fps[start:upto]
        if self.window:
            self.wkv[self.window_slots(req, start, upto)] = fps[start:upto]
        self.cache.commit(req, upto)
        self.sync()

    def extend(self, req: Any, tokens: list[int]) -> None:
        self.cache.extend(req, tokens)
        self.sync()
        i = next(i for i, (r, _) in enumerate(self.live) if r is req)
        self.live[i] = (req, fingerprints(req.namespace, [int(t) for t in req.tokens]))

    def close(self, req: Any, how: str) -> None:
        getattr(self.cache, how)(req)
        self.sync()
        self.live = [(r, f) for r, f in self.live if r is not req]

    def verify(self) -> None:
        """Every live request's computed KV is still its own."""
        self.sync()
        for req, fps in self.live:
            c = req.num_computed
            got = self.kv[np.asarray(req.slots[:c], dtype=np.int64)]
            bad = np.flatnonzero(got != np.array(fps[:c], dtype=np.int64))
            assert not len(bad), f"computed token {bad[:1]} of {req!r} was overwritten"
            if self.window:
                self.window_holds(req, fps, "was overwritten")
        self.cache.check()


def run_sessions(cache: Any, seed: int, steps: int = 300) -> dict:
    """Random agent traffic against ``Oracle``; returns counts of what happened."""
    rng = random.Random(seed)
    p = cache.stats.page_size
    oracle = Oracle(cache)
    systems = [
        [1 + (j * 7919 + i * 31) % 50_000 for i in range(rng.randint(3 * p, 5 * p))]
        for j in range(2)
    ]
    histories: list[tuple[Any, list[int]]] = []
    counts = {"hits": 0, "out_of_pages": 0, "forks": 0, "evicted": 0}

    def word() -> int:
        return rng.randint(0, 5)  # a tiny alphabet: equal suffixes (duplicates) happen often

    def admit(prompt: list[int], namespace: Any) -> Any:
        try:
            req = cache.admit(prompt, namespace)
        except radixkv.OutOfPages:
            counts["out_of_pages"] += 1
            if oracle.live:
                req, _ = oracle.live[0]
                finish(req)
            return None
        oracle.admitted(req)
        counts["hits"] += req.num_cached > 0
        return req

    def finish(req: Any) -> None:
        if req.num_computed == req.num_tokens:
            histories.append((req.namespace, [int(t) for t in req.tokens]))
        oracle.close(req, "finish")

    for _ in range(steps):
        op = rng.choices(
            ["new", "turn", "prefill", "decode", "fork", "finish", "abort", "evict", "reset"],
            weights=[4, 5, 8, 5, 2, 4, 1, 1, 0.2],
        )[0]
        live = [r for r, _ in oracle.live]
        if op == "new" or (op == "turn" and not histories):
            ns = rng.choice(NAMESPACES)
            prompt = rng.choice(systems) + [word() for _ in range(rng.randint(1, 2 * p))]
            admit(prompt, ns)
        elif op == "turn":
            ns, history = rng.choice(histories[-6:])
            admit(history + [word() for _ in range(rng.randint(1, 2 * p))], ns)
        elif op == "prefill" and live:
            req = rng.choice(live)
            if req.num_computed < req.num_tokens:
                oracle.compute(req, rng.randint(req.num_computed + 1, req.num_tokens))
        elif op == "decode" and live:
            req = rng.choice(live)
            if req.num_computed == req.num_tokens:
                try:
                    oracle.extend(req, [word()])
                except radixkv.OutOfPages:
                    counts["out_of_pages"] += 1
                    continue
                oracle.compute(req, req.num_tokens)
        elif op == "fork" and live:
            child = admit_fork(cache, oracle, rng.choice(live), counts)
            if child is not None:
                counts["forks"] += 1
        elif op == "finish" and live:
            finish(rng.choice(live))
        elif op == "abort" and live:
            oracle.close(rng.choice(live), "abort")
        elif op == "evict":
            counts["evicted"] += cache.evict(rng.randint(1, 4))
        elif op == "reset":
            counts["evicted"] += cache.reset()
        oracle.verify()
    s = cache.stats
    counts["evicted"] = s.evicted_pages
    counts["host_hit_tokens"] = s.host_hit_tokens
    counts["offloads"] = oracle.copies[OFFLOAD]
    counts["loads"] = oracle.copies[LOAD]
    assert counts["offloads"] == s.offloaded_pages and counts["loads"] == s.loaded_pages, counts
    counts["window_offloads"] = oracle.copies[WOFFLOAD]
    counts["window_loads"] = oracle.copies[WLOAD]
    assert counts["window_offloads"] == s.window_offloaded_pages, counts
    assert counts["window_loads"] == s.window_loaded_pages, counts
    return counts


def admit_fork(cache: Any, oracle: Oracle, parent: Any, counts: dict) -> Any:
    try:
        child = cache.fork(parent)
    except radixkv.OutOfPages:
        counts["out_of_pages"] += 1
        return None
    oracle.admitted(child)
    # A fork finds at least every full computed page of its parent, up to the match limit.
    p = cache.stats.page_size
    expect = min(parent.num_computed // p, (child.num_tokens - 1) // p) * p
    assert child.num_cached >= expect, f"a fork found {child.num_cached} < {expect} tokens"
    return child


CONFIGS = [
    ("radix", 1, 24),
    ("radix", 4, 14),
    ("radix", 16, 12),
    ("block", 4, 14),
    ("block", 16, 12),
]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("kind,p,num_pages", CONFIGS, ids=[f"{k}-p{p}" for k, p, _ in CONFIGS])
def test_cached_kv_is_always_the_prefix_kv(kind, p, num_pages, seed):
    """Served KV always belongs to the same prefix in the same namespace, under eviction."""
    cache = (radixkv.RadixCache if kind == "radix" else radixkv.BlockCache)(num_pages, p)
    counts = run_sessions(cache, seed)
    # The run exercised what the oracle guards: hits, forks, eviction and a full pool.
    assert counts["hits"] > 10, counts
    assert counts["forks"] > 0, counts
    assert counts["evicted"] > 0, counts
    assert counts["out_of_pages"] > 0, counts


# (kind, page size, device pages, host pages): host tiers from one page to several times the
# device pool, all under heavy eviction.
HOST_CONFIGS = [
    ("radix", 1, 16, 1),
    ("radix", 1, 20, 12),
    ("radix", 4, 10, 3),
    ("radix", 4, 10, 40),
    ("radix", 16, 10, 6),
    ("block", 4, 12, 1),
    ("block", 4, 10, 5),
    ("block", 16, 10, 30),
]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    "kind,p,num_pages,host_pages",
    HOST_CONFIGS,
    ids=[f"{k}-p{p}-d{n}-h{h}" for k, p, n, h in HOST_CONFIGS],
)
def test_cached_kv_is_the_prefix_kv_on_either_tier(kind, p, num_pages, host_pages, seed):
    """With a host tier, performing the copy log keeps every hit exact, from either tier."""
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    cache = cls(num_pages, p, host_pages=host_pages)
    counts = run_sessions(cache, seed)
    assert counts["hits"] > 10, counts
    assert counts["evicted"] > 0 and counts["out_of_pages"] > 0, counts
    # Pages went down and came back, and hits were served from the host.
    assert counts["offloads"] > 0 and counts["loads"] > 0, counts
    assert counts["host_hit_tokens"] > 0, counts


def test_oracle_detects_a_slot_holding_another_namespaces_kv():
    """The check is live: KV written under namespace "a" does not pass for namespace "b"."""
    cache = radixkv.RadixCache(16, 1)
    oracle = Oracle(cache)
    tokens = [1, 2, 3, 4, 5]
    req = cache.admit(tokens, "a")
    oracle.admitted(req)
    oracle.compute(req, len(tokens))
    oracle.close(req, "finish")
    # Forge the leak a broken cache would cause: the pages of "a" served under "b".
    hit = cache.admit(tokens, "a")
    assert hit.num_cached == 4
    forged = fingerprints("b", tokens)
    oracle.kv[hit.slots[:4]] = forged[:4]
    with pytest.raises(AssertionError, match="another prefix"):
        oracle.admitted(hit)


def test_oracle_detects_a_page_reused_while_referenced():
    """If a live request's page were handed to another request, its computed KV would change."""
    cache = radixkv.BlockCache(8, 4)
    oracle = Oracle(cache)
    a = cache.admit(list(range(10)))
    oracle.admitted(a)
    oracle.compute(a, 10)
    oracle.verify()
    # Another request writing into a's page, as it would if the pool handed that page out twice.
    b = cache.admit(list(range(100, 110)))
    oracle.admitted(b)
    oracle.kv[a.slots[5]] = fingerprints(None, list(range(100, 110)))[5]
    with pytest.raises(AssertionError, match="overwritten"):
        oracle.verify()


def test_fingerprints_separate_prefixes_and_namespaces():
    """The fingerprint tells prefixes, orders and namespaces apart ("a" and b"a" are one)."""
    f = fingerprints(None, [1, 2, 3])
    assert len(set(f)) == 3 and all(0 <= x < 2**63 for x in f)
    assert fingerprints("a", [1, 2, 3]) == fingerprints(b"a", [1, 2, 3])
    assert fingerprints("a", [1, 2, 3])[0] != f[0]
    assert fingerprints("", [1])[0] != fingerprints(None, [1])[0]
    assert fingerprints(None, [1, 2, 3])[2] != fingerprints(None, [2, 1, 3])[2]


# ---------------------------------------------------------------------------------------------
# The same traffic finds the bugs it guards against: two deliberately broken reference models.


class NamespaceBlindCache(RefRadixCache):
    """Broken on purpose: every request is indexed and matched as if in namespace None."""

    def _admit(self, toks: list[int], namespace: Any, ns: Any) -> Any:
        return super()._admit(toks, namespace, None)


class ForgetfulRefcountCache(RefBlockCache):
    """Broken on purpose: the first holder to release a shared page unpins it for everyone."""

    def _release(self, r: Any) -> None:
        for page in reversed(r._pages):
            if self._ref[page] == 0:
                continue  # another holder released it already
            self._ref[page] = 0
            if self._hash[page] is not None:
                self._evictable[page] = None
            else:
                self._free[page] = None
                self._free.move_to_end(page, last=False)

    def check(self) -> None:
        """Its own bookkeeping is wrong by design; only the oracle judges it."""


class SkippedLoadCache(RefRadixCache):
    """Broken on purpose: loads are not logged, so host hits are served from stale pages."""

    def _log(self, kind: int, src: int, dst: int) -> None:
        if kind != LOAD:
            super()._log(kind, src, dst)


class MisorderedCopiesCache(RefBlockCache):
    """Broken on purpose: a call's loads are logged before its offloads, so a page handed out
    again is overwritten before its KV went down."""

    def drain_copies(self) -> np.ndarray:
        self._copies.sort(key=lambda row: -row[0])
        return super().drain_copies()


def test_the_traffic_catches_a_missing_load():
    """Run on a model that forgets its loads, the oracle sees host hits holding stale KV."""
    with pytest.raises(AssertionError, match="another prefix"):
        for seed in range(5):
            run_sessions(SkippedLoadCache(16, 1, host_pages=8), seed)


def test_the_traffic_catches_misordered_copies():
    """Run on a model that loads into a page before offloading it, the oracle sees it."""
    with pytest.raises(AssertionError, match="another prefix"):
        for seed in range(5):
            run_sessions(MisorderedCopiesCache(10, 4, host_pages=6), seed)


def test_the_traffic_catches_a_namespace_leak():
    """Run on a model that ignores namespaces, the oracle fails: the leak is served as a hit."""
    with pytest.raises(AssertionError, match="another prefix"):
        for seed in range(5):
            run_sessions(NamespaceBlindCache(24, 1), seed)


def test_the_traffic_catches_a_page_reused_while_referenced():
    """Run on a model that unpins shared pages too early, the oracle sees KV overwritten."""
    with pytest.raises(AssertionError, match=r"overwritten|another prefix|a fork found"):
        for seed in range(5):
            run_sessions(ForgetfulRefcountCache(12, 16), seed)


# (kind, page size, device pages, window, window pages): windows under and over a page, window
# pools from a few windows' worth (hits cut, window pages evicted all the time) to roomy.
WINDOW_CONFIGS = [
    ("radix", 1, 40, 5, 16),
    ("radix", 1, 40, 12, 60),
    ("radix", 4, 20, 3, 8),
    ("radix", 4, 20, 9, 40),
    ("radix", 16, 14, 20, 12),
    ("block", 4, 20, 6, 10),
    ("block", 16, 14, 30, 14),
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "kind,p,num_pages,window,window_pages",
    WINDOW_CONFIGS,
    ids=[f"{k}-p{p}-w{w}-{wp}" for k, p, _, w, wp in WINDOW_CONFIGS],
)
def test_window_kv_is_always_the_prefix_kv(kind, p, num_pages, window, window_pages, seed):
    """With a window group: a hit's last window, and every live request's, holds window KV of
    its own prefix, under eviction of both kinds of page."""
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    cache = cls(num_pages, p, window=window, window_pages=window_pages)
    counts = run_sessions(cache, seed)
    s = cache.stats
    assert counts["hits"] > 5, counts
    assert counts["out_of_pages"] > 0, counts
    assert s.window_evicted_pages > 0 or s.window_cut_hits > 0, s


# (kind, page size, device pages, host pages, window, window pages, window host pages): both
# groups' host tiers, from a page or two (dropped all the time) to several windows' worth.
WINDOW_HOST_CONFIGS = [
    ("radix", 1, 40, 30, 5, 16, 12),
    ("radix", 1, 30, 60, 12, 40, 3),
    ("radix", 4, 20, 16, 3, 8, 8),
    ("radix", 4, 16, 24, 9, 30, 20),
    ("block", 4, 20, 20, 6, 10, 6),
    ("block", 16, 14, 10, 30, 14, 2),
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(
    "kind,p,num_pages,host_pages,window,window_pages,window_host",
    WINDOW_HOST_CONFIGS,
    ids=[f"{k}-p{p}-h{h}-w{w}-{wp}-{wh}" for k, p, _, h, w, wp, wh in WINDOW_HOST_CONFIGS],
)
def test_window_kv_is_the_prefix_kv_from_either_tier(
    kind, p, num_pages, host_pages, window, window_pages, window_host, seed
):
    """With both host tiers: performing the copy log (full pages and window pages, each to its
    own pool) keeps every hit's window and every live request's exact."""
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    cache = cls(
        num_pages,
        p,
        host_pages=host_pages,
        window=window,
        window_pages=window_pages,
        window_host_pages=window_host,
    )
    assert cache.window_host_pages == window_host
    counts = run_sessions(cache, seed)
    assert counts["hits"] > 5, counts
    assert counts["window_offloads"] > 0, counts


def test_window_host_loads_happen_and_the_default_follows_host_pages():
    """Across the seeds window pages come back from the host for hits; window_host_pages
    defaults to host_pages."""
    loads = 0
    for seed in range(4):
        cache = radixkv.RadixCache(40, 1, host_pages=30, window=5, window_pages=16)
        assert cache.window_host_pages == 30
        loads += run_sessions(cache, seed)["window_loads"]
    assert loads > 0
    assert radixkv.RadixCache(40, 1, window=5, window_pages=16).window_host_pages == 0


# Walks that once found a fork cut short: its parent's window page was a private duplicate of a
# page another request published first, and that one was evicted while the parent lived. A
# duplicate now holds the published page instead (SEMANTICS.md, "Held pages").
FORK_WALKS = [
    ("radix", 1, 40, 5, 16, 1001),
    ("radix", 1, 40, 12, 60, 1001),
    ("radix", 4, 20, 9, 40, 1001),
    ("radix", 16, 14, 20, 12, 1010),
]


@pytest.mark.parametrize("kind,p,num_pages,window,window_pages,seed", FORK_WALKS)
def test_a_fork_finds_its_parents_window_when_duplicates_go(
    kind, p, num_pages, window, window_pages, seed
):
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    counts = run_sessions(cls(num_pages, p, window=window, window_pages=window_pages), seed, 600)
    assert counts["forks"] > 0, counts
