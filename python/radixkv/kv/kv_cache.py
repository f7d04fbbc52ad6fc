"""`KVCache`: the paged K/V tensors of every layer, indexed by a `RadixCache` or `BlockCache`.

The Rust cache decides which *slot* holds the KV of which token; this class owns the tensors those
slots index. Slot ``s`` of layer ``l`` is row ``s`` of ``k[l]`` and ``v[l]``:

```text
  k[l]:  [num_pages * page_size, num_kv_heads, head_dim]      ("NHD", slot-major)
          |-- page 0 --|-- page 1 --| ... one page = page_size consecutive slots
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import radixkv
from radixkv.kv import backends as _backends
from radixkv.kv.step import Step

#: Element types the pool may hold.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in DTYPES:
        names = ", ".join(str(d) for d in DTYPES)
        raise ValueError(f"dtype must be one of {names}, got {dtype!r}")
    return dtype


class KVCache:
    """Per-layer K and V pools shaped ``[num_pages * page_size, num_kv_heads, head_dim]``.

    ``cache`` (a :class:`radixkv.RadixCache` or :class:`radixkv.BlockCache`) decides which slots a
    request's tokens live in; this object holds the tensors. Rows are zero-initialised: padded
    keys of a batch read slot 0, and zeros keep masked-out scores finite.

    ``attention`` picks how steps attend (:mod:`radixkv.kv.backends`): ``"auto"`` (the fastest
    measured choice per device, dtype and step kind), ``"sdpa"`` (gather + SDPA, the reference),
    ``"flex"`` (compiled flex attention over the pool in place, decode), ``"varlen"`` (CUDA) or
    ``"flashinfer"`` (CUDA, when installed). A backend unavailable here raises ``ValueError``
    listing the available ones. Call :meth:`warmup` before serving so nothing compiles then.

    Safety rule: the KV in a slot is valid only while the cache keeps that slot's page pinned or
    published; a slot of a finished, unpublished page may be overwritten by the next admission.
    """

    def __init__(
        self,
        cache: radixkv.RadixCache | radixkv.BlockCache,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attention: str = "auto",
    ) -> None:
        if not isinstance(cache, (radixkv.RadixCache, radixkv.BlockCache)):
            raise TypeError(f"cache must be a RadixCache or BlockCache, got {type(cache).__name__}")
        if not isinstance(attention, str):
            raise TypeError(f"attention must be a str, got {type(attention).__name__}")
        _backends.check_name(attention, torch.device(device))
        self.attention = attention
        self.cache = cache
        # The cache these pools are sized and indexed for: only its requests may be planned.
        self._owner = cache
        self.num_layers = _positive("num_layers", num_layers)
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads)
        self.head_dim = _positive("head_dim", head_dim)
        self.dtype = _check_dtype(dtype)
        self.device = torch.device(device)
        self.page_size = cache.page_size
        self.num_pages = cache.num_pages
        self.num_slots = self.num_pages * self.page_size
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._gather_k: torch.Tensor | None = None
        self._gather_v: torch.Tensor | None = None
        self._backends: dict[str, Any] = {}

    def _backend(self, name: str) -> Any:
        """The backend object ``name`` of this pool (made on first use)."""
        obj = self._backends.get(name)
        if obj is None:
            if name == "sdpa":
                obj = _backends.SdpaBackend()
            elif name == "flex":
                obj = _backends.FlexBackend(self)
            elif name == "varlen":
                obj = _backends.VarlenBackend()
            else:
                obj = _backends.FlashInferBackend(self)
            self._backends[name] = obj
        return obj

    def backend_for(self, decode: bool, batch: int) -> Any:
        """The backend serving a decode (or prefill) group of ``batch`` requests. ``"flex"``
        serves decode only (prefill through SDPA measured faster); ``"auto"`` uses flex only for
        batch buckets :meth:`warmup` compiled."""
        name = self.attention
        if name == "auto":
            name = _backends.auto_choice(self.device, self.dtype, decode)
            if name == "flex":
                flex = self._backends.get("flex")
                if flex is None or _backends.batch_bucket(batch) not in flex.compiled:
                    name = "sdpa"
        if name == "flex" and not decode:
            name = "sdpa"
        return self._backend(name)

    def warmup(
        self,
        num_heads: int,
        batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32),
        scale: float | None = None,
    ) -> list[int]:
        """Compiles ahead what decode steps of ``batch_sizes`` requests will run, for queries of
        ``num_heads`` heads (a multiple of ``num_kv_heads``) and softmax ``scale`` (default
        ``1/sqrt(head_dim)``), so serving never compiles on the hot path. Only flex compiles
        (``"flex"``, and ``"auto"`` where flex is the measured choice); returns the batch
        buckets (powers of two) compiled now or before, empty where nothing compiles. Reads
        the pool, writes nothing."""
        heads = _positive("num_heads", num_heads)
        if heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads={self.num_kv_heads}, got {heads}"
            )
        sizes = [_positive("batch_sizes[]", b) for b in batch_sizes]
        name = self.attention
        if name == "auto":
            name = _backends.auto_choice(self.device, self.dtype, True)
        if name != "flex":
            return []
        flex = self._backend("flex")
        done = []
        for bucket in sorted({_backends.batch_bucket(b) for b in sizes}):
            g = _backends.Group(
                req=np.arange(bucket),
                rows=None,
                q_len=np.ones(bucket, np.int64),
                kv_len=np.ones(bucket, np.int64),
                q_start=np.arange(bucket + 1),
                positions=torch.zeros(bucket, dtype=torch.long, device=self.device),
                block_table=torch.zeros(bucket, 1, dtype=torch.int32, device=self.device),
                seq_lens=torch.ones(bucket, dtype=torch.int32, device=self.device),
                is_decode=True,
            )
            flex.prepare(None, g)
            q = torch.zeros(bucket, heads, self.head_dim, dtype=self.dtype, device=self.device)
            s = scale if scale is not None else 1.0 / math.sqrt(self.head_dim)
            flex.attend(None, g, 0, q, q, q, s)
            done.append(bucket)
        return done

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        page_size: int = 1,
    ) -> int:
        """Bytes one page takes across every layer, K and V together."""
        elem = torch.empty((), dtype=_check_dtype(dtype)).element_size()
        per_token = (
            2 * _positive("num_layers", num_layers) * _positive("num_kv_heads", num_kv_heads)
        )
        return (
            per_token * _positive("head_dim", head_dim) * elem * _positive("page_size", page_size)
        )

    @staticmethod
    def pages_for_budget(
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        page_size: int = 1,
    ) -> int:
        """How many pages fit in ``budget_bytes`` of K/V memory (at least one page must fit)."""
        page = KVCache.bytes_per_page(num_layers, num_kv_heads, head_dim, dtype, page_size)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
            raise TypeError(f"budget_bytes must be an int, got {budget_bytes!r}")
        if budget_bytes < page:
            raise ValueError(f"budget_bytes={budget_bytes} is smaller than one page ({page} bytes)")
        return int(budget_bytes) // page

    def gather_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two contiguous ``[rows, num_kv_heads, head_dim]`` scratch tensors that attention
        gathers each batch's K and V into. Kept between layers and steps (grown when a step
        needs more): allocating megabytes afresh in every layer costs more than the gather
        itself on CPU. Their contents are valid only inside one ``Step.attention`` call."""
        if self._gather_k is None or self._gather_k.shape[0] < rows:
            size = max(rows, 64)
            shape = (size, self.num_kv_heads, self.head_dim)
            self._gather_k = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._gather_v = torch.empty(shape, dtype=self.dtype, device=self.device)
        assert self._gather_v is not None  # allocated together with _gather_k
        return self._gather_k[:rows], self._gather_v[:rows]

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V pools of every layer (the gather buffers not included)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def plan(self, requests: Sequence[radixkv.Request]) -> Step:
        """Plans one forward pass over ``requests``: each request's tokens
        ``num_computed:num_tokens``, packed in order. One call into Rust, one host-to-device copy.

        Raises ``ValueError``, before anything is computed, for a request of another cache or
        one named twice; ``TypeError`` for anything but a ``Request``.
        """
        requests = list(requests)
        if len(requests) == 0:
            raise ValueError("requests must hold at least one request, got none")
        seen: dict[int, int] = {}
        for i, r in enumerate(requests):
            if not isinstance(r, radixkv.Request):
                raise TypeError(f"requests[{i}] must be a Request, got {type(r).__name__}")
            if r.cache is not self._owner:
                # Its slots index another pool: writing them here would overwrite KV this
                # cache has published and still serves.
                raise ValueError(f"requests[{i}] belongs to another cache than this KVCache's")
            j = seen.setdefault(id(r), i)
            if j != i:
                raise ValueError(f"requests[{i}] repeats requests[{j}]: plan each request once")
        plan = radixkv.plan_step(requests)
        return Step(self, requests, plan)

    def commit(self, step: Step) -> None:
        """Marks the KV of every token planned in ``step`` as written (publishing full pages).
        One call into Rust for the whole step (``commit_many``: all requests or none)."""
        if step.kv is not self:
            raise ValueError("step was planned by another KVCache")
        self.cache.commit_many(step.requests, step.kv_len_list)

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, num_slots={self.num_slots}, dtype={self.dtype}, "
            f"device={self.device}, attention={self.attention!r})"
        )
