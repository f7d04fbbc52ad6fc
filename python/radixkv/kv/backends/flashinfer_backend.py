"""The FlashInfer backend: its paged wrappers over the pool in place (CUDA, when installed)."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch

from radixkv.kv.backends.group import Group, Step


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
