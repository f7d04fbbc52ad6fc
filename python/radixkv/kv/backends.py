"""Attention backends of :class:`~radixkv.kv.step.Step`: how a group of requests attends to its
pages.

A step splits its requests into a *decode* group (one new token each) and a *prefill* group (the
rest); each group runs through one backend, chosen by ``KVCache(attention=...)``:

- ``"sdpa"``: gathers the group's K/V from the pool into a padded copy and calls
  ``scaled_dot_product_attention``. On decode the query heads of each KV group are folded into
  rows (``[B, Hkv, G, D]``), which beats SDPA's ``enable_gqa`` on CPU. The reference.
- ``"flex"``: compiled ``flex_attention`` reading the pool in place (decode groups; prefill goes
  through ``"sdpa"``, faster there on CPU). The block mask is the page table itself (one KV block
  per page); the mask function, made once per pool, reads the step's tensors from a holder, so
  steps do not recompile. Batch sizes are bucketed to powers of two: one compile per bucket.
- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` with ``block_table`` (CUDA only).
- ``"flashinfer"``: FlashInfer's paged wrappers, when the package is installed (CUDA only).
- ``"auto"``: per device, dtype and group kind, the fastest measured choice
  (:func:`auto_choice`); never a compile on the hot path (flex only for batch buckets
  :meth:`KVCache.warmup` compiled, where it is the choice).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: A :class:`radixkv.kv.step.Step` (not imported: the step module imports this one).
Step = Any

#: Every backend name ``KVCache(attention=...)`` knows.
NAMES = ("auto", "sdpa", "flex", "varlen", "flashinfer")

#: Most flex compiles per process (batch buckets x pools x dtypes); past it ``flex`` raises
#: instead of letting torch fall back to its uncompiled path (~200x slower) without a word.
MAX_FLEX_COMPILES = 32


def available(device: torch.device) -> list[str]:
    """Backend names usable on ``device`` with the installed packages."""
    names = ["auto", "sdpa"]
    if _has_flex():
        names.append("flex")
    if device.type == "cuda":
        if _has_varlen():
            names.append("varlen")
        if importlib.util.find_spec("flashinfer") is not None:
            names.append("flashinfer")
    return names


def check_name(name: str, device: torch.device) -> str:
    """``name`` if it is usable on ``device``; ``ValueError`` listing the usable ones if not."""
    ok = available(device)
    if name not in ok:
        raise ValueError(
            f"attention must be one of {', '.join(map(repr, ok))} on {device.type} with the "
            f"installed packages, got {name!r}"
        )
    return name


def _has_flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    import inspect

    return "block_table" in inspect.signature(varlen_attn).parameters


def auto_choice(device: torch.device, dtype: torch.dtype, decode: bool) -> str:
    """The backend ``"auto"`` prefers for a group, before checking what is compiled.

    CPU: SDPA (decode over the :class:`~radixkv.kv.mirror.DecodeMirror`'s lanes, else the
    folded gather). One layer's attention alone favours flex on fp32 decode
    (``benches/bench_attention.py``: 1.2x against 1.9x of SDPA on contiguous KV at head dim
    64), but a whole engine step does not (``benches/bench_torch.py`` section (d): decode
    tokens/s over a contiguous-KV loop at head dim 32, flex 0.40-0.48x against SDPA 0.90x for 8
    requests and 0.94-0.95x for 32, with the mirror; before it, at head dim 64, flex 0.71x
    against SDPA 0.78x for 8 and 0.72x against 0.66x for 32), because flex rebuilds its block
    mask every step. bf16/fp16: the folded gather wins outright;
    prefill: SDPA (flex 1.7x). ``attention="flex"`` stays available. CUDA: varlen, else
    FlashInfer, else SDPA (not yet measured here: see ``benches/README.md``)."""
    names = available(device)
    if device.type == "cuda":
        for name in ("varlen", "flashinfer"):
            if name in names:
                return name
        return "sdpa"
    return "sdpa"


@dataclass
class Group:
    """The requests of a step that one backend serves, in step order.

    ``req``: their indices in the step; ``rows``: their packed query rows (``None`` when the
    group is the whole step); host copies of their lengths; device tensors of their page table.
    """

    req: np.ndarray
    rows: torch.Tensor | None
    q_len: np.ndarray
    kv_len: np.ndarray
    q_start: np.ndarray
    positions: torch.Tensor  # [Tg] int64
    block_table: torch.Tensor  # [Bg, max_pages] int32
    seq_lens: torch.Tensor  # [Bg] int32
    is_decode: bool
    state: Any = None
    #: Whether the group's keys are the full pool's, so a decode group may read them from the
    #: pool's :class:`~radixkv.kv.mirror.DecodeMirror` (not the window layers' groups).
    mirror: bool = False
    #: Longest ``q_len`` and ``kv_len`` when known (the step's own, for a group of the whole
    #: step), else computed from them.
    max_q_len: int | None = None
    max_kv_len: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.q_start[-1])


class SdpaBackend:
    """Gather into a padded copy, then SDPA (the reference every other backend is tested
    against). Mask and slot matrix are built once per step and shared by every layer."""

    name = "sdpa"

    @staticmethod
    def supports(window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> bool:
        """Whether :meth:`attend` takes these (the reference takes them all)."""
        return True

    def prepare(self, step: Step, g: Group) -> None:
        kv = step.kv
        b = len(g.req)
        max_q = int(g.q_len.max()) if g.max_q_len is None else g.max_q_len
        max_kv = int(g.kv_len.max()) if g.max_kv_len is None else g.max_kv_len
        st: dict[str, Any] = {"max_q": max_q, "max_kv": max_kv}
        # A lone request with nothing cached is a plain causal prefill over its own new keys.
        st["fresh"] = b == 1 and int(g.q_len[0]) == int(g.kv_len[0])
        st["pad"] = b > 1 and not g.is_decode
        if st["fresh"]:
            st["mask"] = None
            g.state = st
            return
        if g.is_decode and g.mirror and kv.mirror.max_tokens:
            whole = g.rows is None and g.max_kv_len is not None  # the step's own requests
            reqs = step.requests if whole else [step.requests[i] for i in g.req]
            kv_list = step.kv_len_list if whole else None
            st["lanes"] = kv.mirror.plan(reqs, g.kv_len, max_kv, kv_list)
            if st["lanes"] is not None:  # slots and mask made only if a layer gathers
                g.state = st
                return
        self._gather_state(step, g, st)
        g.state = st

    @staticmethod
    def _gather_state(step: Step, g: Group, st: dict[str, Any]) -> None:
        """The slot matrix and the additive mask of ``g``'s gathered keys, into ``st``."""
        kv = step.kv
        b, max_q, max_kv = len(g.req), st["max_q"], st["max_kv"]
        st["slots"] = slot_matrix(g.block_table, max_kv, step.page_size)
        keys = torch.arange(max_kv, device=kv.device)
        kv_len = g.seq_lens.long()
        if g.is_decode:
            if len(set(g.kv_len.tolist())) == 1:
                st["mask"] = None
                return
            allowed = (keys < kv_len[:, None]).view(b, 1, 1, -1)
        else:
            if st["pad"]:
                i = np.arange(max_q)
                last = g.q_len[:, None] - 1
                local = g.q_start[:-1, None] + np.minimum(i[None, :], last)
                keep = np.flatnonzero(i[None, :] <= last)
                st["q_index"] = torch.from_numpy(local.reshape(-1)).to(kv.device)
                st["unpad"] = torch.from_numpy(keep).to(kv.device)
                q_pos = g.positions[st["q_index"]].view(b, max_q)
            else:
                q_pos = g.positions.view(1, -1)
            allowed = (keys <= q_pos[:, :, None]).unsqueeze(1)
        bias = torch.zeros(allowed.shape, dtype=kv.dtype, device=kv.device)
        st["mask"] = bias.masked_fill_(~allowed, float("-inf"))

    def attend(
        self,
        step: Step,
        g: Group,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        scale: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``window``: a sliding window of that many keys (a query at position ``p`` sees keys
        ``p - window < j <= p``), one mask per window size per step, shared by its layers.
        ``softcap``/``sinks`` (Gemma 2, gpt-oss; see :mod:`radixkv.kv.windowed`): the same
        gathered keys and masks, scores computed explicitly in float32 (SDPA has neither)."""
        st = g.state
        kv = step.kv
        t, hq, d = q.shape
        hkv = kv.num_kv_heads
        b = len(g.req)
        extras = softcap is not None or sinks is not None
        lanes = st.get("lanes")
        if lanes is not None:
            if window is not None:
                kv.mirror.bypass(lanes, layer)
            else:
                pair = kv.mirror.keys(lanes, layer, g.block_table, k_new, v_new)
                if pair is not None:
                    return self._attend_lanes(lanes, q, *pair, scale, softcap, sinks)
        if "slots" not in st and not st["fresh"]:
            self._gather_state(step, g, st)
        mask = st["mask"] if window is None else self._window_mask(step, g, window)
        if st["fresh"]:
            # The keys are exactly the new tokens: no gather, top-left causal is right here.
            qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k_new, v_new))
            if extras:
                return _explicit(qh, kh, vh, mask, mask is None, scale, softcap, sinks)[
                    0
                ].transpose(0, 1)
            return sdpa(qh, kh, vh, mask, mask is None, scale)[0].transpose(0, 1)
        keys, values = _gather(kv, layer, st["slots"])  # [B, Hkv, L, D]
        if g.is_decode:
            if extras:
                qh = q.view(b, hq, 1, d)
                return _explicit(qh, keys, values, mask, False, scale, softcap, sinks).view(
                    b, hq, d
                )
            # One query per request; fold each KV group's query heads into rows.
            qb = q.view(b, hkv, hq // hkv, d)
            o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=scale)
            return o.reshape(b, hq, d)
        max_q = st["max_q"]
        if st["pad"]:
            qb = q.index_select(0, st["q_index"]).view(b, max_q, hq, d)
        else:
            qb = q.unsqueeze(0)
            if window is None and not extras and _split_prefill(q, st["max_kv"]):
                return _cached_prefill(q, keys, values, scale)
        if extras:
            o = _explicit(qb.transpose(1, 2), keys, values, mask, False, scale, softcap, sinks)
        else:
            o = sdpa(qb.transpose(1, 2), keys, values, mask, False, scale)
        o = o.transpose(1, 2)
        if st["pad"]:
            return o.reshape(b * max_q, hq, d).index_select(0, st["unpad"])
        return o.reshape(t, hq, d)

    @staticmethod
    def _attend_lanes(
        lanes: Any,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """A decode group over its mirror lanes (``[B, Hkv, L, D]``, lane order): the queries
        permuted into lane order, attended as the gathered keys are, permuted back."""
        b, hq, d = q.shape
        hkv = keys.shape[1]
        if lanes.order is not None:
            q = q.index_select(0, lanes.order)
        if softcap is not None or sinks is not None:
            qh = q.view(b, hq, 1, d)
            o = _explicit(qh, keys, values, lanes.mask, False, scale, softcap, sinks)
        else:
            qb = q.view(b, hkv, hq // hkv, d)
            o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=lanes.mask, scale=scale)
        o = o.reshape(b, hq, d)
        if lanes.order is None:
            return o
        return o.index_select(0, lanes.lane_index)

    @staticmethod
    def _window_mask(step: Step, g: Group, window: int) -> torch.Tensor:
        """The additive mask of ``g`` for a sliding window of ``window`` keys: the causal mask
        :meth:`prepare` builds, narrowed to ``p - window < j <= p`` (made once a step)."""
        st = g.state
        masks = st.setdefault("window_masks", {})
        m = masks.get(window)
        if m is not None:
            return m
        kv = step.kv
        b = len(g.req)
        if st["fresh"]:  # keys are the new tokens, at positions 0 .. T - 1
            keys = torch.arange(int(g.q_len[0]), device=kv.device)
            q_pos = keys.view(1, -1)
        else:
            keys = torch.arange(st["max_kv"], device=kv.device)
            if g.is_decode:
                q_pos = (g.seq_lens.long() - 1).view(b, 1)
            elif st["pad"]:
                q_pos = g.positions[st["q_index"]].view(b, st["max_q"])
            else:
                q_pos = g.positions.view(1, -1)
        p = q_pos[:, :, None]
        allowed = ((keys <= p) & (keys > p - window)).unsqueeze(1)  # [B or 1, 1, Q, L]
        m = torch.zeros(allowed.shape, dtype=kv.dtype, device=kv.device)
        m = m.masked_fill_(~allowed, float("-inf"))
        masks[window] = m
        return m


#: The CPU flash-attention kernel that also returns each row's log-sum-exp (a private aten
#: op; None where this torch lacks it, and the split below is not used).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
#: Fewest new tokens for which :func:`_cached_prefill` pays off (measured on CPU float32).
SPLIT_MIN_TOKENS = 32


def _split_prefill(q: torch.Tensor, kv_len: int) -> bool:
    """Whether one request's prefill of ``q``'s rows over ``kv_len`` keys runs as
    :func:`_cached_prefill`: on the CPU, float32, at least ``SPLIT_MIN_TOKENS`` new tokens over
    a cached prefix at least as long."""
    t = q.shape[0]
    return (
        _FLASH_CPU is not None
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and t >= SPLIT_MIN_TOKENS
        and kv_len - t >= t
    )


def _cached_prefill(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """One request's prefill of ``q`` (``[T, Hq, D]``) over its cached prefix: the last ``T``
    of ``keys``/``values`` (``[1, Hkv, L, D]``) are the new tokens. Every new query sees the
    whole prefix, so that part needs no mask (and its query heads fold onto their KV head:
    ``[Hkv, G * T]`` rows); the new tokens are plain causal. The two partial attentions are
    merged by their log-sum-exps, exactly the softmax over all keys. Measured on the CPU in
    float32 against SDPA with the bottom-right causal mask: 9% less time at 321 new tokens over
    2,768 keys, 20% at 300 over 8,000 (the mask's cost grows with the prefix)."""
    assert _FLASH_CPU is not None
    t, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = hq // hkv
    c = length - t
    sc = scale if scale else d**-0.5
    qh = q.transpose(0, 1)  # [Hq, T, D]
    o1, l1 = _FLASH_CPU(
        qh.reshape(1, hkv, g * t, d), keys[:, :, :c], values[:, :, :c], 0.0, False, scale=sc
    )[:2]
    kn, vn = keys[:, :, c:], values[:, :, c:]
    if g > 1:
        kn, vn = kn.repeat_interleave(g, 1), vn.repeat_interleave(g, 1)
    o2, l2 = _FLASH_CPU(qh.unsqueeze(0), kn, vn, 0.0, True, scale=sc)[:2]
    o1, l1 = o1.reshape(1, hq, t, d), l1.reshape(1, hq, t)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]
    return o[0].transpose(0, 1).to(q.dtype)


def _explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention over head-major ``[B, H, Q, D]`` queries and ``[B, Hkv, L, D]`` keys with the
    scores computed explicitly in float32: softcapped (``softcap * tanh(s / softcap)``), the
    additive ``mask`` (or top-left causal), then a sink logit per head joining the softmax.
    Returns ``q``'s dtype."""
    hq, d = q.shape[1], q.shape[-1]
    group = hq // k.shape[1]
    kf, vf = k.float(), v.float()
    if group > 1:
        kf, vf = kf.repeat_interleave(group, dim=1), vf.repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * (scale if scale else d**-0.5)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s + mask.float()
    elif causal:
        n_q, n_k = s.shape[-2], s.shape[-1]
        top_left = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~top_left, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hq, 1, 1).expand(s.shape[0], hq, s.shape[2], 1)
        s = torch.cat([s, sink], dim=-1)
        s = s - s.amax(dim=-1, keepdim=True)
        p = torch.softmax(s, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).to(q.dtype)


