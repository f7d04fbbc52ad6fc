"""Decode steps over tensors whose addresses never change: what a CUDA graph replays.

A :class:`DecodeBuffers` holds, for up to ``max_batch`` requests of up to ``max_pages`` pages,
one int64 tensor on the device and its pinned host twin, laid out by field::

    [ input_ids | positions | write_slots | seq_lens | block_table (max_batch x max_pages) ]
      max_batch   max_batch   max_batch     max_batch

A decode step of ``B`` requests padded to a batch bucket ``b >= B`` is written into the host
twin (rows ``B..b`` padded: slot -1, no keys) and moved with one non-blocking copy of the
fields and the bucket's rows of the table; a
:class:`StaticDecodeStep` of bucket ``b`` reads the first ``b`` rows of each field, always the
same views. Its attention writes the new K/V with :func:`~.backends.triton_kernels.store_kv`
(padded rows write nothing) and attends with the split-KV decode kernel (padded rows have no
keys and give zeros): no host sync, no allocation but the kernels' outputs, a grid fixed by the
bucket. On the CPU the same code runs without a graph (under Triton's interpreter), which is how
the tests check it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from radixkv.kv.backends import triton_kernels as _tk

FIELDS = 4  # input_ids, positions, write_slots, seq_lens


class DecodeBuffers:
    """The fixed-address step tensors of one :class:`~radixkv.KVCache` (see the module)."""

    def __init__(self, kv: Any, max_batch: int, max_pages: int) -> None:
        self.kv = kv
        self.max_batch = max_batch
        self.max_pages = max_pages
        n = max_batch * (FIELDS + max_pages)
        pin = kv.device.type == "cuda"
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._host_np = self.host.numpy()
        on_host = kv.device.type == "cpu"
        self.dev = self.host if on_host else torch.zeros_like(self.host, device=kv.device)
        #: The last copy's completion: the host twin is rewritten only after it (CUDA).
        self._copied: Any = None

    def field(self, i: int, rows: int) -> torch.Tensor:
        """Rows ``0..rows`` of field ``i`` on the device (the same view every step)."""
        start = i * self.max_batch
        return self.dev[start : start + rows]

    def block_table(self, rows: int) -> torch.Tensor:
        start = FIELDS * self.max_batch
        return self.dev[start : start + rows * self.max_pages].view(rows, self.max_pages)

    def fill(self, step: Any, bucket: int) -> None:
        """Writes the decode ``step`` (``B <= bucket`` requests, one new token each) into the
        buffers, rows past ``B`` padded, with one host-to-device copy."""
        plan = step._plan
        b, m, w = len(step.requests), self.max_batch, self.max_pages
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # in an engine never: the last step's tokens came back
        h = self._host_np
        longs = plan.longs  # input_ids, positions, write_slots, last_token_index, kv_len
        h[0:b] = longs[0:b]
        h[m : m + b] = longs[b : 2 * b]
        h[2 * m : 2 * m + b] = longs[2 * b : 3 * b]
        h[3 * m : 3 * m + b] = longs[4 * b : 5 * b]
        pad = slice(b, bucket)
        h[0:m][pad] = 0
        h[m : 2 * m][pad] = 0
        h[2 * m : 3 * m][pad] = -1  # nothing written
        h[3 * m : 4 * m][pad] = 0  # no keys: the row's output is 0
        table = h[FIELDS * m : FIELDS * m + bucket * w].reshape(bucket, w)
        bt = np.asarray(plan.block_table)
        table[:b, : bt.shape[1]] = bt
        self._copy(bucket)

    def pad(self, bucket: int) -> None:
        """Rows ``0..bucket`` all padding (no keys, nothing written): what the graphs are
        warmed up and captured over."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()
        m, w = self.max_batch, self.max_pages
        h = self._host_np
        h[: FIELDS * m + bucket * w] = 0
        h[2 * m : 3 * m] = -1
        self._copy(bucket)

    def _copy(self, bucket: int) -> None:
        """One non-blocking copy of what a step of ``bucket`` rows reads: the fields and the
        first ``bucket`` rows of the page table (a prefix of the buffers; the rows past it are
        not read)."""
        if self.dev is not self.host:
            n = FIELDS * self.max_batch + bucket * self.max_pages
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()


class StaticDecodeStep:
    """A decode step of ``bucket`` rows over :class:`DecodeBuffers`: a
    :class:`~radixkv.kv.step.StepLike`, what a model forward uses of a step (``input_ids``,
    ``positions``, ``is_decode``, ``last_token_index``, ``attention``). Made once per bucket;
    every call reads what the buffers hold at that moment."""

    is_decode = True

    def __init__(self, buffers: DecodeBuffers, bucket: int) -> None:
        kv = buffers.kv
        self.kv = kv
        self.bucket = bucket
        self.num_tokens = bucket
        self.input_ids = buffers.field(0, bucket)
        self.positions = buffers.field(1, bucket)
        self.write_slots = buffers.field(2, bucket)
        self.seq_lens = buffers.field(3, bucket)
        self.block_table = buffers.block_table(bucket)
        self.last_token_index = torch.arange(bucket, device=kv.device)
        self.splits = _tk.decode_splits(bucket, kv.num_kv_heads, kv.device)
        self._scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Writes ``k``/``v`` at the step's slots and attends each query to its request's keys
        (as :meth:`radixkv.kv.step.Step.attention` does for a decode step)."""
        kv = self.kv
        pool_k, pool_v = kv.k[layer], kv.v[layer]
        if k.dtype != pool_k.dtype or v.dtype != pool_v.dtype:
            k, v = k.to(pool_k.dtype), v.to(pool_v.dtype)
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        _tk.store_kv(k, v, self.write_slots, pool_k, pool_v)
        out_dtype = q.dtype
        if q.dtype != pool_k.dtype:
            q = q.to(pool_k.dtype)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if scale is None:
            scale = 1.0 / math.sqrt(kv.head_dim)
        if sinks is not None:
            sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
        hq = q.shape[1]
        scratch = self._scratch.get(hq)
        if scratch is None:
            d = kv.head_dim
            f32 = dict(dtype=torch.float32, device=q.device)
            scratch = self._scratch[hq] = (
                torch.empty((self.bucket, hq, self.splits, d), **f32),  # type: ignore[arg-type]
                torch.empty((self.bucket, hq, self.splits), **f32),  # type: ignore[arg-type]
            )
        out = _tk.paged_decode(
            q,
            pool_k,
            pool_v,
            self.block_table,
            self.seq_lens,
            scale,
            kv.page_size,
            window=window,
            softcap=softcap,
            sinks=sinks,
            splits=self.splits,
            scratch=scratch,
        )
        return out if out.dtype == out_dtype else out.to(out_dtype)
