"""The paged Triton kernels against SDPA over gathered keys (fp32, <= 1e-5): GQA and not,
pages of 1 and 16, ragged lengths (a one-token and a long request together), several splits,
mixed prefill/decode launches, padded rows, windows, softcaps, sinks; every slot no request
owns holds NaN, which must never reach an output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from triton_device import DEVICE

pytestmark = pytest.mark.cuda


def kernels():
    from radixkv.kv.backends import triton_kernels

    return triton_kernels


class Pool:
    """Requests of ``lens`` keys on shuffled pages of a NaN-filled pool, their newest
    ``q_lens`` tokens the queries."""

    def __init__(self, lens, q_lens, p, hq, hkv, d, dtype=torch.float32, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.q_lens, self.p, self.hq, self.hkv, self.d = lens, q_lens, p, hq, hkv, d
        width = max(-(-n // p) for n in lens) + 2  # padding columns past every request
        pages = len(lens) * width + 3
        perm = torch.randperm(pages, generator=gen)
        self.block_table = perm[: len(lens) * width].view(len(lens), width).to(torch.int32)
        self.k = torch.full((pages * p, hkv, d), float("nan"))
        self.v = torch.full((pages * p, hkv, d), float("nan"))
        for b, n in enumerate(lens):
            s = self.slots(b)
            self.k[s] = torch.randn(n, hkv, d, generator=gen)
            self.v[s] = torch.randn(n, hkv, d, generator=gen)
        self.q = torch.randn(sum(q_lens), hq, d, generator=gen)
        self.dtype = dtype
        self.k, self.v, self.q = (x.to(DEVICE, dtype) for x in (self.k, self.v, self.q))
        self.block_table = self.block_table.to(DEVICE)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)

    def slots(self, b: int) -> torch.Tensor:
        j = torch.arange(self.lens[b])
        return self.block_table[b].cpu().long()[j // self.p] * self.p + j % self.p

    def reference(self, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
        """SDPA over each request's gathered keys (explicit fp64 scores with softcaps/sinks)."""
        out, row = [], 0
        for b, (n, m) in enumerate(zip(self.lens, self.q_lens)):
            s = self.slots(b).to(DEVICE)
            k, v = self.k[s].double(), self.v[s].double()  # [n, Hkv, D]
            q = self.q[row : row + m].double()
            row += m
            pos = torch.arange(n - m, n, device=DEVICE)[:, None]
            j = torch.arange(n, device=DEVICE)[None, :]
            seen = j <= pos
            if window is not None:
                seen &= j > pos - window
            g = self.hq // self.hkv
            if softcap is None and sinks is None:
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1),
                    k.repeat_interleave(g, 1).transpose(0, 1),
                    v.repeat_interleave(g, 1).transpose(0, 1),
                    attn_mask=seen,
                    scale=scale,
                )
                out.append(o.transpose(0, 1))
                continue
            kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            sc = torch.einsum("qhd,khd->hqk", q, kk) * scale
            if softcap is not None:
                sc = torch.tanh(sc / softcap) * softcap
            sc = sc.masked_fill(~seen, float("-inf"))
            if sinks is not None:
                sink = sinks.double().view(-1, 1, 1).expand(-1, m, 1)
                pr = torch.softmax(torch.cat([sc, sink], -1), -1)[..., :-1]
            else:
                pr = torch.softmax(sc, -1)
            out.append(torch.einsum("hqk,khd->qhd", pr, vv))
        return torch.cat(out)

    def run(self, scale, splits=None, min_split=16, mixed=False, **extras) -> torch.Tensor:
        """The decode kernel when every request has one query; else the prefill kernel over
        every request, or with ``mixed`` a mixed launch (prefill tiles for the requests of
        several queries, the decode kernel at ``splits`` for the others)."""
        tk = kernels()
        if all(m == 1 for m in self.q_lens):
            return tk.paged_decode(
                self.q, self.k, self.v, self.block_table, self.seq_lens, scale, self.p,
                splits=splits, min_split=min_split, **extras,
            )  # fmt: skip
        block_q = tk.prefill_block_q(self.hq // self.hkv, max(self.q_lens))
        qo = np.concatenate([[0], np.cumsum(self.q_lens)])

        def ints(x):
            return torch.tensor(x, dtype=torch.int32, device=DEVICE)

        qo_t = ints(qo)
        if mixed:
            req, q0, dec, tok = tk.mixed_tiles(self.q_lens, qo.tolist(), block_q)
            return tk.paged_mixed(
                self.q, self.k, self.v, self.block_table, self.seq_lens, qo_t,
                (ints(req), ints(q0)), block_q, (ints(dec), ints(tok)), scale, self.p,
                splits=splits, **extras,
            )  # fmt: skip
        req, q0 = tk.prefill_tiles(self.q_lens, block_q)
        return tk.paged_prefill(
            self.q, self.k, self.v, self.block_table, self.seq_lens, qo_t,
            (ints(req), ints(q0)), block_q, scale, self.p, **extras,
        )  # fmt: skip


HEADS = [pytest.param((8, 2), id="gqa"), pytest.param((4, 4), id="mha")]
PAGES = [pytest.param(1, id="p1"), pytest.param(16, id="p16")]


def check(pool: Pool, atol=1e-5, **kw):
    scale = pool.d**-0.5
    extras = {k: v for k, v in kw.items() if k in ("window", "softcap", "sinks")}
    got = pool.run(scale, **kw)
    assert got.shape == pool.q.shape and got.dtype == pool.dtype
    assert not got.isnan().any()
    want = pool.reference(scale, **extras)
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("p", PAGES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_ragged(heads, p, splits):
    """A one-token request beside a long one and two between, over 1 or 4 splits (the long
    request fills all four, the short ones leave splits empty)."""
    hq, hkv = heads
    check(Pool([1, 90, 17, 33], [1, 1, 1, 1], p, hq, hkv, 32), splits=splits)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("p", PAGES)
def test_prefill_mixed_with_decode_rows(heads, p):
    """One launch: a prefill over a cached prefix, a fresh prompt, two decode rows."""
    hq, hkv = heads
    check(Pool([60, 23, 41, 1], [12, 23, 1, 1], p, hq, hkv, 32))


MIXED = [
    # (key counts, new tokens): decode rows first, last and between prefill chunks; a long
    # decode row (several key blocks a split) beside a one-key one; a one-token prefill of
    # a fresh prompt (a decode row too: one query at its last key)
    pytest.param(([60, 23, 41, 1], [12, 23, 1, 1]), id="rows-last"),
    pytest.param(([130, 40, 7, 300, 1], [1, 9, 1, 1, 1]), id="rows-around-a-chunk"),
    pytest.param(([5, 90, 64], [1, 33, 1]), id="rows-first"),
]


@pytest.mark.parametrize("lens", MIXED)
@pytest.mark.parametrize(
    ("hq", "hkv", "p", "splits"),
    [(8, 2, 1, 4), (8, 2, 16, 1), (4, 4, 4, 4), (4, 4, 1, 1), (16, 1, 16, 4), (16, 1, 4, 1)],
    ids=["gqa-p1-s4", "gqa-p16-s1", "mha-p4-s4", "mha-p1-s1", "g16-p16-s4", "g16-p4-s1"],
)
def test_mixed_decode_rows_on_the_split_kernel(lens, hq, hkv, p, splits):
    """A mixed step: prefill chunks through the prefill kernel, the decode rows through the
    split-KV kernel (one split: written directly; four: merged), into one output."""
    check(Pool(*lens, p, hq, hkv, 32), mixed=True, splits=splits)


@pytest.mark.parametrize("d", [16, 40, 64])
def test_mixed_head_dims(d):
    check(Pool([70, 12, 1, 33], [1, 12, 1, 1], 4, 8, 2, d), mixed=True, splits=4)


@pytest.mark.parametrize("splits", [1, 4])
def test_mixed_windows_softcaps_and_sinks(splits):
    sinks = torch.linspace(-1, 1, 8, device=DEVICE)
    for kw in ({"window": 3}, {"window": 100}, {"softcap": 2.0}, {"sinks": sinks},
               {"window": 6, "softcap": 3.0, "sinks": sinks}):  # fmt: skip
        check(Pool([50, 30, 5, 1], [1, 30, 1, 1], 4, 8, 2, 32), mixed=True, splits=splits, **kw)


def test_mixed_decode_rows_write_only_their_own_rows():
    """The decode launch of a mixed step writes the decode rows' outputs and no other row:
    the prefill rows keep what the prefill launch wrote, and rows a launch does not own
    keep what ``out`` held."""
    tk = kernels()
    pool = Pool([40, 20, 9], [1, 20, 1], 4, 8, 2, 32)
    scale = pool.d**-0.5
    want = pool.reference(scale)
    out = torch.full_like(pool.q, 7.0)
    rows = tuple(torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in ([0, 2], [0, 21]))
    tk.paged_decode(
        pool.q, pool.k, pool.v, pool.block_table, pool.seq_lens, scale, pool.p,
        splits=2, rows=rows, out=out,
    )  # fmt: skip
    torch.testing.assert_close(out[[0, 21]].double(), want[[0, 21]], atol=1e-5, rtol=0)
    assert (out[1:21] == 7.0).all()


def test_head_dim_not_a_power_of_two_and_many_query_heads():
    check(Pool([40, 7], [9, 1], 4, 16, 1, 40))
    check(Pool([40, 7], [1, 1], 4, 16, 1, 40), splits=2)


@pytest.mark.parametrize("window", [3, 8, 100])
def test_windows(window):
    check(Pool([50, 45, 5], [1, 1, 1], 4, 8, 2, 32), splits=4, window=window)
    check(Pool([50, 45, 5], [30, 1, 5], 4, 8, 2, 32), window=window)


def test_softcaps_and_sinks():
    sinks = torch.linspace(-1, 1, 8, device=DEVICE)
    for kw in ({"softcap": 2.0}, {"sinks": sinks}, {"window": 6, "softcap": 3.0, "sinks": sinks}):
        check(Pool([50, 45, 5], [1, 1, 1], 16, 8, 2, 32), splits=4, **kw)
        check(Pool([50, 45, 5], [1, 1, 1], 16, 8, 2, 32), splits=1, **kw)  # no merge
        check(Pool([50, 45, 5], [20, 1, 5], 16, 8, 2, 32), **kw)


def test_padded_decode_rows_are_zero_and_touch_nothing():
    """A padded row (no keys: a batch bucket's filler) gives zeros, not NaN, beside real rows
    that are unchanged by it."""
    pool = Pool([30, 1, 12], [1, 1, 1], 16, 8, 2, 32)
    want = pool.run(pool.d**-0.5, splits=2)
    pool.seq_lens[1] = 0
    got = pool.run(pool.d**-0.5, splits=2)
    assert got[1].abs().max() == 0
    torch.testing.assert_close(got[[0, 2]], want[[0, 2]], atol=0, rtol=0)


def test_prefill_blocks_before_the_diagonal_unmasked():
    """Long cached prefixes (several key blocks before each tile's first token, read without a
    mask) and tiles whose diagonal falls inside a block, beside a short request and a decode
    row."""
    check(Pool([200, 150, 1], [70, 3, 1], 16, 8, 2, 32))
    check(Pool([200, 150, 1], [70, 3, 1], 1, 8, 2, 32))


def test_decode_splits_follow_the_key_count():
    """A request's key blocks are spread over as many splits as it has blocks, up to the bound
    (no floor of a few hundred keys a split), each split whole blocks: the others are left
    empty (a log-sum-exp of -inf), and the output is exact."""
    tk = kernels()
    pool = Pool([130, 20, 300], [1, 1, 1], 16, 8, 2, 32)
    block = tk.decode_config(tk.arch_of(torch.device(DEVICE)), pool.dtype, pool.d).block_n
    splits = 4
    o = torch.empty((3, 8, splits, 32), dtype=torch.float32, device=DEVICE)
    lse = torch.empty((3, 8, splits), dtype=torch.float32, device=DEVICE)
    scale = pool.d**-0.5
    got = tk.paged_decode(
        pool.q, pool.k, pool.v, pool.block_table, pool.seq_lens, scale, pool.p,
        splits=splits, scratch=(o, lse),
    )  # fmt: skip
    torch.testing.assert_close(got.double(), pool.reference(scale), atol=1e-5, rtol=0)
    for b, n in enumerate(pool.lens):
        blocks = -(-n // block)
        per = -(-blocks // min(blocks, splits))  # blocks a split
        used = -(-blocks // per)
        assert lse[b].isfinite().sum(-1).tolist() == [used] * 8, (n, lse[b])


def test_decode_merges_more_splits_than_one_merge_block():
    """More splits than the merge kernel reads at a time: every chunk counts."""
    tk = kernels()
    assert tk.MERGE_BLOCK < 32
    check(Pool([1100, 5], [1, 1], 16, 8, 2, 32), splits=32, min_split=None)


def test_split_bound_grows_past_32_for_few_kv_heads():
    """Few requests x KV heads get more splits than 32 (the device kept busy), many get one."""
    tk = kernels()
    assert tk.split_bound(1, 8, 132) == 64  # 2 x 132 programs over 8 KV heads
    assert tk.split_bound(1, 1, 132) == tk.MAX_SPLITS
    assert tk.split_bound(64, 8, 132) == 1
    for b in (1, 2, 3, 8, 33, 64, 256):
        s = tk.split_bound(b, 8, 108)
        assert s & (s - 1) == 0 and 1 <= s <= tk.MAX_SPLITS


def test_splits_are_a_grid_bound_fixed_by_the_batch():
    """The split count depends on the batch size (and the device) only, never on lengths."""
    tk = kernels()
    dev = torch.device(DEVICE)
    for b in (1, 8, 64):
        s = tk.decode_splits(b, 8, dev)
        assert s & (s - 1) == 0 and 1 <= s <= tk.MAX_SPLITS
    assert tk.decode_splits(1, 8, dev) >= tk.decode_splits(64, 8, dev)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    """bf16/fp16 pools: within the inputs' rounding of the fp64 reference."""
    check(Pool([60, 23, 1], [12, 1, 1], 16, 8, 2, 64, dtype=dtype), atol=2e-2)
    check(Pool([60, 23, 1], [12, 1, 1], 16, 8, 2, 64, dtype=dtype), atol=2e-2, mixed=True,
          splits=2)  # fmt: skip
    check(Pool([60, 23, 1], [1, 1, 1], 16, 8, 2, 64, dtype=dtype), atol=2e-2, splits=2)


@pytest.mark.slow
@pytest.mark.parametrize("p", [1, 16])
def test_llama_sized(p):
    """Llama-3-8B's heads (32 over 8, head dim 128) at a few hundred keys."""
    check(Pool([300, 129, 1], [1, 1, 1], p, 32, 8, 128), splits=4, min_split=None)
    check(Pool([300, 129, 1], [64, 1, 1], p, 32, 8, 128))
    check(Pool([300, 129, 1], [64, 1, 1], p, 32, 8, 128), mixed=True, splits=4)


def test_every_gpu_family_has_its_table_entries():
    """Compute capabilities map to the table's families (sm_86/89 and sm_120 to their own:
    99 KB of shared memory a block, where sm_80's and sm_100's entries spill), each with an
    entry for both precisions and every head dim."""
    tk = kernels()
    got = {cc: tk.family(cc) for cc in (80, 86, 87, 89, 90, 100, 103, 110, 120, 121)}
    assert got == {80: 80, 86: 86, 87: 80, 89: 86, 90: 90, 100: 100, 103: 100, 110: 100,
                   120: 120, 121: 120}  # fmt: skip
    for arch in tk.ARCHS:
        for dtype in (torch.float32, torch.bfloat16):
            for d in (16, 32, 64, 128, 256):
                assert tk.decode_config(arch, dtype, d) and tk.prefill_config(arch, dtype, d)
    # Where sm_80's and sm_100's entries spill on the 99 KB parts (tests/triton/aot.py).
    assert tk.prefill_config(86, torch.bfloat16, 128) != tk.prefill_config(80, torch.bfloat16, 128)
    assert tk.prefill_config(120, torch.bfloat16, 256).num_warps == 8