def slot_matrix(block_table: torch.Tensor, max_kv_len: int, page_size: int) -> torch.Tensor:
    """``[B, max_kv_len]`` int64 slots of every key: ``block_table[b, i // P] * P + i % P``
    (keys past a request's length read its padding pages: mask them)."""
    b, pages = block_table.shape
    offs = torch.arange(page_size, device=block_table.device)
    slots = block_table.long()[:, :, None] * page_size + offs
    return slots.view(b, pages * page_size)[:, :max_kv_len].contiguous()


def _gather(kv: Any, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's K and V as ``[B, Hkv, L, D]`` views of token-major copies, gathered
    with one ``index_select`` each (whole slot rows; far faster than advanced indexing) into
    buffers reused across layers."""
    hkv, d = kv.num_kv_heads, kv.head_dim
    b, length = slots.shape
    buf_k, buf_v = kv.gather_buffers(b * length)
    flat = slots.view(-1)
    keys = torch.index_select(kv.k[layer], 0, flat, out=buf_k).view(b, length, hkv, d)
    values = torch.index_select(kv.v[layer], 0, flat, out=buf_v).view(b, length, hkv, d)
    return keys.transpose(1, 2), values.transpose(1, 2)


_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
#: SDPA broadcasts KV heads over query groups itself from torch 2.5 on.
SDPA_GQA = _VERSION >= (2, 5)


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """SDPA over head-major ``[B, H, S, D]`` inputs, KV heads shared by query groups."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and not SDPA_GQA:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    kwargs = {"enable_gqa": True} if group > 1 and SDPA_GQA else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **kwargs
    )


