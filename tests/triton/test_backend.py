"""``KVCache(attention="triton")`` end to end: steps against the reference (fresh prefill, a
mixed step's prefill and decode rows each on its kernel, decodes, forks), windows, softcaps
and sinks in the kernels, and the engine and the transformers adapter giving the same greedy
tokens as SDPA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from test_attention import HEADS, scenario
from test_attention_backends import windowed_decode
from tiny_model import CACHES, dense_greedy, ids, tiny_model
from triton_device import DEVICE

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("make_cache", CACHES)
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_steps_match_reference(make_cache, hq, hkv):
    ran = scenario(make_cache, hq, hkv, device=DEVICE, attention="triton")
    # Every step, the mixed one (prefill over a cached prefix + fresh prompt + decode) too,
    # is one group through the kernels.
    assert ran == [["triton"]] * 6


@pytest.mark.parametrize("p", [1, 4, 16])
def test_windows_softcaps_and_sinks_run_in_the_kernels(p, monkeypatch):
    """Every extra decodes through the Triton kernels: SDPA is never called."""
    from radixkv.kv.backends import SdpaBackend

    def refuse(*a, **kw):
        raise AssertionError("a triton pool attended through SDPA")

    monkeypatch.setattr(SdpaBackend, "attend", refuse)
    windowed_decode("triton", device=DEVICE, p=p)


@pytest.mark.parametrize("splits", [1, 4])
def test_a_mixed_steps_decode_rows_run_on_the_split_kernel(splits, monkeypatch):
    """A prefill beside two decode rows, with and without a window and sinks: per layer the
    prefill kernel over the prefill's tiles only and the split-KV decode kernel over the
    decode rows, as the reference. ``splits``: the decode rows' bound (off CUDA the device's
    is 1; 4 runs the merge and the scratch, shared with the next decode step's)."""
    from radixkv.kv.backends import triton_kernels as tk
    from radixkv.kv.windowed import attend_exact

    launches = []
    real_prefill, real_decode = tk.paged_prefill, tk.paged_decode

    def prefill(*a, **kw):
        launches.append(("prefill", sorted(set(a[6][0].tolist()))))  # the tiles' requests
        return real_prefill(*a, **kw)

    def decode(*a, **kw):
        rows = kw.get("rows")
        launches.append(("decode", None if rows is None else rows[1].tolist(), kw["splits"]))
        return real_decode(*a, **kw)

    monkeypatch.setattr(tk, "paged_prefill", prefill)
    monkeypatch.setattr(tk, "paged_decode", decode)
    monkeypatch.setattr(tk, "decode_splits", lambda b, hkv, device: splits)
    cache = radixkv.RadixCache(256, page_size=4)
    kv = radixkv.KVCache(cache, 2, 2, 16, device=DEVICE, attention="triton")
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)

    def qkv(step):
        return [torch.randn(step.num_tokens, h, 16, generator=gen).to(DEVICE) for h in (8, 2, 2)]

    a, c = cache.admit(rng.integers(0, 50, 70)), cache.admit(rng.integers(50, 99, 9))
    step = kv.plan([a, c])
    for layer in (0, 1):
        step.attention(layer, *qkv(step))
    kv.commit(step)
    cache.extend(a, [3])
    cache.extend(c, [4])
    b = cache.admit(rng.integers(0, 50, 21))
    step = kv.plan([a, b, c])
    assert step.backends == ["triton"] and step.q_len_list == [1, 21, 1]
    sinks = torch.linspace(-1, 1, 8, device=DEVICE)
    for layer, extras in ((0, {"window": 5, "sinks": sinks}), (1, {})):
        q, k, v = qkv(step)
        launches.clear()
        got = step.attention(layer, q, k, v, **extras)
        # The prefill's tiles (request 1 alone), then the decode rows at tokens 0 and 22.
        assert launches == [("prefill", [1]), ("decode", [0, 22], splits)]
        want = attend_exact(step, layer, q, 16**-0.5, extras.get("window"), None,
                            extras.get("sinks"))  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    kv.commit(step)
    for r, tok in ((a, 5), (b, 6), (c, 7)):
        cache.extend(r, [tok])
    step = kv.plan([a, b, c])  # a decode step after it: its own rows, the same scratch
    q, k, v = qkv(step)
    launches.clear()
    got = step.attention(0, q, k, v)
    assert launches == [("decode", None, splits)]
    torch.testing.assert_close(got, attend_exact(step, 0, q, 16**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make_cache", CACHES)
def test_engine_greedy_tokens_equal_sdpa_and_the_oracle(make_cache):
    model = tiny_model(seed=11, device=DEVICE)
    rng = np.random.default_rng(3)
    system = ids(rng, 40)
    prompts = [np.concatenate([system, ids(rng, n)]) for n in (5, 17, 1)] + [ids(rng, 23)]
    outs = {}
    for attention in ("triton", "sdpa"):
        cache = make_cache(1024)
        kv = model.make_kv_cache(cache, attention=attention)
        eng = radixkv.Engine(model, kv, token_budget=48, max_batch=4)
        first = eng.generate(prompts[:1], max_new_tokens=5)  # publish the shared prefix
        results = first + eng.generate(prompts[1:], max_new_tokens=5)
        outs[attention] = [r.output for r in results]
        eng.cache.check()
    assert outs["triton"] == outs["sdpa"]
    assert outs["triton"][1] == dense_greedy(model, prompts[1], 5)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_hf_engine_greedy_tokens_equal_sdpa(arch):
    """A transformers model through radixkv.hf with the Triton kernels: the tokens SDPA's
    engine gives (Gemma 2: windows and softcaps in the kernels)."""
    pytest.importorskip("transformers")
    import radixkv.hf

    if arch == "gemma2":
        from test_hf_window import build

        model = build("gemma2", seed=7)
    else:
        from hf_models import build_model

        model = build_model("llama", seed=5).eval()
    model = model.to(DEVICE)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).astype(np.uint32) for n in (19, 6)]
    outs = {}
    for attention in ("triton", "sdpa"):
        eng = radixkv.hf.engine(
            model, radixkv.RadixCache(256, page_size=4), token_budget=32, attention=attention
        )
        assert eng.kv.attention == attention
        outs[attention] = [r.output for r in eng.generate(prompts, max_new_tokens=4)]
    assert outs["triton"] == outs["sdpa"]


