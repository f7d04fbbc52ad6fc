"""The SDPA backend: gathers a group's K/V from the pool into a padded copy and calls
``scaled_dot_product_attention`` (the reference every other backend is tested against).

On CUDA every SDPA call here excludes cuDNN (:func:`sdpa_kernels`): cuDNN builds a plan per
shape, and gathered keys are one longer every decode step, so it re-planned every step (40 ms of
a 64 ms step on an H200, ``../GPU.md``)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from radixkv.kv.backends.group import Group, Step, slot_matrix


class SdpaBackend:
    """Gather into a padded copy, then SDPA (the reference every other backend is tested
    against). Mask and slot matrix are built once per step and shared by every layer."""

    name = "sdpa"
    static_decode = False
    window_pool = False

    @staticmethod
    def supports(window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> bool:
        """Whether :meth:`attend` takes these (the reference takes them all)."""
        return True

    def __init__(self, kv: Any = None) -> None:
        self.kv = kv  # the pool it serves (each step names its own: ``step.kv``)

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
            o = _sdpa(qb, keys, values, mask, False, scale)
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
            o = _sdpa(qb, keys, values, lanes.mask, False, scale)
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
#: op; None where this torch lacks it, and the split below is not used on the CPU).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
#: Fewest new tokens for which :func:`_cached_prefill` pays off on the CPU (measured, float32).
SPLIT_MIN_TOKENS = 32


def _split_prefill(q: torch.Tensor, kv_len: int) -> bool:
    """Whether one request's prefill of ``q``'s rows over ``kv_len`` keys runs as
    :func:`_cached_prefill`. On CUDA whenever a prefix is cached (SDPA with a mask there is the
    memory-efficient kernel over a ``[T, L]`` bias, or the math path; unmasked and causal it is
    flash); on the CPU in float32, at least ``SPLIT_MIN_TOKENS`` new tokens over a cached prefix
    at least as long."""
    t = q.shape[0]
    if q.device.type == "cuda":
        return kv_len > t
    return (
        _FLASH_CPU is not None
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and t >= SPLIT_MIN_TOKENS
        and kv_len - t >= t
    )


def _attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of head-major ``[1, H, Q, D]`` queries over ``[1, H, L, D]`` keys, and each
    row's log-sum-exp ``[1, H, Q]`` (float32): torch's own kernels that return it (flash on
    the CPU; on CUDA flash for half types and the memory-efficient kernel for float32). With
    ``causal`` the queries are the keys (top-left is bottom-right)."""
    if q.device.type == "cpu":
        assert _FLASH_CPU is not None
        o, lse = _FLASH_CPU(q, k, v, 0.0, causal, scale=scale)[:2]
        return o, lse
    if q.dtype in (torch.float16, torch.bfloat16):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )[:2]
    return o, lse[..., : q.shape[2]]


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
    t, hq, d = q.shape
    hkv, length = keys.shape[1], keys.shape[2]
    g = hq // hkv
    c = length - t
    sc = scale if scale else d**-0.5
    qh = q.transpose(0, 1)  # [Hq, T, D]
    kp, vp = keys[:, :, :c], values[:, :, :c]
    kn, vn = keys[:, :, c:], values[:, :, c:]
    if g > 1:
        kn, vn = kn.repeat_interleave(g, 1), vn.repeat_interleave(g, 1)
    q1 = qh.reshape(1, hkv, g * t, d)
    if q.device.type == "cuda":
        q1, kp, vp = q1.contiguous(), kp.contiguous(), vp.contiguous()
        kn, vn = kn.contiguous(), vn.contiguous()
    o1, l1 = _attention_lse(q1, kp, vp, False, sc)
    o2, l2 = _attention_lse(qh.unsqueeze(0).contiguous(), kn, vn, True, sc)
    o1, l1 = o1.reshape(1, hq, t, d).float(), l1.reshape(1, hq, t).float()
    o2, l2 = o2.float(), l2.float()
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


def sdpa_context(device: torch.device) -> Any:
    """The context every SDPA call on ``device`` runs in: on CUDA, SDPA's flash,
    memory-efficient and math kernels only (cuDNN builds and caches a plan per shape; gathered
    keys change shape every step, so it re-planned every step); elsewhere nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # torch < 2.3: no cuDNN backend to exclude
        return contextlib.nullcontext()
    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    **kwargs: Any,
) -> torch.Tensor:
    """``scaled_dot_product_attention``, in :func:`sdpa_context` on CUDA: the only place this
    package calls it."""
    if q.device.type == "cuda":
        with sdpa_context(q.device):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **kwargs
            )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **kwargs
    )


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
    return _sdpa(q, k, v, mask, causal, scale, **kwargs)