def batch_bucket(b: int) -> int:
    """The compiled batch size serving ``b`` requests: the next power of two."""
    return 1 << max(b - 1, 0).bit_length()


_compiled_flex: Any = None
_flex_keys: set[tuple[Any, ...]] = set()


def _flex_fn() -> Any:
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # Room for every bucket we allow ourselves (MAX_FLEX_COMPILES), so torch never reaches
        # its own limit, where it would silently run flex uncompiled.
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, MAX_FLEX_COMPILES + 8)
        cfg.accumulated_recompile_limit = max(
            cfg.accumulated_recompile_limit, MAX_FLEX_COMPILES + 8
        )
        _compiled_flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled_flex


class _Holder:
    """The step tensors the mask function reads: replaced before every call, the function kept
    (a mask function made anew each step would recompile)."""

    p2l: torch.Tensor
    seq: torch.Tensor
    page_size: int = 1
    #: ``[1]`` int32: the sliding window in keys (``NO_WINDOW``: none); ``[1]`` float32: the
    #: softcap of ``_softcap_mod``.
    window: torch.Tensor
    softcap: torch.Tensor


_HOLDER = _Holder()
#: ``_HOLDER.window`` without a sliding window: more keys than any pool holds.
NO_WINDOW = 2**30


def _mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Key ``kv_idx`` (a pool slot) is visible to request ``b`` when its page is one of ``b``'s
    and its position ``j`` is below ``b``'s length ``n`` and inside the window of the query at
    ``n - 1`` (``n - 1 - window < j``)."""
    p = _HOLDER.page_size
    lp = _HOLDER.p2l[b, kv_idx // p]
    pos = lp * p + kv_idx % p
    n = _HOLDER.seq[b]
    return (lp >= 0) & (pos < n) & (pos >= n - _HOLDER.window[0])


def _softcap_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Gemma 2's logit softcapping of a scaled score: ``softcap * tanh(score / softcap)``."""
    c = _HOLDER.softcap[0]
    return torch.tanh(score / c) * c


