"""The varlen backend: ``torch.nn.attention.varlen.varlen_attn`` with ``block_table``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixkv.kv.backends.group import Group, Step


class VarlenBackend:
    """``torch.nn.attention.varlen.varlen_attn`` over the pool in place with ``block_table``
    (CUDA; the pool is viewed as ``[num_pages, page_size, Hkv, D]``)."""

    name = "varlen"
    static_decode = False
    window_pool = False

    @staticmethod
    def supports(window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> bool:
        """Whether :meth:`attend` takes these: a sliding window (``window_size``), no softcap
        or sinks."""
        return softcap is None and sinks is None

    def __init__(self, kv: Any = None) -> None:
        self.kv = kv  # the pool it serves (each step names its own: ``step.kv``)

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
