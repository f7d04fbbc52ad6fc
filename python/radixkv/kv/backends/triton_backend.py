"""The Triton backend: paged attention kernels (:mod:`.triton_kernels`) reading K and V in the
pool where they are, through the step's page table.

A decode group runs the split-KV decode kernel; any other group (prefill, or a mixed step: a
decode row is a request with one new token) runs the prefill kernel, one launch for the whole
group. Windows, softcaps and sinks are kernel flags, so every layer of Gemma 2/3, gpt-oss,
Mistral and Qwen2 over the full pool runs here. Per step the backend builds only the prefill
tiles (from the plan's host arrays, one host-to-device copy); per layer it launches one or two
kernels and allocates nothing but the output. Tile sizes, warps and stages are the kernels'
table entry for the device's architecture, the pool's dtype and head dim
(:data:`.triton_kernels.CONFIGS`, checked ahead of time for sm_80/90/100), fixed for the pool.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixkv.kv.backends.group import Group, Step


class TritonBackend:
    """Paged decode and prefill through Triton (CUDA; the CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    static_decode = True
    window_pool = True

    @staticmethod
    def supports(window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> bool:
        """Whether :meth:`attend` takes these: windows, softcaps and sinks, all in the kernels."""
        return True

    def __init__(self, kv: Any) -> None:
        # Imported here, not with the package: Triton reads TRITON_INTERPRET when a kernel is
        # defined, and only a pool that uses this backend needs Triton at all.
        from radixkv.kv.backends import triton_kernels

        self.kv = kv
        self.kernels = triton_kernels
        arch = triton_kernels.arch_of(kv.device)
        #: The prefill tiles' rows of this pool (its table entry's ``block_m``).
        self.prefill_rows = triton_kernels.prefill_config(arch, kv.dtype, kv.head_dim).block_m
        #: Split-KV scratch of the last decode shape (partial outputs and log-sum-exps),
        #: reused by every layer and step of that shape.
        self._scratch: tuple[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] | None = None

    def prepare(self, step: Step, g: Group) -> None:
        kv = self.kv
        if g.is_decode:
            splits = self.kernels.decode_splits(len(g.req), kv.num_kv_heads, kv.device)
            g.state = {"splits": splits}
            return
        if g.rows is None and step is not None:
            qo = step.qo_indptr
        else:
            qo = torch.from_numpy(np.asarray(g.q_start, dtype=np.int32)).to(kv.device)
        g.state = {"qo": qo, "tiles": {}}

    def _tiles(self, g: Group, group: int) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
        """The prefill tiles of ``g`` for ``group`` query heads per KV head (made at the
        step's first layer: every layer has the same heads)."""
        tiles = g.state["tiles"]
        got = tiles.get(group)
        if got is None:
            max_q = int(g.q_len.max()) if g.max_q_len is None else g.max_q_len
            block_q = self.kernels.prefill_block_q(group, max_q, self.prefill_rows)
            req, q0 = self.kernels.prefill_tiles(g.q_len.tolist(), block_q)
            both = torch.from_numpy(np.asarray([req, q0], dtype=np.int32)).to(self.kv.device)
            got = tiles[group] = ((both[0], both[1]), block_q)
        return got

    def _decode_scratch(
        self, b: int, hq: int, splits: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (b, hq, splits, d)
        if self._scratch is None or self._scratch[0] != key:
            dev = self.kv.device
            o = torch.empty((b, hq, splits, d), dtype=torch.float32, device=dev)
            lse = torch.empty((b, hq, splits), dtype=torch.float32, device=dev)
            self._scratch = (key, (o, lse))
        return self._scratch[1]

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
        t, hq, d = q.shape
        sc = scale if scale else d**-0.5
        if q.stride(-1) != 1:
            q = q.contiguous()
        if sinks is not None:
            sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
        k_pool, v_pool = kv.k[layer], kv.v[layer]
        if g.is_decode:
            splits = g.state["splits"]
            return self.kernels.paged_decode(
                q,
                k_pool,
                v_pool,
                g.block_table,
                g.seq_lens,
                sc,
                kv.page_size,
                window=window,
                softcap=softcap,
                sinks=sinks,
                splits=splits,
                scratch=self._decode_scratch(t, hq, splits, d),
            )
        tiles, block_q = self._tiles(g, hq // kv.num_kv_heads)
        return self.kernels.paged_prefill(
            q,
            k_pool,
            v_pool,
            g.block_table,
            g.seq_lens,
            g.state["qo"],
            tiles,
            block_q,
            sc,
            kv.page_size,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )

    def warmup(self, num_heads: int, batch_sizes: list[int], scale: float) -> list[int]:
        """Compiles the kernels decode steps of ``batch_sizes`` requests and prefills will
        launch, for ``num_heads`` query heads: each launched once over rows with no keys (they
        read nothing and write only their own zero outputs). Returns the batch sizes."""
        kv, tk = self.kv, self.kernels
        dev, d = kv.device, kv.head_dim
        sizes = sorted(set(batch_sizes))
        for b in sizes:
            q = torch.zeros((b, num_heads, d), dtype=kv.dtype, device=dev)
            table = torch.zeros((b, 1), dtype=torch.int32, device=dev)
            empty = torch.zeros(b, dtype=torch.int32, device=dev)
            splits = tk.decode_splits(b, kv.num_kv_heads, dev)
            tk.paged_decode(q, kv.k[0], kv.v[0], table, empty, scale, kv.page_size, splits=splits)
        group = num_heads // kv.num_kv_heads
        q = torch.zeros((1, num_heads, d), dtype=kv.dtype, device=dev)
        table = torch.zeros((1, 1), dtype=torch.int32, device=dev)
        one = torch.ones(1, dtype=torch.int32, device=dev)
        qo = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        tiles = (torch.zeros(1, dtype=torch.int32, device=dev),) * 2
        for max_q in (1, self.prefill_rows):  # both tile sizes
            block_q = tk.prefill_block_q(group, max_q, self.prefill_rows)
            out = torch.empty_like(q)
            # One key at slot 0 of a scratch copy: the pool itself is never written.
            k0 = torch.zeros((kv.page_size, kv.num_kv_heads, d), dtype=kv.dtype, device=dev)
            tk.paged_prefill(q, k0, k0, table, one, qo, tiles, block_q, scale, kv.page_size,
                             out=out)  # fmt: skip
        return sizes
