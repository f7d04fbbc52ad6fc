"""Attention with what full causal attention lacks: a sliding window, logit softcapping and
attention sinks, exactly as the models that use them define them, over a step's paged KV.

Sliding-window layers (Mistral's ``sliding_window``, the local layers of Gemma 2 and 3, Cohere2,
gpt-oss and Qwen2 with ``use_sliding_window``) let a token at position ``p`` attend to the keys at
positions ``p - window < j <= p``, as transformers' ``sliding_window_overlay`` masks. The pool
keeps every token's KV (the window only narrows what each query reads), so a cached prefix is
reusable at any length, and reuse is exact. Softcapping (Gemma 2) squashes the scaled scores by
``softcap * tanh(scores / softcap)`` before the mask; a sink (gpt-oss) is one learned logit per
head that joins each query's softmax and is dropped after it.

:func:`attend_exact` is the reference: each request's keys gathered, the scores computed in
float32 and masked, one request at a time; the tests hold every backend to it. A step serves
these layers through each group's backend where that backend takes them (SDPA: all; flex, in
decode: windows through block lists narrowed to the window, softcaps as a score modification,
sinks on CUDA; varlen: windows; FlashInfer: windows and softcaps), else through the SDPA
backend's groups for that layer.
"""

from __future__ import annotations

from typing import Any

import torch


def check_extras(
    window: int | None, softcap: float | None, sinks: torch.Tensor | None, heads: int
) -> None:
    """``ValueError``/``TypeError`` naming the bad value: ``window`` a positive int, ``softcap`` a
    positive number, ``sinks`` a float tensor of one logit per query head."""
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"window must be a positive int (tokens) or None, got {window!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0
    ):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            raise TypeError(f"sinks must be a float tensor, got {type(sinks).__name__}")
        if sinks.numel() != heads:
            raise ValueError(
                f"sinks must hold one logit per query head ({heads}), got shape "
                f"{tuple(sinks.shape)}"
            )


def attend_exact(
    step: Any,  # the Step (not imported: step imports this module)
    layer: int,
    q: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query of ``q`` (``[T, Hq, D]``, the step's packed tokens, their K/V already in the
    pool) attends to its request's keys at positions ``p - window < j <= p`` (every ``j <= p``
    without a window), scores ``scale * q.k`` softcapped, a sink logit per head joining the
    softmax. Returns ``[T, Hq, D]`` in ``q``'s dtype."""
    kv = step.kv
    hq = q.shape[1]
    group = hq // kv.num_kv_heads
    out = torch.empty_like(q)
    slots = step.kv_slots
    pool_k, pool_v = kv.k[layer], kv.v[layer]
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(step.q_len_list, step.kv_len_list)):
        rows = slice(start, start + q_len)
        start += q_len
        # Only the keys some query of this request can see.
        q_pos = step.positions[rows]
        first = 0
        if window is not None:
            first = max(0, int(q_pos.min()) - window + 1)
        s = slots[b, first:kv_len]
        keys = pool_k.index_select(0, s).float()  # [L, Hkv, D]
        values = pool_v.index_select(0, s).float()
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        k_pos = torch.arange(first, kv_len, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(hq, 1, 1).expand(hq, q_len, 1)
            scores = torch.cat([scores, sink], dim=-1)
            scores = scores - scores.amax(dim=-1, keepdim=True)
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out
