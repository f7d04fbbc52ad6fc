"""Paged attention kernels in Triton that read K and V in the pool where they are.

The pool of a layer is ``[num_slots, Hkv, D]``; request ``b``'s key ``j`` lives at slot
``block_table[b, j // P] * P + j % P``. Nothing is gathered, no slot matrix or mask is built,
and nothing is shaped by the longest request:

```text
 decode (one query per request), split-KV:
   grid (B, Hkv, SPLITS)       program (b, h, s) reads keys [lo_s, hi_s) of request b, KV head h,
                               with h's G query heads packed as the rows of one 16-row tile
   -> partial out [B, Hq, SPLITS, D] and log-sum-exp [B, Hq, SPLITS] in fp32
   grid (B, Hq)                merges the splits (and a sink logit per head) by log-sum-exp

 prefill and mixed steps (decode rows are one-token requests):
   grid (tiles, Hkv)           tile = up to BLOCK_Q new tokens of one request x G query heads;
                               keys [lo, hi) of that request, causal (and windowed) by position,
                               one online softmax over the cached prefix and the new tokens
```

The split count of a decode launch is a grid bound fixed by the batch size; each request
uses as many of them as its own length fills (``MIN_SPLIT`` keys at least), decided in the
kernel from ``seq_lens``: no host sync, and the grid of a batch size never changes (what a
CUDA graph needs).

fp32 inputs use ``input_precision="ieee"`` (Triton's default, TF32, is not exact). Under
Triton's interpreter (``TRITON_INTERPRET=1``, kernels on CPU tensors) a bf16/fp16 ``tl.dot`` is
wrong (triton issue 11584): there the operands are cast to fp32 first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixkv.kv.backends.choice import interpreted

#: Fewest keys a decode split reads before the kernel uses another split for a request.
MIN_SPLIT = 256
#: Most splits of a decode launch.
MAX_SPLITS = 32


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
    P: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """Keys ``j`` (masked by ``jm``) of KV head ``kh`` of the request whose page-table row
    starts at ``BT_ROW``: ``[N, BLOCK_D]`` K and V blocks read where the pool holds them."""
    page = tl.load(BT_ROW + j // P, mask=jm, other=0)
    slot = page.to(tl.int64) * P + j % P
    kv_mask = jm[:, None] & dmask[None, :]
    k = tl.load(
        K + slot[:, None] * stride_ks + kh * stride_kh + d[None, :], mask=kv_mask, other=0.0
    )
    v = tl.load(
        V + slot[:, None] * stride_vs + kh * stride_vh + d[None, :], mask=kv_mask, other=0.0
    )
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
def _decode_split(
    Q,
    K,
    V,
    BT,
    SEQ,
    O_PART,
    LSE_PART,
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
    scale,
    softcap,
    window,
    min_split,
    G: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(SEQ + b).to(tl.int32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(n - window, 0)
    span = n - start
    # This request's splits: as many as hold min_split keys each, at most SPLITS.
    used = tl.minimum(tl.maximum(tl.cdiv(span, min_split), 1), SPLITS)
    per = tl.cdiv(tl.cdiv(span, used), BLOCK_N) * BLOCK_N
    lo = start + s * per
    hi = tl.minimum(lo + per, n)

    rows = tl.arange(0, BLOCK_H)
    heads = kh * G + rows
    hmask = rows < G
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + offs
        jm = j < hi
        k, v = _load_kv(
            K, V, BT + b.to(tl.int64) * stride_bt, j, jm, kh, d, dmask,
            stride_ks, stride_kh, stride_vs, stride_vh, P, UPCAST,
        )  # fmt: skip
        sc = _scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
        sc = tl.where(jm[None, :], sc, float("-inf"))
        m, lsum, acc = _online(m, lsum, acc, sc, v, IEEE)
    empty = lsum == 0.0  # a split past this request's keys
    out = acc / tl.where(empty, 1.0, lsum)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, lsum)))
    o_ptr = O_PART + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + s * stride_os
    tl.store(o_ptr + d[None, :], out, mask=hmask[:, None] & dmask[None, :])
    tl.store(LSE_PART + b.to(tl.int64) * stride_lb + heads * stride_lh + s, lse, mask=hmask)


@triton.jit
def _decode_merge(
    O_PART,
    LSE_PART,
    SINKS,
    OUT,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    lse = tl.load(LSE_PART + b.to(tl.int64) * stride_lb + h * stride_lh + sp)
    mx = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32)
        mx = tl.maximum(mx, sink)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # a padded row (no keys): its output is 0
    w = tl.exp(lse - mx)  # 0 for an empty split (lse = -inf)
    o = tl.load(
        O_PART + b.to(tl.int64) * stride_ob + h * stride_oh + sp[:, None] * stride_os + d[None, :],
        mask=dmask[None, :],
        other=0.0,
    )
    den = tl.sum(w, 0)
    if HAS_SINKS:
        den += tl.exp(sink - mx)
    out = tl.sum(o * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    o_ptr = OUT + b.to(tl.int64) * stride_outb + h * stride_outh + d
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit
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
    if HAS_WINDOW:
        lo = tl.maximum(ctx + i0 - window + 1, 0)
    m = tl.full([BLOCK_Q * GP], float("-inf"), tl.float32)
    lsum = tl.zeros([BLOCK_Q * GP], tl.float32)
    acc = tl.zeros([BLOCK_Q * GP, BLOCK_D], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + offs
        jm = j < hi
        k, v = _load_kv(
            K, V, BT + b * stride_bt, j, jm, kh, d, dmask,
            stride_ks, stride_kh, stride_vs, stride_vh, P, UPCAST,
        )  # fmt: skip
        sc = _scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
        seen = jm[None, :] & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            seen = seen & (j[None, :] > pos[:, None] - window)
        sc = tl.where(seen, sc, float("-inf"))
        m, lsum, acc = _online(m, lsum, acc, sc, v, IEEE)
    if HAS_SINKS:
        sink = tl.load(SINKS + head, mask=rmask, other=0.0).to(tl.float32)
        mx = tl.maximum(m, sink)
        scale_acc = tl.exp(m - mx)
        lsum = lsum * scale_acc + tl.exp(sink - mx)
        acc = acc * scale_acc[:, None]
    out = acc / tl.where(lsum == 0.0, 1.0, lsum)[:, None]
    o_ptr = OUT + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=qmask)


def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _flags(dtype: torch.dtype) -> tuple[bool, bool]:
    """(IEEE, UPCAST) of a launch over ``dtype``: fp32 is exact through ``ieee``; under the
    interpreter half types are cast to fp32 (and are then exact too)."""
    upcast = interpreted() and dtype != torch.float32
    return dtype == torch.float32 or upcast, upcast


def _stages(dtype: torch.dtype, d: int) -> int:
    """Software-pipelining stages of the key loop: two K/V blocks in flight for half types,
    one for fp32 at large head dims (fp32 blocks of 64 keys x 256 would overflow shared
    memory with more)."""
    return 2 if dtype != torch.float32 or d <= 64 else 1


def _check_last(*xs: torch.Tensor) -> None:
    for x in xs:
        if x.stride(-1) != 1:
            raise ValueError(f"the last dimension must be contiguous, got strides {x.stride()}")


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def decode_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """The split bound of a decode launch of ``batch`` requests: enough programs to fill the
    device twice over (a power of two, at most ``MAX_SPLITS``); 1 off CUDA. Depends on the
    batch size and the pool's shape only, so a batch size always gets the same grid."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _multiprocessors(index)
    want = -(-2 * sms // max(batch * num_kv_heads, 1))
    return min(_pow2(want), MAX_SPLITS)


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
    min_split: int = MIN_SPLIT,
    out: torch.Tensor | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per request over its paged keys: ``q`` ``[B, Hq, D]``, pools ``[S, Hkv, D]``,
    ``block_table`` ``[B, W]`` int32, ``seq_lens`` ``[B]`` (request ``b``'s query sits at
    position ``seq_lens[b] - 1`` and sees keys ``0..seq_lens[b]``, or the last ``window`` of
    them). ``sinks``: one logit per query head joining the softmax. ``splits`` bounds the
    split-KV grid (default :func:`decode_splits`); ``scratch``, the partial output and
    log-sum-exp buffers (``[B, Hq, splits, D]`` and ``[B, Hq, splits]`` fp32) to reuse."""
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    _check_last(q, k_pool, v_pool)
    if splits is None:
        splits = decode_splits(b, hkv, q.device)
    splits = _pow2(splits)
    if out is None:
        out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if scratch is None:
        o_part = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    else:
        o_part, lse = scratch
    ieee, upcast = _flags(q.dtype)
    block_d = max(16, _pow2(d))
    _decode_split[(b, hkv, splits)](
        q,
        k_pool,
        v_pool,
        block_table,
        seq_lens,
        o_part,
        lse,
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
        float(scale),
        float(softcap or 1.0),
        int(window or 0),
        int(min_split),
        G=g,
        BLOCK_H=max(16, _pow2(g)),
        D=d,
        BLOCK_D=block_d,
        P=page_size,
        BLOCK_N=64 if d <= 128 else 32,
        SPLITS=splits,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        IEEE=ieee,
        UPCAST=upcast,
        num_stages=_stages(q.dtype, d),
    )
    _decode_merge[(b, hq)](
        o_part,
        lse,
        sinks if sinks is not None else lse,
        out,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        D=d,
        BLOCK_D=block_d,
        SPLITS=splits,
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


def prefill_block_q(num_heads_per_kv: int, max_q_len: int) -> int:
    """New tokens per prefill tile: 64 query rows (16 when every request has few new tokens),
    a KV head's query heads packed beside each token."""
    gp = _pow2(num_heads_per_kv)
    rows = 64 if max_q_len * gp >= 64 else 16
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
) -> torch.Tensor:
    """Packed new tokens over their requests' paged keys: ``q`` ``[T, Hq, D]``, request ``b``'s
    tokens at rows ``qo_indptr[b]..qo_indptr[b+1]``, the last of its ``seq_lens[b]`` keys (its
    new tokens' K/V already in the pool); token ``i`` of ``n`` new ones sits at position
    ``seq_lens[b] - n + i`` and sees keys up to it (bottom-right causal, or the last ``window``).
    Decode rows are requests with one new token. ``tiles``: the device tensors of
    :func:`prefill_tiles` for ``block_q``."""
    t, hq, d = q.shape
    hkv = k_pool.shape[1]
    g = hq // hkv
    _check_last(q, k_pool, v_pool)
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
        BLOCK_N=64 if d <= 128 else 32,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        IEEE=ieee,
        UPCAST=upcast,
        num_stages=_stages(q.dtype, d),
    )
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