def test_warmup_compiles_without_touching_the_pool():
    cache = radixkv.RadixCache(64, page_size=4)
    kv = radixkv.KVCache(cache, 2, 2, 16, device=DEVICE, attention="triton")
    kv.k[0].fill_(float("nan"))
    assert kv.warmup(num_heads=8, batch_sizes=[4, 1, 4]) == [1, 4]
    assert kv.k[0].isnan().all() and not kv.k[1].any()
    kv.k[0].zero_()
    r = cache.admit(np.arange(9))
    step = kv.plan([r])
    q = torch.randn(9, 8, 16, device=DEVICE)
    assert not step.attention(0, q, q[:, :2], q[:, :2]).isnan().any()


@pytest.mark.parametrize("arch", ["mistral-swa", "gemma2"])
@pytest.mark.parametrize("page", [1, 16])
def test_window_pool_layers_run_in_the_kernels(arch, page, monkeypatch):
    """A cache with a window group: the window layers read their own pool through the
    kernels too (SDPA never called), with the greedy tokens of an SDPA pool."""
    pytest.importorskip("transformers")
    import radixkv.hf
    from radixkv.kv.backends import SdpaBackend
    from test_hf_window import WINDOW, build

    model = build(arch, seed=7).to(DEVICE)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).astype(np.uint32) for n in (3 * WINDOW, 5)]

    def cache():
        pages = 512 // page
        return radixkv.RadixCache(pages, page_size=page, window=WINDOW, window_pages=pages)

    sdpa = radixkv.hf.engine(model, cache(), token_budget=32, attention="sdpa")
    want = [r.output for r in sdpa.generate(prompts, max_new_tokens=5)]
    eng = radixkv.hf.engine(model, cache(), token_budget=32, attention="triton")
    assert eng.kv.window_layers

    def refuse(*a, **kw):
        raise AssertionError("a triton pool attended through SDPA")

    monkeypatch.setattr(SdpaBackend, "attend", refuse)
    assert [r.output for r in eng.generate(prompts, max_new_tokens=5)] == want


def test_tile_and_row_tensors_start_16_bytes_apart():
    """The prefill tiles and decode rows of a step come from one copy, each part 16-byte
    aligned whatever the lengths before it: Triton compiles a kernel again for a pointer that
    is not (and the ahead-of-time check compiles the aligned one)."""
    from radixkv.kv.backends.triton_backend import _packed

    lists = [[7], [1, 2], [3, 4, 5], [], [6, 7, 8, 9, 10]]
    parts = _packed(lists, torch.device(DEVICE))
    assert [t.tolist() for t in parts] == lists
    assert all(t.dtype == torch.int32 and t.data_ptr() % 16 == 0 for t in parts)
