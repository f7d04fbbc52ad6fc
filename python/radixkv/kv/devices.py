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


def rank_device(device: str | torch.device | None, what: str = "device") -> torch.device:
    """The device kind the ranks of a tensor-parallel model run on: ``cuda`` where CUDA is
    available (each rank on ``cuda:LOCAL_RANK``), else ``cpu``. ``device`` (what the caller
    named ``what``) may only repeat that kind; another kind, or an index, is a ``ValueError``
    saying where the ranks run."""
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    if device is not None and str(device) != kind:
        where = "cuda:0 to cuda:N-1" if kind == "cuda" else "the CPU (no CUDA device here)"
        raise ValueError(f"{what} {device}: the ranks run on {where}; leave {what} out")
    return torch.device(kind)
