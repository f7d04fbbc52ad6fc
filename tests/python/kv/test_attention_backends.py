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
    monkeypatch.setattr(backends.flex_backend, "MAX_FLEX_COMPILES", len(backends._flex_keys))
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
    if attention == "flex" and make_cache(64).page_size < 16:
        with pytest.raises(ValueError, match="at least 16 slots"):
            scenario(make_cache, 8, 2, device="cuda", dtype=torch.bfloat16, attention="flex")
        return
    scenario(make_cache, 8, 2, device="cuda", dtype=torch.bfloat16, atol=4e-2, attention=attention)


def windowed_decode(attention, device="cpu", dtype=torch.float32, atol=1e-5, p=4):
    """Decode steps of requests of 5 to 73 tokens through each of ``EXTRAS`` (windows shorter
    than a page, across pages and longer than every context, softcaps, sinks, all three),
    checked against ``attend_exact``."""
    from radixkv.kv.windowed import attend_exact

    cache = radixkv.RadixCache(2048 // p, p)
    hq, hkv = 8, 2
    kv = radixkv.KVCache(cache, 1, hkv, D, dtype=dtype, device=device, attention=attention)
    rng = np.random.default_rng(p)
    gen = torch.Generator(device="cpu").manual_seed(p)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    reqs = [cache.admit(rng.integers(0, 100, n)) for n in (5, 37, 70, 3)]
    step = kv.plan(reqs)
    step.attention(0, rand(step.num_tokens, hq, D), *(rand(step.num_tokens, hkv, D),) * 2)
    kv.commit(step)
    extras = [
        {"window": 3},
        {"window": 8},
        {"window": 100},
        {"softcap": 2.0},
        {"sinks": torch.linspace(-1, 1, hq, device=device)},
        {"window": 6, "softcap": 3.0},
        {"window": 6, "softcap": 3.0, "sinks": torch.linspace(1, -1, hq, device=device)},
    ]
    for _ in range(3):
        for r in reqs:
            cache.extend(r, [1])
        step = kv.plan(reqs)
        t = step.num_tokens
        q, k, v = rand(t, hq, D), rand(t, hkv, D), rand(t, hkv, D)
        for ex in extras:
            got = step.attention(0, q, k, v, **ex)
            want = attend_exact(
                step, 0, q, D**-0.5, ex.get("window"), ex.get("softcap"), ex.get("sinks")
            )
            torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
        kv.commit(step)
    cache.check()


@needs_flex
@pytest.mark.parametrize("p", [1, 4, 16])
def test_flex_decodes_windows_and_softcaps(p, monkeypatch):
    """Decode through flex with a sliding window (its block lists narrowed to the window's
    pages) and a softcap, exactly as the reference; sinks, which compiled flex on the CPU cannot
    take, through SDPA's groups for that layer."""
    calls = {"flex": [], "sdpa": []}
    for cls in (backends.FlexBackend, backends.SdpaBackend):
        orig = cls.attend

        def counted(self, *a, _orig=orig, _name=cls.name, **kw):
            extras = tuple(kw.get(x) is not None for x in ("window", "softcap", "sinks"))
            if len(a) > 7:  # positional extras
                extras = tuple(x is not None for x in a[7:10])
            calls[_name].append(extras)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(cls, "attend", counted)
    windowed_decode("flex", p=p)
    # Flex took every window and softcap; SDPA every call with sinks, and nothing else.
    assert (True, False, False) in calls["flex"] and (False, True, False) in calls["flex"]
    assert (True, True, False) in calls["flex"]
    assert all(not sinks for _, _, sinks in calls["flex"])
    assert calls["sdpa"] and all(sinks for _, _, sinks in calls["sdpa"][1:]), calls["sdpa"]


@needs_flex
def test_flex_window_block_lists_read_only_the_window():
    """A window narrows a request's block lists to the pages its query reads: full pages
    inside the window, the page the window starts inside and the last page masked."""
    cache = radixkv.RadixCache(64, 4)
    kv = radixkv.KVCache(cache, 1, 1, D, attention="flex")
    a, b = cache.admit(list(range(30))), cache.admit(list(range(100, 112)))
    step = kv.plan([a, b])
    kv.commit(step)
    for r in (a, b):
        cache.extend(r, [7])
    step = kv.plan([a, b])
    ((flex, g),) = step._groups
    assert flex.name == "flex"
    part_num, part_idx, full_num, full_idx = flex._kv_blocks(g, 9)
    # a: 31 tokens, its query at 30 reads keys 22..30: page 5 (20..23) from key 22 (masked),
    # page 6 whole, page 7 (28..30) masked. b: 13 tokens, keys 4..12: pages 1, 2 whole, page 3.
    pa, pb = [int(x) for x in a.pages], [int(x) for x in b.pages]
    assert full_num[:2, 0, 0].tolist() == [1, 2]
    assert full_idx[0, 0, 0, :1].tolist() == [pa[6]] and full_idx[1, 0, 0, :2].tolist() == pb[1:3]
    assert part_num[:2, 0, 0].tolist() == [2, 1]
    assert part_idx[0, 0, 0, :2].tolist() == [pa[5], pa[7]] and part_idx[1, 0, 0, 0] == pb[3]
    # Without a window: every full page, then the last.
    part_num, _, full_num, _ = flex._kv_blocks(g, None)
    assert full_num[:2, 0, 0].tolist() == [7, 3] and part_num[:2, 0, 0].tolist() == [1, 1]
    cache.abort(a)
    cache.abort(b)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("attention", ["flex", "varlen", "flashinfer"])
@pytest.mark.parametrize("p", [1, 16])
def test_cuda_backends_with_windows_softcaps_and_sinks(attention, p):
    """On CUDA, each backend decodes windows (varlen's ``window_size``, FlashInfer's
    ``window_left``, flex's block lists), softcaps (FlashInfer, flex) and sinks (flex) itself,
    the rest through SDPA's groups: all as the reference, in bf16."""
    if attention not in backends.available(torch.device("cuda")):
        pytest.skip(f"{attention} is not available on this machine")
    if attention == "flex" and p < 16:
        with pytest.raises(ValueError, match="at least 16 slots"):
            windowed_decode(attention, device="cuda", dtype=torch.bfloat16, atol=4e-2, p=p)
        return
    windowed_decode(attention, device="cuda", dtype=torch.bfloat16, atol=4e-2, p=p)
