"""Step.attention against attention written out by hand over each request's full K/V.

K and V are a fixed function of (token id, position), so the expected keys of any request are
known from its tokens alone, whichever request computed (and published) them first.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import radixkv
from tiny_model import CACHES, cuda

D = 16
VOCAB = 64


class Truth:
    """K/V as a function of (token, position) for every layer, and the reference attention."""

    def __init__(self, layers: int, hkv: int, device="cpu", seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.k_tok = torch.randn(layers, VOCAB, hkv, D, generator=g).to(device)
        self.v_tok = torch.randn(layers, VOCAB, hkv, D, generator=g).to(device)
        self.k_pos = torch.randn(layers, 512, hkv, D, generator=g).to(device)
        self.device = device

    def kv(self, layer: int, tokens: torch.Tensor, positions: torch.Tensor):
        return (
            self.k_tok[layer][tokens] + self.k_pos[layer][positions],
            self.v_tok[layer][tokens] - self.k_pos[layer][positions],
        )

    def attend(self, layer, req, q: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        """Queries at positions ``start..num_tokens`` of ``req`` over all its keys up to each."""
        n = req.num_tokens
        toks = torch.from_numpy(req.tokens.astype(np.int64)).to(self.device)
        k, v = self.kv(layer, toks, torch.arange(n, device=self.device))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
        pos = torch.arange(start, n, device=self.device)
        allowed = torch.arange(n, device=self.device)[None, :] <= pos[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, v)


def check_page_tables(step, reqs, page_size):
    """The step's page tables say exactly what each request's ``pages`` and lengths say."""
    bt = step.block_table.cpu().numpy()
    indptr = step.paged_kv_indptr.cpu().numpy()
    indices = step.paged_kv_indices.cpu().numpy()
    for b, r in enumerate(reqs):
        n = -(-r.num_tokens // page_size)
        assert (bt[b, :n] == r.pages[:n]).all()
        assert (indices[indptr[b] : indptr[b + 1]] == r.pages[:n]).all()
        assert step.seq_lens[b] == r.num_tokens
        assert step.paged_kv_last_page_len[b] == r.num_tokens - (n - 1) * page_size
        assert (step.kv_slots[b, : r.num_tokens].cpu().numpy() == r.slots).all()
    assert step.qo_indptr.tolist() == [0, *np.cumsum(step.q_len_list).tolist()]
    assert all(t.dtype == torch.int32 for t in (step.block_table, step.seq_lens, step.qo_indptr))


def run_step(kv, truth, reqs, hq, atol, scale=None, dtype=torch.float32, seed=0):
    """Plans ``reqs``, runs every layer's attention, compares, commits; returns the step."""
    step = kv.plan(reqs)
    check_page_tables(step, reqs, kv.page_size)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(step.num_tokens, hq, D, generator=g).to(kv.device, dtype)
    starts = [r.num_computed for r in reqs]
    eff = scale if scale is not None else 1 / math.sqrt(D)
    for layer in range(kv.num_layers):
        k, v = truth.kv(layer, step.input_ids, step.positions)
        out = step.attention(layer, q, k.to(dtype), v.to(dtype), scale=scale)
        assert out.shape == (step.num_tokens, hq, D) and out.dtype == dtype
        row = 0
        for req, start, n in zip(reqs, starts, step.q_len_list):
            want = truth.attend(layer, req, q[row : row + n].float(), start, eff)
            torch.testing.assert_close(out[row : row + n].double(), want, atol=atol, rtol=0)
            row += n
        # The new K/V sit in the pool at the planned slots.
        torch.testing.assert_close(kv.k[layer][step.write_slots], k.to(kv.dtype))
    kv.commit(step)
    assert [r.num_computed for r in reqs] == [r.num_tokens for r in reqs]
    return step


def scenario(make_cache, hq, hkv, device="cpu", dtype=torch.float32, atol=1e-5, attention="sdpa"):
    """Fresh prefill; then prefill over a cached prefix + fresh prompt + decode in one step;
    decode-only steps of unequal and equal lengths; and forked branches. Returns the backends
    each step ran."""
    cache = make_cache(1024)
    kv = radixkv.KVCache(
        cache,
        num_layers=2,
        num_kv_heads=hkv,
        head_dim=D,
        dtype=dtype,
        device=device,
        attention=attention,
    )
    ran = []
    truth = Truth(2, hkv, device)
    rng = np.random.default_rng(1)
    tok = lambda n: rng.integers(0, VOCAB, n)  # noqa: E731
    a = cache.admit(tok(40))
    s = run_step(kv, truth, [a], hq, atol)
    assert s.is_fresh_prefill
    ran.append(s.backends)

    b = cache.admit(np.concatenate([a.tokens[:35], tok(9)]))
    assert b.num_cached == 35 // cache.page_size * cache.page_size  # the hit under test
    c = cache.admit(tok(23))
    cache.extend(a, tok(1))
    s = run_step(kv, truth, [b, c, a], hq, atol, seed=1)
    assert (s.max_q_len, s.max_kv_len) == (23, 44)
    ran.append(s.backends)

    for r in (a, b, c):
        cache.extend(r, tok(1))
    s = run_step(kv, truth, [a, b, c], hq, atol, scale=0.3, seed=2)
    assert s.is_decode and s.max_kv_len == 45
    ran.append(s.backends)

    d = cache.admit(np.concatenate([a.tokens[:20], tok(22)]))
    run_step(kv, truth, [d], hq, atol, seed=3)
    for r in (a, d):
        cache.extend(r, tok(1))
    s = run_step(kv, truth, [a, d], hq, atol, seed=4)
    assert s.is_decode
    ran.append(s.backends)

    branches = [cache.fork(a) for _ in range(3)]
    assert all(br.num_cached >= 32 for br in branches)
    for i, br in enumerate(branches):
        cache.extend(br, tok(2 + 3 * i))
    cache.extend(b, tok(5))
    ran.append(run_step(kv, truth, [*branches, b], hq, atol, seed=5).backends)
    for br in branches[:2]:
        cache.extend(br, tok(1))
    ran.append(run_step(kv, truth, branches[:2], hq, atol, seed=6).backends)  # forks decoding
    cache.check()
    return ran