class FlexBackend:
    """Decode through compiled ``flex_attention`` over the pool in place, GQA folded.

    Query ``[Bb, Hkv, G, D]`` (``Bb`` the batch bucket) against the whole pool viewed as
    ``[1, Hkv, S, D]``; one KV block per page, so a request's block list is its page table: full
    pages need no mask, the last (partial) page is masked by position. The mask function also
    excludes every page not in the request's table (``p2l``: page -> logical page, -1 when not
    the request's), so the mask is right even where block sparsity is not applied.

    A sliding window narrows each request's block list to the pages its query reads (the first
    one masked where the window starts inside it), so a window layer reads ``window + P`` keys
    however long the context; softcapping is a score modification and sinks rescale the output
    by the log-sum-exp flex returns (``o * sigmoid(lse - sink)``, CUDA only), so every layer of
    Gemma 2, Gemma 3, Mistral and Cohere2 (and of gpt-oss on CUDA) decodes through flex.
    """

    name = "flex"

    def supports(
        self, window: int | None, softcap: float | None, sinks: torch.Tensor | None
    ) -> bool:
        """Whether :meth:`attend` takes these (flex serves decode groups only): a window and a
        softcap everywhere, sinks on CUDA (they need the log-sum-exp, which compiled flex on
        the CPU does not return)."""
        return sinks is None or self.kv.device.type == "cuda"

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        #: Batch buckets this pool has compiled.
        self.compiled: set[int] = set()

    def ensure(self, bucket: int, heads: int, variant: tuple[bool, bool] = (False, False)) -> None:
        """Counts the compile that ``bucket`` with ``heads`` query heads needs (one per distinct
        shape, dtype and device in the process, and ``variant``: softcap, sinks); raises past
        ``MAX_FLEX_COMPILES``."""
        kv = self.kv
        key = (
            bucket,
            heads,
            variant,
            kv.num_kv_heads,
            kv.head_dim,
            kv.page_size,
            kv.num_slots,
            kv.dtype,
            str(kv.device),
        )
        if key not in _flex_keys:
            if len(_flex_keys) >= MAX_FLEX_COMPILES:
                raise RuntimeError(
                    f"flex attention would compile variant {len(_flex_keys) + 1} (batch bucket "
                    f"{bucket}), past MAX_FLEX_COMPILES={MAX_FLEX_COMPILES}; use "
                    "attention='sdpa' or 'auto' for this pool"
                )
            _flex_keys.add(key)
        self.compiled.add(bucket)

    def prepare(self, step: Step, g: Group) -> None:
        kv = self.kv
        dev, p, num_pages = kv.device, kv.page_size, kv.num_pages
        b = len(g.req)
        bb = batch_bucket(b)
        seq = torch.zeros(bb, dtype=torch.int32, device=dev)
        seq[:b] = g.seq_lens
        bt = g.block_table.long()
        n_pages = (g.seq_lens + (p - 1)) // p  # [b]
        # Page -> logical page of each request (-1: not its page); padding goes to a spare
        # column past the pool.
        cols = torch.arange(bt.shape[1], device=dev)
        valid = cols[None, :] < n_pages[:, None]
        target = torch.where(valid, bt, num_pages)
        p2l = torch.full((bb, num_pages + 1), -1, dtype=torch.int32, device=dev)
        p2l[:b].scatter_(1, target, cols.to(torch.int32).expand(b, -1).contiguous())
        g.state = {"p2l": p2l, "seq": seq, "bucket": bb, "masks": {}}

    def _kv_blocks(self, g: Group, window: int | None) -> tuple[torch.Tensor, ...]:
        """Each request's block lists: the full pages its query reads (no mask), then the
        partial ones (masked): the page the window starts inside, and the last page."""
        kv = self.kv
        dev, p, num_pages = kv.device, kv.page_size, kv.num_pages
        b, bb = len(g.req), g.state["bucket"]
        bt = g.block_table.long()
        seq = g.seq_lens.long()
        n_full = seq // p
        start = (seq - window).clamp(min=0) if window else torch.zeros_like(seq)
        lo = start // p  # the first page the query reads
        first_full = lo + (start % p != 0).long()
        cols = torch.arange(bt.shape[1], device=dev)
        last_col = bt.shape[1] - 1
        full_num = torch.zeros(bb, 1, 1, dtype=torch.int32, device=dev)
        full_num[:b, 0, 0] = (n_full - first_full).clamp(min=0).to(torch.int32)
        full_idx = torch.zeros(bb, 1, 1, num_pages, dtype=torch.int32, device=dev)
        shifted = (first_full[:, None] + cols[None, :]).clamp(max=last_col)
        full_idx[:b, 0, 0, : bt.shape[1]] = bt.gather(1, shifted).to(torch.int32)
        has_lo = (start % p != 0) & (lo < n_full)
        has_last = seq % p != 0
        lo_page = bt.gather(1, lo.clamp(max=last_col)[:, None])[:, 0]
        last_page = bt.gather(1, n_full.clamp(max=last_col)[:, None])[:, 0]
        part_num = torch.zeros(bb, 1, 1, dtype=torch.int32, device=dev)
        part_num[:b, 0, 0] = (has_lo.long() + has_last.long()).to(torch.int32)
        part_idx = torch.zeros(bb, 1, 1, num_pages, dtype=torch.int32, device=dev)
        part_idx[:b, 0, 0, 0] = torch.where(has_lo, lo_page, last_page).to(torch.int32)
        part_idx[:b, 0, 0, 1 % num_pages] = last_page.to(torch.int32)
        return part_num, part_idx, full_num, full_idx

    def _block_mask(self, g: Group, rows: int, window: int | None = None) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        masks = g.state["masks"]
        key = (rows, window)
        if key not in masks:
            part_num, part_idx, full_num, full_idx = self._kv_blocks(g, window)
            masks[key] = BlockMask.from_kv_blocks(
                part_num,
                part_idx,
                full_num,
                full_idx,
                BLOCK_SIZE=(rows, self.kv.page_size),
                mask_mod=_mask_mod,
                seq_lengths=(rows, self.kv.num_slots),
            )
        return masks[key]

    def attend(
        self,
        step: Step,
        g: Group,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        scale: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv = self.kv
        b, hq, d = q.shape
        hkv = kv.num_kv_heads
        group = hq // hkv
        bb = g.state["bucket"]
        qb = q.view(b, hkv, group, d)
        if bb != b:
            qb = torch.cat([qb, qb.new_zeros(bb - b, hkv, group, d)])
        keys = kv.k[layer].permute(1, 0, 2).unsqueeze(0)
        values = kv.v[layer].permute(1, 0, 2).unsqueeze(0)
        self.ensure(bb, hq, (softcap is not None, sinks is not None))
        mask = self._block_mask(g, group, window)
        # This step's tensors, for the mask function (its holder outlives steps).
        _HOLDER.p2l, _HOLDER.seq, _HOLDER.page_size = g.state["p2l"], g.state["seq"], kv.page_size
        _HOLDER.window = torch.tensor([window or NO_WINDOW], dtype=torch.int32, device=kv.device)
        extra: dict[str, Any] = {}
        if softcap is not None:
            _HOLDER.softcap = torch.tensor([softcap], dtype=torch.float32, device=kv.device)
            extra["score_mod"] = _softcap_mod
        if sinks is None:
            o = _flex_fn()(qb, keys, values, block_mask=mask, scale=scale, **extra)
            return o[:b].reshape(b, hq, d)
        o, lse = _flex_fn()(
            qb, keys, values, block_mask=mask, scale=scale, return_lse=True, **extra
        )
        # A sink logit s per head joins the softmax: o' = o * e^lse / (e^lse + e^s).
        keep = torch.sigmoid(lse[:b].float() - sinks.float().view(1, hkv, group))
        return (o[:b].float() * keep[..., None]).to(q.dtype).reshape(b, hq, d)


class VarlenBackend:
    """``torch.nn.attention.varlen.varlen_attn`` over the pool in place with ``block_table``
    (CUDA; the pool is viewed as ``[num_pages, page_size, Hkv, D]``)."""

    name = "varlen"

    @staticmethod
    def supports(window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> bool:
        """Whether :meth:`attend` takes these: a sliding window (``window_size``), no softcap
        or sinks."""
        return softcap is None and sinks is None

    def prepare(self, step: Step, g: Group) -> None:
        dev = step.kv.device
        cu_q = torch.from_numpy(g.q_start.astype(np.int32)).to(dev)
        cu_k = torch.from_numpy(np.concatenate([[0], np.cumsum(g.kv_len)]).astype(np.int32))
        g.state = {
            "cu_q": cu_q,
            "cu_k": cu_k.to(dev),
            "max_q": int(g.q_len.max()),
            "max_k": int(g.kv_len.max()),
        }

    def attend(
        self,
        step: Step,
        g: Group,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        scale: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        kv, st = step.kv, g.state
        p = kv.page_size
        keys = kv.k[layer].view(kv.num_pages, p, kv.num_kv_heads, kv.head_dim)
        values = kv.v[layer].view(kv.num_pages, p, kv.num_kv_heads, kv.head_dim)
        out = varlen_attn(
            q,
            keys,
            values,
            st["cu_q"],
            st["cu_k"],
            st["max_q"],
            st["max_k"],
            scale=scale,
            # (left, right) keys beside the query's own: p - window < j <= p.
            window_size=(window - 1 if window else -1, 0),
            enable_gqa=q.shape[1] != kv.num_kv_heads,
            seqused_k=g.seq_lens,
            block_table=g.block_table,
        )
        return out  # type: ignore[return-value]


class FlashInferBackend:
    """FlashInfer's batch paged prefill wrapper (decode rows included), planned once per step
    from the CSR page triplet (CUDA; ``pip install flashinfer-python``)."""

    name = "flashinfer"

    @staticmethod
    def supports(window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> bool:
        """Whether :meth:`attend` takes these: a window (``window_left``) and a softcap
        (``logits_soft_cap``), no sinks."""
        return sinks is None

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        self.workspace = torch.empty(128 << 20, dtype=torch.uint8, device=kv.device)
        self._workspaces: dict[Any, torch.Tensor] = {None: self.workspace}

    def prepare(self, step: Step, g: Group) -> None:
        flashinfer = importlib.import_module("flashinfer")  # optional: CUDA only
        dev, p = step.kv.device, step.kv.page_size
        pages = ((g.kv_len + p - 1) // p).astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        bt = g.block_table
        cols = torch.arange(bt.shape[1], device=dev)
        indices = bt[cols[None, :] < torch.from_numpy(pages).to(dev)[:, None]]
        last = (g.kv_len - (pages - 1) * p).astype(np.int32)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        args = (
            torch.from_numpy(g.q_start.astype(np.int32)).to(dev),
            torch.from_numpy(indptr).to(dev),
            indices,
            torch.from_numpy(last).to(dev),
        )
        g.state = {"wrappers": {None: w}, "args": args, "planned": {}}

    def attend(
        self,
        step: Step,
        g: Group,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        scale: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv, p = step.kv, step.kv.page_size
        shape = (kv.num_pages, p, kv.num_kv_heads, kv.head_dim)
        paged = (kv.k[layer].view(shape), kv.v[layer].view(shape))
        st = g.state
        # One planned wrapper per (window, softcap) a step's layers use (local and global
        # layers alternate), planned at its first layer: Hq known there.
        variant = None if window is None and softcap is None else (window, softcap)
        w = st["wrappers"].get(variant)
        if w is None:
            flashinfer = importlib.import_module("flashinfer")
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace_for(variant), "NHD")
            st["wrappers"][variant] = w
        if st["planned"].get(variant) != (q.shape[1], scale):
            w.plan(
                *st["args"],
                q.shape[1],
                kv.num_kv_heads,
                kv.head_dim,
                p,
                causal=True,
                sm_scale=scale,
                q_data_type=kv.dtype,
                kv_data_type=kv.dtype,
                window_left=window - 1 if window else -1,
                logits_soft_cap=softcap,
            )
            st["planned"][variant] = (q.shape[1], scale)
        return w.run(q, paged)  # type: ignore[no-any-return]

    def workspace_for(self, variant: Any) -> torch.Tensor:
        """The workspace of the wrapper of ``variant`` (one per variant: a wrapper's plan lives
        in its workspace)."""
        ws = self._workspaces.get(variant)
        if ws is None:
            ws = torch.empty(128 << 20, dtype=torch.uint8, device=self.kv.device)
            self._workspaces[variant] = ws
        return ws
