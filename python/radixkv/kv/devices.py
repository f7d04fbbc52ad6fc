"""Devices compared as torch compares them: ``"cuda"`` is the current CUDA device."""

from __future__ import annotations

import torch


def canonical(device: str | torch.device) -> torch.device:
    """``device`` with its index filled in as torch would place a tensor: ``"cuda"`` becomes
    ``cuda:<current device>`` (where CUDA is available); every other device as given."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def same(a: str | torch.device, b: str | torch.device) -> bool:
    """Whether tensors on ``a`` and on ``b`` live on one device (``"cuda"`` and ``"cuda:0"``
    do while device 0 is current)."""
    return canonical(a) == canonical(b)