HEADS = [pytest.param(4, 4, id="mha"), pytest.param(8, 2, id="gqa"), pytest.param(4, 1, id="mqa")]


@pytest.mark.parametrize("make_cache", CACHES)
@pytest.mark.parametrize(("hq", "hkv"), HEADS)
def test_matches_reference(make_cache, hq, hkv):
    scenario(make_cache, hq, hkv)


def test_gqa_without_sdpa_enable_gqa(monkeypatch):
    """The repeat_interleave path taken on torch < 2.5."""
    from radixkv.kv.backends import sdpa_backend

    monkeypatch.setattr(sdpa_backend, "SDPA_GQA", False)
    scenario(CACHES[1].values[0], 8, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_pools(dtype):
    scenario(lambda n: radixkv.RadixCache(n // 4, page_size=4), 8, 2, dtype=dtype, atol=4e-2)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("make_cache", CACHES)
def test_cuda_bfloat16(make_cache):
    scenario(make_cache, 8, 2, device="cuda", dtype=torch.bfloat16, atol=4e-2)


def test_shapes_and_layers_are_checked():
    cache = radixkv.RadixCache(16)
    kv = radixkv.KVCache(cache, num_layers=1, num_kv_heads=2, head_dim=D)
    step = kv.plan([cache.admit([1, 2, 3])])
    q, k = torch.zeros(3, 4, D), torch.zeros(3, 2, D)
    with pytest.raises(ValueError, match="layer must be in"):
        step.attention(1, q, k, k)
    with pytest.raises(ValueError, match="q must be"):
        step.attention(0, torch.zeros(3, 3, D), k, k)
    with pytest.raises(ValueError, match="v must be"):
        step.attention(0, q, k, torch.zeros(2, 2, D))
    with pytest.raises(ValueError, match="at least one request"):
        kv.plan([])


def test_pool_layout_and_sizing():
    cache = radixkv.BlockCache(10, page_size=16)
    kv = radixkv.KVCache(cache, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    assert kv.k[2].shape == (160, 2, 8) and kv.v[0].dtype == torch.bfloat16
    assert kv.nbytes == 2 * 3 * 160 * 2 * 8 * 2
    per_page = radixkv.KVCache.bytes_per_page(3, 2, 8, torch.bfloat16, 16)
    assert per_page == 2 * 3 * 2 * 8 * 2 * 16
    assert radixkv.KVCache.pages_for_budget(10 * per_page + 5, 3, 2, 8, torch.bfloat16, 16) == 10
    with pytest.raises(ValueError, match="smaller than one page"):
        radixkv.KVCache.pages_for_budget(per_page - 1, 3, 2, 8, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        radixkv.KVCache(cache, 1, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int, got 0"):
        radixkv.KVCache(cache, 1, 0, 8)
    with pytest.raises(TypeError, match="RadixCache or BlockCache"):
        radixkv.KVCache("cache", 1, 1, 8)


SPLIT_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, cuda]),
]


@pytest.mark.parametrize("device", SPLIT_DEVICES)
@pytest.mark.parametrize(("hq", "hkv"), [(8, 2), (4, 4)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_one_request_over_its_cached_prefix_splits_exactly(hq, hkv, page_size, device, monkeypatch):
    """A lone request's prefill over a long cached prefix runs as two partial attentions
    merged by their log-sum-exps (the prefix unmasked, the new tokens causal): the same output
    as the reference. On the CPU (float32) short prefills and prefixes keep the masked SDPA
    call; on CUDA every prefill over a cached prefix splits (no mask is built there)."""
    from radixkv.kv.backends import sdpa_backend
    from radixkv.kv.windowed import attend_exact

    if device == "cpu" and sdpa_backend._FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash kernel returning the log-sum-exp")
    calls = []
    real = sdpa_backend._cached_prefill
    monkeypatch.setattr(
        sdpa_backend, "_cached_prefill", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    cache = radixkv.RadixCache(4096 // page_size, page_size=page_size)
    kv = radixkv.KVCache(
        cache, num_layers=1, num_kv_heads=hkv, head_dim=D, attention="sdpa", device=device
    )
    g = torch.Generator().manual_seed(page_size + hq)
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, VOCAB, 400)
    first = cache.admit(trunk)
    step = kv.plan([first])
    n = step.num_tokens
    step.attention(
        0,
        torch.randn(n, hq, D, generator=g).to(device),
        *(torch.randn(n, hkv, D, generator=g).to(device),) * 2,
    )
    kv.commit(step)
    cache.finish(first)
    for new in (70, 8):  # split, then too short to split
        r = cache.admit(np.concatenate([trunk, rng.integers(0, VOCAB, new)]))
        step = kv.plan([r])
        t = step.num_tokens
        q = torch.randn(t, hq, D, generator=g).to(device)
        k = torch.randn(t, hkv, D, generator=g).to(device)
        v = torch.randn(t, hkv, D, generator=g).to(device)
        got = step.attention(0, q, k, v, 0.2)
        want = attend_exact(step, 0, q, 0.2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        cache.abort(r)
    # The 70 new tokens over the 400 cached split; on the CPU the 8 did not.
    assert calls == ([70] if device == "cpu" else [70, 8])
