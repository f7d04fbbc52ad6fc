"""What every attention backend shares: the :class:`Group` a backend serves, the slot matrix
of gathered keys, and the batch buckets of compiled backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: A :class:`radixkv.kv.step.Step` (not imported: the step module imports the backends).
Step = Any


@dataclass
class Group:
    """The requests of a step that one backend serves, in step order.

    ``req``: their indices in the step; ``rows``: their packed query rows (``None`` when the
    group is the whole step); host copies of their lengths; device tensors of their page table.
    """

    req: np.ndarray
    rows: torch.Tensor | None
    q_len: np.ndarray
    kv_len: np.ndarray
    q_start: np.ndarray
    positions: torch.Tensor  # [Tg] int64
    block_table: torch.Tensor  # [Bg, max_pages] int32
    seq_lens: torch.Tensor  # [Bg] int32
    is_decode: bool
    state: Any = None
    #: Whether the group's keys are the full pool's, so a decode group may read them from the
    #: pool's :class:`~radixkv.kv.backends.mirror.DecodeMirror` (not the window layers' groups).
    mirror: bool = False
    #: Longest ``q_len`` and ``kv_len`` when known (the step's own, for a group of the whole
    #: step), else computed from them.
    max_q_len: int | None = None
    max_kv_len: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.q_start[-1])


def slot_matrix(block_table: torch.Tensor, max_kv_len: int, page_size: int) -> torch.Tensor:
    """``[B, max_kv_len]`` int64 slots of every key: ``block_table[b, i // P] * P + i % P``
    (keys past a request's length read its padding pages: mask them)."""
    b, pages = block_table.shape
    offs = torch.arange(page_size, device=block_table.device)
    slots = block_table.long()[:, :, None] * page_size + offs
    return slots.view(b, pages * page_size)[:, :max_kv_len].contiguous()


def batch_bucket(b: int) -> int:
    """The compiled batch size serving ``b`` requests: the next power of two."""
    return 1 << max(b - 1, 0).bit_length()
