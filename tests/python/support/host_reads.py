"""Counting the host's reads of tensor values: each a wait for the device on a GPU, so the CPU
tests of the GPU paths count them."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

#: The tensor methods that hand a value to Python (or copy a tensor to the host).
READS = frozenset(
    {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu"}
)


class HostReads(TorchFunctionMode):
    """Counts the reads of tensor values by the host (each one a wait for a GPU), except reads
    of tensors that ``.cpu()`` returned (the copy itself is the read counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._copies: list = []  # kept alive, so no other tensor takes their id

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in READS and not (args and any(args[0] is c for c in self._copies)):
            self.reads.append(name)
        if name == "cpu":
            self._copies.append(out)
        return out
