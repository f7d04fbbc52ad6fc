"""The window group in the torch layer: a ``KVCache`` whose window layers keep their KV in the
window pool (``window_layers``) attends exactly as a twin whose every layer keeps the full KV and
masks the window, step after step of random agent traffic (multi-turn sessions, forks, decode,
chunked prefill, aborts) under eviction of both kinds of page, at page sizes 1 and 4, with
softcapping and sinks; and what it refuses, it refuses naming the bad value."""

from __future__ import annotations

import random

import pytest
import torch

import radixkv
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.windowed import attend_exact

torch.set_num_threads(1)
H, HKV, D = 4, 2, 8
LAYERS = 3  # layer 1 attends to the full context, layers 0 and 2 through the window


def drive(
    p: int,
    window: int,
    window_pages: int,
    extras: dict,
    seed: int,
    host: int = 0,
    window_host: int = 0,
    tokens: int = 160,
) -> dict:
    """Random traffic on a window-group cache (with ``host`` > 0, both host tiers); every
    step's window layers checked against ``attend_exact`` over a twin pool that keeps every
    token (fed the same K/V, and the same copies of full pages between the tiers)."""
    rng = random.Random(seed)
    tiers = {"host_pages": host, "window_host_pages": window_host} if host else {}
    cache = radixkv.RadixCache(tokens // p, p, window=window, window_pages=window_pages, **tiers)
    kv = KVCache(
        cache,
        LAYERS,
        HKV,
        D,
        attention="sdpa",
        window_layers=[0, 2],
        host_device="cpu" if host else None,
    )
    twin = KVCache(radixkv.RadixCache(tokens // p, p), LAYERS, HKV, D, attention="sdpa")
    # The twin pool is indexed by the real cache's full slots: same pages, every token kept.
    twin.k = [torch.zeros(cache.num_pages * p, HKV, D) for _ in range(LAYERS)]
    twin.v = [torch.zeros(cache.num_pages * p, HKV, D) for _ in range(LAYERS)]
    twin_host = [torch.zeros(host * p, 2, HKV, D) for _ in range(LAYERS)]

    def copies() -> None:
        """Performs the cache's copy log on the real pools, and its full copies on the twin."""
        rows = cache.drain_copies()
        kv.apply_copies(rows)
        for kind, src, dst in rows.tolist():
            a, b = src * p, dst * p
            for layer in range(LAYERS):
                if kind == radixkv.COPY_OFFLOAD:
                    twin_host[layer][b : b + p, 0] = twin.k[layer][a : a + p]
                    twin_host[layer][b : b + p, 1] = twin.v[layer][a : a + p]
                elif kind == radixkv.COPY_LOAD:
                    twin.k[layer][b : b + p] = twin_host[layer][a : a + p, 0]
                    twin.v[layer][b : b + p] = twin_host[layer][a : a + p, 1]
        counts["window_loads"] += int((rows[:, 0] == radixkv.COPY_WINDOW_LOAD).sum())

    g = torch.Generator().manual_seed(seed)
    live: list = []
    histories: list[list[int]] = [[7] * (3 * p)]
    counts = {"steps": 0, "cut": 0, "out_of_pages": 0, "window_loads": 0}

    def admit(tokens: list[int]) -> None:
        try:
            live.append(cache.admit(tokens))
        except radixkv.OutOfPages:
            counts["out_of_pages"] += 1
            if live:
                close(live[0], "finish")

    def close(r, how: str) -> None:
        if how == "finish" and r.num_computed == r.num_tokens:
            histories.append([int(t) for t in r.tokens])
        getattr(cache, how)(r)
        live.remove(r)

    for _ in range(120):
        op = rng.choices(["new", "turn", "step", "fork", "finish", "abort"], [2, 4, 10, 1, 3, 1])[0]
        if op == "new" and len(live) < 4:
            admit([rng.randint(1, 50) for _ in range(rng.randint(1, 3 * window))])
        elif op == "turn" and len(live) < 4:
            admit(
                rng.choice(histories[-4:]) + [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
            )
        elif op == "fork" and live and len(live) < 4:
            try:
                live.append(cache.fork(rng.choice(live)))
            except radixkv.OutOfPages:
                counts["out_of_pages"] += 1
        elif op in ("finish", "abort") and live:
            close(rng.choice(live), op)
        elif op == "step" and live:
            for r in list(live):
                if r.num_computed == r.num_tokens:
                    try:
                        cache.extend(r, [rng.randint(1, 50)])
                    except radixkv.OutOfPages:
                        counts["out_of_pages"] += 1
                        close(r, "abort")
            reqs = [r for r in live if r.num_computed < r.num_tokens]
            if not reqs:
                continue
            copies()
            step = kv.plan(reqs)
            t = step.num_tokens
            for layer in range(LAYERS):
                q = torch.randn(t, H, D, generator=g)
                k, v = prefix_kv(reqs, layer)
                win = window if layer != 1 else None
                got = step.attention(layer, q, k, v, window=win, **extras)
                # The twin: every token's K/V at its full slot, then the exact reference.
                twin.k[layer].index_copy_(0, step.write_slots, k)
                twin.v[layer].index_copy_(0, step.write_slots, v)
                want = attend_exact(_TwinStep(step, twin), layer, q, D**-0.5, win, **extras)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            kv.commit(step)
            counts["steps"] += 1
        cache.check()
    s = cache.stats
    counts["cut"] = s.window_cut_hits
    counts["evicted"] = s.window_evicted_pages
    counts["loaded"] = s.loaded_pages
    for r in list(live):
        cache.abort(r)
    cache.check()
    return counts


def prefix_kv(reqs: list, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each new token of ``reqs`` (packed), a function of its layer and its prefix
    only, as a causal model's are: two computations of one prefix give the same KV, so which
    copy a cache keeps does not matter (random K/V per step would make it matter)."""
    rows = []
    for r in reqs:
        toks = [int(x) for x in r.tokens]
        for i in range(r.num_computed, r.num_tokens):
            gen = torch.Generator().manual_seed(hash((layer, *toks[: i + 1])) & (2**62 - 1))
            rows.append(torch.randn(2, HKV, D, generator=gen))
    kv = torch.stack(rows)
    return kv[:, 0].contiguous(), kv[:, 1].contiguous()


class _TwinStep:
    """The real step, seen over the twin pool (what ``attend_exact`` reads)."""

    def __init__(self, step, twin):
        self._step, self.kv = step, twin

    def __getattr__(self, name):
        return getattr(self._step, name)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "p,window,window_pages", [(1, 6, 40), (1, 11, 60), (4, 5, 12), (4, 13, 20)]
)
def test_window_pool_attends_as_the_full_pool(p, window, window_pages, seed):
    counts = drive(p, window, window_pages, {}, seed)
    assert counts["steps"] > 30, counts
    assert counts["evicted"] > 0, counts


@pytest.mark.parametrize(
    "p,window,window_pages,host,window_host", [(1, 6, 30, 40, 20), (4, 5, 10, 12, 6)]
)
def test_window_pool_with_host_tiers_attends_as_the_full_pool(
    p, window, window_pages, host, window_host
):
    """Full pages and window pages go down to their host tiers and come back for hits: the
    window layers still attend as the full-pool twin does."""
    total = {"window_loads": 0, "loaded": 0}
    for seed in range(3):
        counts = drive(p, window, window_pages, {}, seed, host, window_host, tokens=48)
        assert counts["steps"] > 30, counts
        for k in total:
            total[k] += counts[k]
    assert total["window_loads"] > 0 and total["loaded"] > 0, total


def test_window_pool_with_softcap_and_sinks():
    sinks = torch.linspace(-1.0, 1.0, H)
    counts = drive(4, 9, 16, {"softcap": 5.0, "sinks": sinks}, seed=5)
    assert counts["steps"] > 30 and counts["evicted"] > 0, counts


def test_bad_window_group_arguments_are_named():
    with pytest.raises(ValueError, match="window_pages=0"):
        radixkv.RadixCache(16, window=4)
    with pytest.raises(ValueError, match="with a disk tier"):
        radixkv.BlockCache(16, 4, host_pages=4, disk_pages=4, window=4, window_pages=4)
    with pytest.raises(ValueError, match="window_host_pages=2 needs a host tier"):
        radixkv.BlockCache(16, 4, window=4, window_pages=4, window_host_pages=2)
    with pytest.raises(ValueError, match="window_host_pages"):
        radixkv.BlockCache(16, 4, host_pages=4, window=4, window_pages=4, window_host_pages=-1)
    with pytest.raises(TypeError, match="window"):
        radixkv.RadixCache(16, window="4", window_pages=4)
    cache = radixkv.RadixCache(16, window=4, window_pages=8)
    assert (cache.window, cache.window_pages, cache.window_chunk) == (4, 8, 2)
    assert radixkv.RadixCache(16).window_chunk is None
    with pytest.raises(ValueError, match="pass window_layers"):
        KVCache(cache, 2, HKV, D)
    with pytest.raises(ValueError, match=r"window_layers must be in \[0, 2\), got 5"):
        KVCache(cache, 2, HKV, D, window_layers=[5])
    with pytest.raises(ValueError, match="needs a cache with a window group"):
        KVCache(radixkv.RadixCache(16), 2, HKV, D, window_layers=[0])
    kv = KVCache(cache, 2, HKV, D, window_layers=[1])
    assert kv.k[1].shape[0] == 8 and kv.k[0].shape[0] == 16
    r = cache.admit([1, 2, 3])
    step = kv.plan([r])
    q, k, v = torch.zeros(3, H, D), torch.zeros(3, HKV, D), torch.zeros(3, HKV, D)
    with pytest.raises(ValueError, match="pass window= at most 4, got None"):
        step.attention(1, q, k, v)
    with pytest.raises(ValueError, match="at most 4, got 5"):
        step.attention(1, q, k, v, window=5)
    assert r.num_computed == 0  # nothing written, nothing committed
    cache.abort(r)
    cache.check()
