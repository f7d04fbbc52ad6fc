"""Host arrays onto a device without making the host wait: pinned, non-blocking copies.

A copy from ordinary (pageable) host memory to a CUDA device makes the CPU wait for the copy
(torch synchronizes the stream after it); from page-locked memory with ``non_blocking=True`` it
is queued on the current stream and the CPU goes on. torch's caching host allocator keeps a
pinned block until the copies reading it have run, so the source may be dropped at once. On the
CPU the array itself becomes the tensor (no copy at all).
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``array`` as a tensor on ``device``: the array's own memory on the CPU, else one pinned,
    non-blocking host-to-device copy (queued on the current stream; no host sync)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
