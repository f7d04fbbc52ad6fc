"""The Triton backend: paged attention kernels (:mod:`.triton_kernels`) reading K and V in the
pool where they are, through the step's page table.

A decode group runs the split-KV decode kernel; any other group runs the prefill kernel over
its requests of several new tokens, and its decode rows (requests of one new token: a mixed
step's) through the split-KV decode kernel too, read in place by their indices
(:func:`.triton_kernels.paged_mixed`). Windows, softcaps and sinks are kernel flags, so every
layer of Gemma 2/3, gpt-oss, Mistral and Qwen2 over the full pool runs here. Per step the
backend builds only the prefill tiles and decode rows (from the plan's host arrays, one pinned,
non-blocking host-to-device copy: no host sync); per layer it launches one to three kernels and
allocates nothing but the output (the split-KV scratch grows to the largest launch and is
reused). Tile sizes, warps and stages are the kernels' table entry for the device's
architecture, the pool's dtype and head dim (:data:`.triton_kernels.CONFIGS`, checked ahead of
time for sm_80/90/100), fixed for the pool.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixkv.kv.backends.group import Group, Step
from radixkv.kv.host_copy import to_device


def _packed(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """int32 device tensors of ``lists`` from one host-to-device copy, each starting 16 bytes
    apart: Triton compiles a kernel again for a pointer argument that is not 16-byte aligned,
    so their alignment must not depend on how long the lists before them are."""
    sizes = [len(x) for x in lists]
    width = [-(-n // 4) * 4 for n in sizes]
    flat = np.zeros(sum(width), dtype=np.int32)
    at = 0
    for x, w in zip(lists, width):
        flat[at : at + len(x)] = x
        at += w
    parts = to_device(flat, device).split(width)
    return [t[:n] for t, n in zip(parts, sizes)]


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
        #: Split-KV scratch (partial outputs, log-sum-exps), flat fp32 buffers grown to the
        #: largest launch so far; each launch reads a view of their start. Launches run in
        #: stream order, so the decode groups, mixed steps and window layers share them.
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, step: Step, g: Group) -> None:
        kv = self.kv
        if g.is_decode:
            splits = self.kernels.decode_splits(len(g.req), kv.num_kv_heads, kv.device)
            g.state = {"splits": splits}
            return
        if g.rows is None and step is not None:
            qo = step.qo_indptr
        else:
            qo = to_device(np.asarray(g.q_start, dtype=np.int32), kv.device)
        # The decode rows of a mixed step go to the split-KV kernel, bounded by their count.
        n_dec = int((g.q_len == 1).sum())
        splits = self.kernels.decode_splits(n_dec, kv.num_kv_heads, kv.device) if n_dec else 0
        g.state = {"qo": qo, "tiles": {}, "splits": splits}

    def _tiles(
        self, g: Group, group: int
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], int, tuple[torch.Tensor, torch.Tensor] | None]:
        """The prefill tiles of ``g`` for ``group`` query heads per KV head, their rows a tile,
        and its decode rows (``(requests, tokens)``, None when it has none), in one
        host-to-device copy (made at the step's first layer: every layer has the same heads)."""
        tiles = g.state["tiles"]
        got = tiles.get(group)
        if got is None:
            max_q = int(g.q_len.max()) if g.max_q_len is None else g.max_q_len
            block_q = self.kernels.prefill_block_q(group, max_q, self.prefill_rows)
            req, q0, dec, tok = self.kernels.mixed_tiles(
                g.q_len.tolist(), g.q_start.tolist(), block_q
            )
            parts = _packed([req, q0, dec, tok], self.kv.device)
            rows = (parts[2], parts[3]) if dec else None
            got = tiles[group] = ((parts[0], parts[1]), block_q, rows)
        return got

    def _decode_scratch(
        self, b: int, hq: int, splits: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views ``[b, hq, splits, d]`` and ``[b, hq, splits]`` of the scratch (None at one
        split: the kernel writes the output itself)."""
        if splits == 1:
            return None
        need = b * hq * splits
        if self._scratch is None or self._scratch[0].numel() < need * d:
            dev = self.kv.device
            o = torch.empty(need * d, dtype=torch.float32, device=dev)
            self._scratch = (o, torch.empty(need, dtype=torch.float32, device=dev))
        o, lse = self._scratch
        return o[: need * d].view(b, hq, splits, d), lse[:need].view(b, hq, splits)

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
        tiles, block_q, rows = self._tiles(g, hq // kv.num_kv_heads)
        if rows is None:
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
        splits = g.state["splits"]
        return self.kernels.paged_mixed(
            q,
            k_pool,
            v_pool,
            g.block_table,
            g.seq_lens,
            g.state["qo"],
            tiles,
            block_q,
            rows,
            sc,
            kv.page_size,
            window=window,
            softcap=softcap,
            sinks=sinks,
            splits=splits,
            scratch=self._decode_scratch(rows[0].shape[0], hq, splits, d),
        )

    def warmup(self, num_heads: int, batch_sizes: list[int], scale: float) -> list[int]:
        """Compiles the kernels decode steps of ``batch_sizes`` requests, prefills and mixed
        steps will launch, for ``num_heads`` query heads: each launched once over rows with no
        keys (they read nothing and write only their own zero outputs). Returns the batch
        sizes."""
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
        # A mixed step's decode rows (picked by index) at one split and at several.
        rows = (torch.zeros(1, dtype=torch.int32, device=dev),) * 2
        empty = torch.zeros(1, dtype=torch.int32, device=dev)
        for splits in (1, 2):
            tk.paged_decode(q, kv.k[0], kv.v[0], table, empty, scale, kv.page_size,
                            splits=splits, rows=rows, out=torch.empty_like(q))  # fmt: skip
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
