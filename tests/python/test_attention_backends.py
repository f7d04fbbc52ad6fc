"""Every attention backend against the reference (the scenario of test_attention.py): flex on
CPU (compiled; batch buckets 1, 2, 4 per configuration), varlen and FlashInfer on CUDA; and how
``"auto"`` chooses, ``warmup``, the typed plan and the errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kv import backends
from test_attention import D, scenario
from tiny_model import CACHES, cuda

needs_flex = pytest.mark.skipif(
    "flex" not in backends.available(torch.device("cpu")), reason="flex_attention unavailable"
)


@needs_flex
@pytest.mark.parametrize(
    ("make_cache", "hq", "hkv"),
    [
        pytest.param(CACHES[0].values[0], 8, 2, id="gqa-radix-p1"),
        pytest.param(CACHES[2].values[0], 8, 2, id="gqa-block-p16"),
        pytest.param(CACHES[1].values[0], 4, 1, id="mqa-radix-p4"),
    ],
)
def test_flex_matches_reference(make_cache, hq, hkv):
    ran = scenario(make_cache, hq, hkv, attention="flex")
    # Fresh prefill, mixed (decode through flex, prefill through SDPA), decodes, forks.
    assert ran == [
        ["sdpa"],
        ["flex", "sdpa"],
        ["flex"],
        ["flex"],
        ["sdpa"],
        ["flex"],
    ]


@needs_flex
def test_auto_on_cpu_is_sdpa_and_flex_is_opt_in():
    cache = radixkv.RadixCache(256, page_size=16)
    kv = radixkv.KVCache(cache, num_layers=1, num_kv_heads=2, head_dim=D)
    assert kv.attention == "auto"
    reqs = [cache.admit(np.arange(20) + i) for i in range(2)]
    q = torch.randn(40, 8, D)
    k = torch.randn(40, 2, D)
    step = kv.plan(reqs)
    step.attention(0, q, k, k)
    kv.commit(step)
    for r in reqs:
        cache.extend(r, [1])
    # A whole engine step measured faster through SDPA on CPU: auto compiles nothing.
    assert kv.warmup(num_heads=8, batch_sizes=[2]) == []
    assert kv.plan(reqs).backends == ["sdpa"]
    flex = radixkv.KVCache(cache, num_layers=1, num_kv_heads=2, head_dim=D, attention="flex")
    flex.k[0].copy_(kv.k[0])
    flex.v[0].copy_(kv.v[0])
    assert flex.warmup(num_heads=8, batch_sizes=[2]) == [2]
    step = flex.plan(reqs)
    assert step.backends == ["flex"]
    out = step.attention(0, q[:2], k[:2], k[:2])
    want = kv.plan(reqs).attention(0, q[:2], k[:2], k[:2])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    half = radixkv.KVCache(cache, 1, 2, D, dtype=torch.bfloat16)
    assert half.warmup(num_heads=8) == []
    assert half.plan(reqs).backends == ["sdpa"]


@needs_flex
def test_flex_compiles_are_bounded(monkeypatch):
    cache = radixkv.RadixCache(64, page_size=4)
    kv = radixkv.KVCache(cache, num_layers=1, num_kv_heads=1, head_dim=D, attention="flex")
    monkeypatch.setattr(backends, "MAX_FLEX_COMPILES", len(backends._flex_keys))
    with pytest.raises(RuntimeError, match="past MAX_FLEX_COMPILES"):
        kv.warmup(num_heads=3, batch_sizes=[64])


def test_backend_names_and_warmup_are_checked():
    cache = radixkv.RadixCache(16)
    with pytest.raises(ValueError, match=r"attention must be one of 'auto', 'sdpa'.*got 'varlen'"):
        radixkv.KVCache(cache, 1, 2, D, attention="varlen")
    with pytest.raises(ValueError, match="got 'nope'"):
        radixkv.KVCache(cache, 1, 2, D, attention="nope")
    kv = radixkv.KVCache(cache, 1, 2, D, attention="sdpa")
    assert kv.warmup(num_heads=4) == []
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads=2"):
        kv.warmup(num_heads=3)
    with pytest.raises(ValueError, match="batch_sizes"):
        kv.warmup(num_heads=4, batch_sizes=[0])


def test_plan_is_typed_with_page_tables():
    cache = radixkv.RadixCache(8, page_size=4)
    a, b = cache.admit(np.arange(9)), cache.admit(np.arange(100, 103))
    plan = radixkv.plan_step([a, b])
    assert isinstance(plan, radixkv.StepPlan) and not isinstance(plan, dict)
    assert plan.block_table.dtype == np.int32 and plan.block_table.shape == (2, 3)
    assert plan.block_table[0].tolist() == a.pages.tolist()
    assert plan.block_table[1, :1].tolist() == b.pages.tolist()
    assert plan.paged_kv_indices.tolist() == [*a.pages.tolist(), *b.pages.tolist()]
    assert plan.paged_kv_indptr.tolist() == [0, 3, 4]
    assert plan.paged_kv_last_page_len.tolist() == [1, 3]
    assert plan.seq_lens.tolist() == [9, 3] and plan.qo_indptr.tolist() == [0, 9, 12]
    assert (plan.batch_size, plan.num_tokens, plan.max_pages) == (2, 12, 3)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("attention", ["sdpa", "flex", "varlen", "flashinfer", "auto"])
@pytest.mark.parametrize("make_cache", [CACHES[0], CACHES[2]])
def test_cuda_backends(make_cache, attention):
    if attention not in backends.available(torch.device("cuda")):
        pytest.skip(f"{attention} is not available on this machine")
    scenario(make_cache, 8, 2, device="cuda", dtype=torch.bfloat16, atol=4e-2, attention=attention)
