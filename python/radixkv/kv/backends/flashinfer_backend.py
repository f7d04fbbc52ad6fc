"""The FlashInfer backend: its paged wrappers over the pool in place (CUDA, when installed)."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch

from radixkv.kv.backends.group import Group, Step


class FlashInferBackend:
    """FlashInfer's paged wrappers over the pool in place: the decode wrapper for decode groups,
    the prefill wrapper (decode rows included) for the rest. Each is planned once per step and
    variant from host arrays: the page-table rows of the plan (already on the host), cut to each
    request's pages by numpy, so planning neither builds a mask nor waits for the device; the
    page indices go to the device in one copy (CUDA; ``pip install flashinfer-python``)."""

    name = "flashinfer"
    static_decode = False
    window_pool = False

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
        dev, p = self.kv.device, self.kv.page_size
        pages = ((g.kv_len + p - 1) // p).astype(np.int32)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        table = np.asarray(step._plan.block_table)[g.req]
        keep = np.arange(table.shape[1])[None, :] < pages[:, None]
        indices = torch.from_numpy(np.ascontiguousarray(table[keep], dtype=np.int32)).to(dev)
        last = (g.kv_len - (pages - 1) * p).astype(np.int32)
        host = (
            torch.from_numpy(np.asarray(g.q_start, dtype=np.int32)),
            torch.from_numpy(indptr),
            torch.from_numpy(last),
        )
        g.state = {"wrappers": {}, "host": host, "indices": indices, "planned": {}}

    def _wrapper(self, g: Group, variant: Any, decode: bool) -> Any:
        w = g.state["wrappers"].get(variant)
        if w is None:
            flashinfer = importlib.import_module("flashinfer")  # optional: CUDA only
            ws = self.workspace_for(variant)
            if decode:
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            else:
                w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            g.state["wrappers"][variant] = w
        return w

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
        kv, p = self.kv, self.kv.page_size
        shape = (kv.num_pages, p, kv.num_kv_heads, kv.head_dim)
        paged = (kv.k[layer].view(shape), kv.v[layer].view(shape))
        st = g.state
        # One planned wrapper per (window, softcap) a step's layers use (local and global
        # layers alternate), planned at its first layer: Hq known there.
        variant = None if window is None and softcap is None else (window, softcap)
        w = self._wrapper(g, variant, g.is_decode)
        if st["planned"].get(variant) != (q.shape[1], scale):
            qo, indptr, last = st["host"]
            common = dict(
                window_left=window - 1 if window else -1,
                logits_soft_cap=softcap,
                sm_scale=scale,
                q_data_type=kv.dtype,
                kv_data_type=kv.dtype,
            )
            if g.is_decode:
                w.plan(
                    indptr, st["indices"], last, q.shape[1], kv.num_kv_heads, kv.head_dim, p,
                    **common,
                )  # fmt: skip
            else:
                w.plan(
                    qo, indptr, st["indices"], last, q.shape[1], kv.num_kv_heads, kv.head_dim,
                    p, causal=True, **common,
                )  # fmt: skip
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
