"""Windowed attention in the torch layer: the SDPA window masks (what sliding-window layers run
on by default) give what the exact reference (``radixkv.kv.windowed.attend_exact``) gives, for
every shape of step (a fresh prefill, a padded batch of prefills over cached prefixes, decode
batches of equal and unequal lengths, decode and prefill mixed), and a window wider than every
request is plain causal attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.windowed import attend_exact

torch.set_num_threads(1)
H, HKV, D = 4, 2, 16


def fill(kv: KVCache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape, generator=g))


def step_for(kv: KVCache, cache, shapes):
    """Requests of ``(cached, new)`` tokens: the cached part published by an earlier request."""
    reqs = []
    rng = np.random.default_rng(0)
    for i, (cached, new) in enumerate(shapes):
        toks = (rng.integers(0, 1000, cached + new) + 1000 * i).astype(np.uint32)
        if cached:
            r = cache.admit(toks[: cached + 1])
            cache.commit(r, cached + 1)
            cache.finish(r)
        reqs.append(cache.admit(toks))
    return kv.plan(reqs), reqs


SHAPES = {
    "fresh prefill": [(0, 37)],
    "prefills over cached prefixes": [(24, 9), (5, 30), (40, 1), (0, 12)],
    "decode, equal lengths": [(30, 1), (30, 1)],
    "decode, unequal lengths": [(30, 1), (9, 1), (51, 1)],
    "decode and prefill mixed": [(30, 1), (12, 20), (3, 1)],
}


@pytest.mark.parametrize("window", [1, 4, 8, 200])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_sdpa_window_masks_equal_the_exact_reference(shape, window):
    cache = radixkv.RadixCache(512, page_size=1)
    kv = KVCache(cache, 1, HKV, D, attention="sdpa")
    fill(kv, 1)
    step, reqs = step_for(kv, cache, SHAPES[shape])
    g = torch.Generator().manual_seed(2)
    t = step.num_tokens
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (H, HKV, HKV))
    got = step.attention(0, q, k, v, window=window)
    want = attend_exact(step, 0, q, 1.0 / D**0.5, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    full = step.attention(0, q, k, v)
    if window >= 200:  # wider than every request: the window changes nothing
        torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
    elif window <= 4:  # every request is longer: the window must show
        assert not torch.allclose(got, full, atol=1e-3), "the window masked nothing"
    for r in reqs:
        cache.abort(r)


@pytest.mark.parametrize("window", [None, 4, 200])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_softcap_and_sinks_on_sdpa_equal_the_exact_reference(shape, window):
    """Gemma 2's softcapping and gpt-oss's sinks through the SDPA backend's batched layout
    (scores computed explicitly) give what the per-request reference gives."""
    cache = radixkv.RadixCache(512, page_size=1)
    kv = KVCache(cache, 1, HKV, D, attention="sdpa")
    fill(kv, 3)
    step, reqs = step_for(kv, cache, SHAPES[shape])
    g = torch.Generator().manual_seed(4)
    t = step.num_tokens
    q, k, v = (3 * torch.randn(t, h, D, generator=g) for h in (H, HKV, HKV))
    sinks = torch.randn(H, generator=g)
    for softcap, sink in ((2.0, None), (None, sinks), (5.0, sinks)):
        got = step.attention(0, q, k, v, window=window, softcap=softcap, sinks=sink)
        want = attend_exact(step, 0, q, 1.0 / D**0.5, window, softcap, sink)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        plain = step.attention(0, q, k, v, window=window)
        assert not torch.allclose(got, plain, atol=1e-3), "softcap or sinks changed nothing"
    for r in reqs:
        cache.abort(r)
