"""`KVCache`: the paged K/V tensors of every layer, indexed by a `RadixCache` or `BlockCache`.

The Rust cache decides which *slot* holds the KV of which token; this class owns the tensors those
slots index. Slot ``s`` of layer ``l`` is row ``s`` of ``k[l]`` and ``v[l]``:

```text
  k[l]:  [num_pages * page_size, num_kv_heads, head_dim]      ("NHD", slot-major)
          |-- page 0 --|-- page 1 --| ... one page = page_size consecutive slots
```
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

import radixkv
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
    ) -> None:
        if not isinstance(cache, (radixkv.RadixCache, radixkv.BlockCache)):
            raise TypeError(f"cache must be a RadixCache or BlockCache, got {type(cache).__name__}")
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
            f"device={self.device})"
        )
