"""Paged attention kernels in Triton that read K and V in the pool where they are.

The pool of a layer is ``[num_slots, Hkv, D]``; request ``b``'s key ``j`` lives at slot
``block_table[b, j // P] * P + j % P``. Nothing is gathered, no slot matrix or mask is built,
and nothing is shaped by the longest request:

```text
 decode (one query per request), split-KV:
   grid (B, Hkv, SPLITS)       program (b, h, s) reads keys [lo_s, hi_s) of request b, KV head h,
                               with h's G query heads packed as the rows of one 16-row tile
   -> partial out [B, Hq, SPLITS, D] and log-sum-exp [B, Hq, SPLITS] in fp32
   grid (B, Hq)                merges the splits (and a sink logit per head) by log-sum-exp,
                               16 splits at a time (SPLITS = 1: the output directly, no merge)

 prefill:
   grid (tiles, Hkv)           tile = up to BLOCK_Q new tokens of one request x G query heads;
                               keys [lo, hi) of that request, causal (and windowed) by position,
                               one online softmax over the cached prefix and the new tokens

 mixed steps (prefill chunks beside decode rows, requests of one new token):
   prefill, grid (tiles, Hkv)  the tiles of the requests of several new tokens only
   decode, grid (R, Hkv, SPLITS) and merge (R, Hq)
                               the R decode rows, row i read in place: request REQS[i]'s page
                               table row and length, query and output row TOKS[i]
```

The split count of a decode launch is a grid bound fixed by the batch size; each request
uses as many of them as its own length fills (one key block each at least), decided in the
kernel from ``seq_lens``: no host sync, and the grid of a batch size never changes (what a
CUDA graph needs). A launch of one split writes the output itself: no merge launch.

Tile sizes, warps and pipeline stages come from :data:`CONFIGS`, one entry per GPU
architecture, precision and head dim, chosen ahead of time: every entry compiles for its
target without spilling registers to local memory and within the target's shared memory
(``tests/triton/aot.py`` compiles each launch for sm_80, sm_90 and sm_100 and reads its
resources; no autotuning at run time, which a CUDA graph capture could not hold). The key loops
mask only the blocks that need it: decode its last block; prefill the blocks from the tile's
diagonal on (every key before its first token is seen by all its rows).

fp32 inputs use ``input_precision="ieee"`` (Triton's default, TF32, is not exact). Under
Triton's interpreter (``TRITON_INTERPRET=1``, kernels on CPU tensors) a bf16/fp16 ``tl.dot`` is
wrong (triton issue 11584): there the operands are cast to fp32 first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixkv.kv.backends.choice import interpreted

#: Most splits of a decode launch (when few requests x KV heads leave the device idle).
MAX_SPLITS = 128
#: Splits the merge kernel reads at a time.
MERGE_BLOCK = 16


@dataclass(frozen=True)
class Tiles:
    """A kernel's launch config: ``block_n`` keys a loop step, ``num_warps``, ``num_stages``
    (software-pipelined K/V blocks in flight) and, for prefill, ``block_m`` query rows a tile
    (a KV head's query heads x new tokens; 16 when every request has few new tokens)."""

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 16


#: (architecture, bits of the pool's dtype, head dim padded to a power of two) -> (decode,
#: prefill) tiles, for any group of query heads per KV head up to 16 (a tile's rows are fixed:
#: 16 for decode, ``block_m`` for prefill). Chosen from the AOT resource check
#: (``tests/triton/aot.py --sweep``): the largest tiles that compile with no local memory and
#: within the target's shared memory, with 16-byte async copies for half types (and wgmma for
#: sm_90's prefill). fp32 (exactness runs) takes 8 warps and 16-row tiles: 4 warps spill at
#: head dim 128 (decode 232 bytes a thread on sm_90, prefill 9-11 KB with 64-row tiles).
#: sm_80's half prefill takes 8 warps (4 spill), and 32-key blocks at 256 (69 KB of shared
#: memory); its fp32 prefill 4 warps up to 128. sm_100's half decode takes 3 stages up to head
#: dim 64. sm_86/89 (99 KB of shared memory a block, 128 registers a thread at 8 warps there)
#: take sm_80's, but at head dim 128 a half prefill of 32-key blocks and 4 warps (sm_80's
#: spills 16 bytes there) and an fp32 prefill of 8 warps. sm_120 (99 KB, no wgmma) takes
#: sm_100's, but at head dim 256 a half prefill of 8 warps (4 spill 32 bytes there).
CONFIGS: dict[tuple[int, int, int], tuple[Tiles, Tiles]] = {}

#: The architectures of :data:`CONFIGS` (compute capability x 10; see :func:`family`).
ARCHS = (80, 86, 90, 100, 120)

_HALF = {d: (Tiles(64, 4, 2), Tiles(64, 4, 2, 64)) for d in (16, 32, 64, 128)}
_HALF[256] = (Tiles(32, 4, 2), Tiles(32, 4, 2, 64))
_FP32 = {d: (Tiles(32, 8, 1), Tiles(32, 8, 1, 16)) for d in (16, 32, 64, 128, 256)}
for _arch in ARCHS:
    for _d in _FP32:
        CONFIGS[_arch, 16, _d] = _HALF[_d]
        CONFIGS[_arch, 32, _d] = _FP32[_d]
for _d in (16, 32, 64, 128):  # sm_80 half prefill: 4 warps spill (16 bytes at 64, 48 at 128)
    CONFIGS[80, 16, _d] = (_HALF[_d][0], Tiles(64, 8, 2, 64))
    if _d <= 64:  # sm_100 half decode: 2 stages spill 8 bytes at head dim 64
        CONFIGS[100, 16, _d] = (Tiles(64, 4, 3), _HALF[_d][1])
CONFIGS[80, 16, 256] = (Tiles(32, 4, 2), Tiles(32, 8, 2, 64))
for _d in (16, 32, 64, 128):  # sm_80 fp32 prefill: 8 warps spill 8 bytes at head dim 128
    CONFIGS[80, 32, _d] = (_FP32[_d][0], Tiles(32, 4, 1, 16))
for _key in [k for k in CONFIGS if k[0] in (80, 100)]:
    CONFIGS[{80: 86, 100: 120}[_key[0]], _key[1], _key[2]] = CONFIGS[_key]
CONFIGS[86, 16, 128] = (CONFIGS[80, 16, 128][0], Tiles(32, 4, 2, 64))
CONFIGS[86, 32, 128] = _FP32[128]  # sm_80's 4 warps spill 8 bytes there; 8 warps do not
CONFIGS[120, 16, 256] = (CONFIGS[100, 16, 256][0], Tiles(32, 8, 2, 64))


def family(cc: int) -> int:
    """The :data:`ARCHS` entry of compute capability ``cc`` (x 10): sm_86 and sm_89 86 (99 KB
    of shared memory a block), Hopper 90, data-center Blackwell 100 (sm_100 to sm_110), the
    consumer Blackwell parts from sm_120 on 120 (99 KB, no wgmma), anything else 80."""
    if cc >= 120:
        return 120
    if cc >= 100:
        return 100
    if cc >= 90:
        return 90
    return 86 if cc in (86, 89) else 80


def arch_of(device: torch.device) -> int:
    """The :data:`ARCHS` entry for ``device`` (:func:`family` of its compute capability);
    under Triton's interpreter 90, whose tile sizes the exactness tests then run."""
    if device.type != "cuda":
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return family(10 * major + minor)


def _config(kind: int, arch: int, dtype: torch.dtype, head_dim: int) -> Tiles:
    """The table's entry; head dims past 256 take 256's (not checked ahead of time)."""
    if arch not in ARCHS:
        raise ValueError(f"no Triton attention configs for architecture {arch}: have {ARCHS}")
    bits = 32 if dtype == torch.float32 else 16
    return CONFIGS[arch, bits, min(max(16, _pow2(head_dim)), 256)][kind]


def decode_config(arch: int, dtype: torch.dtype, head_dim: int) -> Tiles:
    """The decode tiles of :data:`CONFIGS` for a pool of ``dtype`` and ``head_dim``."""
    return _config(0, arch, dtype, head_dim)


def prefill_config(arch: int, dtype: torch.dtype, head_dim: int) -> Tiles:
    """The prefill tiles of :data:`CONFIGS` for a pool of ``dtype`` and ``head_dim``."""
    return _config(1, arch, dtype, head_dim)


@triton.jit
def _tanh(x):
    # tanh from exp, exact to fp32 rounding: sign(x) * (1 - e^-2|x|) / (1 + e^-2|x|)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, scale, softcap, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Scaled (and softcapped) scores of ``q`` [M, D] against ``k`` [N, D], fp32."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s


@triton.jit
def _load_kv(
    K, V, BT_ROW, j, jm, kh, d, dmask,
    stride_ks, stride_kh, stride_vs, stride_vh,
    P: tl.constexpr, UPCAST: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
):  # fmt: skip
    """Keys ``j`` of KV head ``kh`` of the request whose page-table row starts at ``BT_ROW``:
    ``[N, BLOCK_D]`` K and V blocks read where the pool holds them. ``MASKED``: only the keys
    where ``jm`` holds are read (the others are 0); ``EVEN_D``: the head dim fills the block
    (no mask across it)."""
    if MASKED:
        page = tl.load(BT_ROW + j // P, mask=jm, other=0)
    else:
        page = tl.load(BT_ROW + j // P)
    slot = page.to(tl.int64) * P + j % P
    k_ptr = K + slot[:, None] * stride_ks + kh * stride_kh + d[None, :]
    v_ptr = V + slot[:, None] * stride_vs + kh * stride_vh + d[None, :]
    if MASKED:
        if EVEN_D:
            k = tl.load(k_ptr, mask=jm[:, None], other=0.0)
            v = tl.load(v_ptr, mask=jm[:, None], other=0.0)
        else:
            k = tl.load(k_ptr, mask=jm[:, None] & dmask[None, :], other=0.0)
            v = tl.load(v_ptr, mask=jm[:, None] & dmask[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptr)
            v = tl.load(v_ptr)
        else:
            k = tl.load(k_ptr, mask=dmask[None, :], other=0.0)
            v = tl.load(v_ptr, mask=dmask[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _online(m, lsum, acc, sc, v, IEEE: tl.constexpr):
    """One step of the online softmax: the running max ``m``, sum ``lsum`` and output ``acc``
    of each row after the masked scores ``sc`` of a block whose values are ``v`` (a row that
    has seen no key yet keeps a max of -inf and adds nothing)."""
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, lsum, acc * alpha[:, None] + pv


@triton.jit
def _finish(m, lsum, acc, SINKS, heads, hmask, HAS_SINKS: tl.constexpr):
    """The normalized output of rows whose online softmax ended at ``m``, ``lsum``, ``acc``,
    with each row's head's sink logit joining the softmax (a row with no keys and no sink
    gives 0)."""
    if HAS_SINKS:
        sink = tl.load(SINKS + heads, mask=hmask, other=0.0).to(tl.float32)
        mx = tl.maximum(m, sink)
        a = tl.exp(m - mx)
        lsum = lsum * a + tl.exp(sink - mx)
        acc = acc * a[:, None]
    return acc / tl.where(lsum == 0.0, 1.0, lsum)[:, None]


# Runtime integers that change from step to step are not specialized: Triton compiles a
# variant of a kernel for each integer argument equal to 1 or divisible by 16, so a block
# table's width (the step's longest request in pages) or the scratch's strides (the split
# count) would compile new variants while serving. The ones fixed for a pool and a model (the
# pool's and the queries' strides) keep their specialization; so do pointers, which the step
# hands over 16-byte aligned (``kv/step.py``).
_STEP_INTS = ["stride_bt", "stride_ob", "stride_oh", "stride_lb", "stride_lh"]


@triton.jit(do_not_specialize=["window", "min_split", "splits", *_STEP_INTS])
def _decode_split(
    Q,
    K,
    V,
    BT,
    SEQ,
    REQS,
    TOKS,
    O_PART,
    LSE_PART,
    SINKS,
    OUT,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    scale,
    softcap,
    window,
    min_split,
    splits,
    G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    INDEXED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    i = tl.program_id(0)  # the launch's row: its partial outputs' row
    kh = tl.program_id(1)
    s = tl.program_id(2)
    b = i.to(tl.int64)  # its request: page-table row and length
    tok = i.to(tl.int64)  # its query's row in Q and OUT
    if INDEXED:  # the decode rows of a mixed step: request REQS[i], token TOKS[i]
        b = tl.load(REQS + i).to(tl.int64)
        tok = tl.load(TOKS + i).to(tl.int64)
    n = tl.load(SEQ + b).to(tl.int32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(n - window, 0)
    span = n - start
    # This request's splits: as many as hold min_split keys each, at most `splits`.
    used = tl.minimum(tl.maximum(tl.cdiv(span, min_split), 1), splits)
    per = tl.cdiv(tl.cdiv(span, used), BLOCK_N) * BLOCK_N
    lo = start + s * per
    hi = tl.minimum(lo + per, n)
    full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N  # blocks wholly inside [lo, hi)

    rows = tl.arange(0, BLOCK_H)
    heads = kh * G + rows
    hmask = rows < G
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(
        Q + tok * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    bt_row = BT + b * stride_bt
    for j0 in range(lo, full, BLOCK_N):
        j = j0 + offs
        k, v = _load_kv(
            K, V, bt_row, j, j < hi, kh, d, dmask,
            stride_ks, stride_kh, stride_vs, stride_vh, P, UPCAST, False, BLOCK_D == D,
        )  # fmt: skip
        sc = _scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
        m, lsum, acc = _online(m, lsum, acc, sc, v, IEEE)
    for j0 in range(full, hi, BLOCK_N):  # the last, partial block (at most one)
        j = j0 + offs
        jm = j < hi
        k, v = _load_kv(
            K, V, bt_row, j, jm, kh, d, dmask,
            stride_ks, stride_kh, stride_vs, stride_vh, P, UPCAST, True, BLOCK_D == D,
        )  # fmt: skip
        sc = _scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
        sc = tl.where(jm[None, :], sc, float("-inf"))
        m, lsum, acc = _online(m, lsum, acc, sc, v, IEEE)
    omask = hmask[:, None] & dmask[None, :]
    if DIRECT:  # one split: this program's output is the answer
        out = _finish(m, lsum, acc, SINKS, heads, hmask, HAS_SINKS)
        o_ptr = OUT + tok * stride_outb + heads[:, None] * stride_outh + d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=omask)
    else:
        empty = lsum == 0.0  # a split past this request's keys
        out = acc / tl.where(empty, 1.0, lsum)[:, None]
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, lsum)))
        row = i.to(tl.int64)
        o_ptr = O_PART + row * stride_ob + heads[:, None] * stride_oh + s * stride_os
        tl.store(o_ptr + d[None, :], out, mask=omask)
        tl.store(LSE_PART + row * stride_lb + heads * stride_lh + s, lse, mask=hmask)


@triton.jit(do_not_specialize=["splits", *_STEP_INTS[1:]])
def _decode_merge(
    O_PART,
    LSE_PART,
    SINKS,
    TOKS,
    OUT,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    INDEXED: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)  # the row of the partial outputs
    h = tl.program_id(1)
    tok = b  # its output row
    if INDEXED:
        tok = tl.load(TOKS + b).to(tl.int64)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    lse_row = LSE_PART + b * stride_lb + h * stride_lh
    o_row = O_PART + b * stride_ob + h * stride_oh
    top = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        lse = tl.load(lse_row + s0 + sp, mask=s0 + sp < splits, other=float("-inf"))
        top = tl.maximum(top, lse)
    mx = tl.max(top, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32)
        mx = tl.maximum(mx, sink)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # a padded row (no keys): its output is 0
    den = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        smask = s0 + sp < splits
        lse = tl.load(lse_row + s0 + sp, mask=smask, other=float("-inf"))
        w = tl.exp(lse - mx)  # 0 for an empty split (lse = -inf)
        o = tl.load(
            o_row + (s0 + sp)[:, None] * stride_os + d[None, :],
            mask=smask[:, None] & dmask[None, :],
            other=0.0,
        )
        acc += tl.sum(o * w[:, None], 0)
        den += w
    total = tl.sum(den, 0)
    if HAS_SINKS:
        total += tl.exp(sink - mx)
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_ptr = OUT + tok * stride_outb + h * stride_outh + d
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit(do_not_specialize=["window", "stride_bt"])
def _prefill(
    Q,
    K,
    V,
    BT,
    SEQ,
    QO,
    TILE_REQ,
    TILE_Q0,
    SINKS,
    OUT,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    scale,
    softcap,
    window,
    G: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    t = tl.program_id(0)
    kh = tl.program_id(1)
    b = tl.load(TILE_REQ + t).to(tl.int64)
    i0 = tl.load(TILE_Q0 + t).to(tl.int32)
    q_begin = tl.load(QO + b).to(tl.int32)
    q_len = tl.load(QO + b + 1).to(tl.int32) - q_begin
    n = tl.load(SEQ + b).to(tl.int32)
    ctx = n - q_len  # keys cached before this step's tokens

    # Row r of the tile: token i0 + r // GP of the request, query head kh * G + r % GP.
    r = tl.arange(0, BLOCK_Q * GP)
    ti = i0 + r // GP
    hg = r % GP
    rmask = (ti < q_len) & (hg < G)
    pos = ctx + ti
    token = (q_begin + ti).to(tl.int64)
    head = kh * G + hg
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(
        Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=qmask,
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    last = tl.minimum(i0 + BLOCK_Q, q_len) - 1  # the tile's last token
    hi = ctx + last + 1
    lo = 0
    # Keys [lo, full) are seen by every row of the tile (they precede its first token): no
    # mask. With a window each row starts elsewhere: every block is masked.
    full = lo
    if HAS_WINDOW:
        lo = tl.maximum(ctx + i0 - window + 1, 0)
        full = lo
    else:
        full = (ctx + i0 + 1) // BLOCK_N * BLOCK_N
    m = tl.full([BLOCK_Q * GP], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_Q * GP], tl.float32)
    acc = tl.zeros([BLOCK_Q * GP, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    bt_row = BT + b * stride_bt
    for j0 in range(lo, full, BLOCK_N):
        j = j0 + offs
        k, v = _load_kv(
            K, V, bt_row, j, j < hi, kh, d, dmask,
            stride_ks, stride_kh, stride_vs, stride_vh, P, UPCAST, False, BLOCK_D == D,
        )  # fmt: skip
        sc = _scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
        m, lsum, acc = _online(m, lsum, acc, sc, v, IEEE)
    for j0 in range(full, hi, BLOCK_N):  # from the tile's diagonal on: causal
        j = j0 + offs
        jm = j < hi
        k, v = _load_kv(
            K, V, bt_row, j, jm, kh, d, dmask,
            stride_ks, stride_kh, stride_vs, stride_vh, P, UPCAST, True, BLOCK_D == D,
        )  # fmt: skip
        sc = _scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
        seen = jm[None, :] & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            seen = seen & (j[None, :] > pos[:, None] - window)
        sc = tl.where(seen, sc, float("-inf"))
        m, lsum, acc = _online(m, lsum, acc, sc, v, IEEE)
    out = _finish(m, lsum, acc, SINKS, head, rmask, HAS_SINKS)
    o_ptr = OUT + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=qmask)


def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _flags(dtype: torch.dtype) -> tuple[bool, bool]:
    """(IEEE, UPCAST) of a launch over ``dtype``: fp32 is exact through ``ieee``; under the
    interpreter half types are cast to fp32 (and are then exact too)."""
    upcast = interpreted() and dtype != torch.float32
    return dtype == torch.float32 or upcast, upcast


def _check_last(*xs: torch.Tensor) -> None:
    for x in xs:
        if x.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous, got strides {x.stride()}")


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def split_bound(batch: int, num_kv_heads: int, multiprocessors: int) -> int:
    """Splits for ``batch`` requests over ``num_kv_heads`` on a device of ``multiprocessors``:
    enough programs to fill it twice over, a power of two, at most ``MAX_SPLITS`` (one request
    of few KV heads gets many; a large batch one)."""
    want = -(-2 * multiprocessors // max(batch * num_kv_heads, 1))
    return min(_pow2(want), MAX_SPLITS)


def decode_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """The split bound of a decode launch of ``batch`` requests (:func:`split_bound` of the
    device; 1 off CUDA). Depends on the batch size and the pool's shape only, so a batch size
    always gets the same grid."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return split_bound(batch, num_kv_heads, _multiprocessors(index))


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
    min_split: int | None = None,
    out: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: Tiles | None = None,
    arch: int | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per request over its paged keys: ``q`` ``[B, Hq, D]``, pools ``[S, Hkv, D]``,
    ``block_table`` ``[B, W]`` int32, ``seq_lens`` ``[B]`` (request ``b``'s query sits at
    position ``seq_lens[b] - 1`` and sees keys ``0..seq_lens[b]``, or the last ``window`` of
    them). ``sinks``: one logit per query head joining the softmax. ``splits`` bounds the
    split-KV grid (default :func:`decode_splits`); a request uses as many as hold
    ``min_split`` keys each (default one key block). ``scratch``, the partial output and
    log-sum-exp buffers (``[R, Hq, splits, D]`` and ``[R, Hq, splits]`` fp32, ``R`` the rows
    launched) to reuse; one split needs none. ``config``: the tiles (default
    :func:`decode_config` of ``arch``, by default the device's: :func:`arch_of`).

    ``rows``: ``(requests, tokens)``, two int32 ``[R]`` tensors, to launch ``R`` decode rows
    picked out of a larger batch in place (a mixed step's, see :func:`paged_mixed`): row ``i``
    is query ``q[tokens[i]]`` (``q`` then ``[T, Hq, D]``) of request ``requests[i]`` (its
    ``block_table`` row and ``seq_lens`` entry), and writes ``out[tokens[i]]`` only."""
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    _check_last(q, k_pool, v_pool)
    if rows is not None:
        if rows[0].shape != rows[1].shape or rows[0].dim() != 1:
            raise ValueError(
                f"rows must be two [R] tensors, got shapes {tuple(rows[0].shape)} and "
                f"{tuple(rows[1].shape)}"
            )
        b = rows[0].shape[0]
    if splits is None:
        splits = decode_splits(b, hkv, q.device)
    splits = _pow2(splits)
    if config is None:
        config = decode_config(arch_of(q.device) if arch is None else arch, q.dtype, d)
    if out is None:
        out = (
            torch.empty_like(q)
            if rows is not None
            else torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
        )
    if b == 0:
        return out
    direct = splits == 1
    if direct:
        o_part = lse = out  # unread: the split kernel writes the output itself
    elif scratch is None:
        o_part = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    else:
        o_part, lse = scratch
    ieee, upcast = _flags(q.dtype)
    block_d = max(16, _pow2(d))
    sink_arg = sinks if sinks is not None else seq_lens
    reqs, toks = rows if rows is not None else (seq_lens, seq_lens)  # unread without rows
    _decode_split[(b, hkv, splits)](
        q,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        reqs,
        toks,
        o_part,
        lse,
        sink_arg,
        out,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        block_table.stride(0),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        float(scale),
        float(softcap or 1.0),
        int(window or 0),
        int(min_split or config.block_n),
        splits,
        G=g,
        BLOCK_H=max(16, _pow2(g)),
        D=d,
        BLOCK_D=block_d,
        P=page_size,
        BLOCK_N=config.block_n,
        DIRECT=direct,
        INDEXED=rows is not None,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if direct:
        return out
    _decode_merge[(b, hq)](
        o_part,
        lse,
        sink_arg,
        toks,
        out,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        splits,
        D=d,
        BLOCK_D=block_d,
        BLOCK_S=MERGE_BLOCK,
        INDEXED=rows is not None,
        HAS_SINKS=sinks is not None,
    )
    return out


def prefill_tiles(q_len: list[int] | tuple[int, ...], block_q: int) -> tuple[list[int], list[int]]:
    """The tiles of a prefill launch: for each, its request and its first new token (a request
    of ``n`` new tokens takes ``ceil(n / block_q)`` tiles)."""
    req: list[int] = []
    q0: list[int] = []
    for i, n in enumerate(q_len):
        for start in range(0, int(n), block_q):
            req.append(i)
            q0.append(start)
    return req, q0


def prefill_block_q(num_heads_per_kv: int, max_q_len: int, rows: int = 64) -> int:
    """New tokens per prefill tile: ``rows`` query rows (the config's ``block_m``; 16 when
    every request has few new tokens), a KV head's query heads packed beside each token."""
    gp = _pow2(num_heads_per_kv)
    rows = rows if max_q_len * gp >= rows else 16
    return max(1, rows // gp)


def paged_prefill(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor],
    block_q: int,
    scale: float,
    page_size: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: Tiles | None = None,
    arch: int | None = None,
) -> torch.Tensor:
    """Packed new tokens over their requests' paged keys: ``q`` ``[T, Hq, D]``, request ``b``'s
    tokens at rows ``qo_indptr[b]..qo_indptr[b+1]``, the last of its ``seq_lens[b]`` keys (its
    new tokens' K/V already in the pool); token ``i`` of ``n`` new ones sits at position
    ``seq_lens[b] - n + i`` and sees keys up to it (bottom-right causal, or the last ``window``).
    Decode rows are requests with one new token. ``tiles``: the device tensors of
    :func:`prefill_tiles` for ``block_q``. ``config``: the key block, warps and stages (default
    :func:`prefill_config` of ``arch``, by default the device's: :func:`arch_of`)."""
    t, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    _check_last(q, k_pool, v_pool)
    if config is None:
        config = prefill_config(arch_of(q.device) if arch is None else arch, q.dtype, d)
    if out is None:
        out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    tile_req, tile_q0 = tiles
    n_tiles = tile_req.shape[0]
    if n_tiles == 0:
        return out
    ieee, upcast = _flags(q.dtype)
    _prefill[(n_tiles, hkv)](
        q,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        qo_indptr,
        tile_req,
        tile_q0,
        sinks if sinks is not None else seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        float(scale),
        float(softcap or 1.0),
        int(window or 0),
        G=g,
        GP=_pow2(g),
        BLOCK_Q=block_q,
        D=d,
        BLOCK_D=max(16, _pow2(d)),
        P=page_size,
        BLOCK_N=config.block_n,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def mixed_tiles(
    q_len: list[int] | tuple[int, ...], q_start: list[int] | tuple[int, ...], block_q: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """What a mixed launch (:func:`paged_mixed`) runs where: the prefill tiles
    (:func:`prefill_tiles`) of the requests of several new tokens, then the decode rows, the
    requests of one (their indices, and their query rows ``q_start[b]``)."""
    req, q0 = prefill_tiles([0 if n == 1 else n for n in q_len], block_q)
    dec = [b for b, n in enumerate(q_len) if n == 1]
    return req, q0, dec, [int(q_start[b]) for b in dec]


def paged_mixed(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tiles: tuple[torch.Tensor, torch.Tensor],
    block_q: int,
    decode_rows: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    page_size: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    configs: tuple[Tiles | None, Tiles | None] = (None, None),
    arch: int | None = None,
) -> torch.Tensor:
    """A step of prefill chunks and decode rows (arguments as :func:`paged_prefill`'s): the
    requests of several new tokens through the prefill kernel (``tiles``: theirs only, of
    :func:`mixed_tiles`), the decode rows (``decode_rows``: ``(requests, tokens)`` of
    :func:`mixed_tiles`) through the split-KV decode kernel, into one output. Two launches, a
    third (the merge) when the decode rows use several splits: ``splits`` bounds them (default
    :func:`decode_splits` of the decode rows alone, which run after the prefill launch has
    left the device). In one prefill launch a decode row's keys would be read by one program
    a KV head, in a tile of mostly empty rows, while the prefill tiles finish beside it: a
    long decode row became the launch's tail. ``scratch``: as :func:`paged_decode`'s, for the
    decode rows; ``configs``: the (decode, prefill) tiles (default: the table's for ``arch``)."""
    if out is None:
        out = torch.empty_like(q)
    paged_prefill(
        q, k_pool, v_pool, block_table, seq_lens, qo_indptr, tiles, block_q, scale, page_size,
        window=window, softcap=softcap, sinks=sinks, out=out, config=configs[1], arch=arch,
    )  # fmt: skip
    paged_decode(
        q, k_pool, v_pool, block_table, seq_lens, scale, page_size, window=window,
        softcap=softcap, sinks=sinks, splits=splits, out=out, scratch=scratch,
        config=configs[0], arch=arch, rows=decode_rows,
    )  # fmt: skip
    return out


@triton.jit
def _store_kv(
    K_NEW,
    V_NEW,
    SLOTS,
    K,
    V,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ks,
    stride_kph,
    stride_vs,
    stride_vph,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:  # a padded row (slot -1) writes nothing
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < H)[:, None] & (d < D)[None, :]
        k = tl.load(K_NEW + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(V_NEW + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(K + slot * stride_ks + h[:, None] * stride_kph + d[None, :], k, mask=mask)
        tl.store(V + slot * stride_vs + h[:, None] * stride_vph + d[None, :], v, mask=mask)


def store_kv(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slots: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
) -> None:
    """Writes row ``t`` of ``k_new``/``v_new`` (``[T, Hkv, D]``, the pool's dtype) into the
    pools at ``slots[t]``; a row whose slot is negative (a padded row of a batch bucket) writes
    nothing. One launch of ``T`` programs: the grid depends on ``T`` only."""
    t, h, d = k_new.shape
    _check_last(k_new, v_new, k_pool, v_pool)
    if t == 0:
        return
    _store_kv[(t,)](
        k_new,
        v_new,
        slots,
        k_pool,
        v_pool,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        H=h,
        BLOCK_H=_pow2(h),
        D=d,
        BLOCK_D=_pow2(d),
    )
