"""Which attention backends this machine can run, and the one ``"auto"`` picks: the single
place where the choice is made.

``auto`` per device (measured in ``benches/bench_attention.py`` and ``bench_torch.py``; see
``benches/README.md``):

- CUDA: ``triton`` (the pool read in place, no gather, no mask, a fixed grid per batch size);
  where Triton is missing, FlashInfer where installed, then ``varlen`` where torch's
  ``varlen_attn`` takes ``block_table`` (torch >= 2.15), then SDPA with cuDNN excluded.
  :func:`auto_reason` says why Triton was not taken.
- CPU: SDPA (decode over the :class:`~radixkv.kv.backends.mirror.DecodeMirror`'s lanes, else the
  folded gather). One layer's attention alone favours flex on fp32 decode (1.2x against 1.9x of SDPA
  on contiguous KV at head dim 64), but a whole engine step does not (``bench_torch.py`` (d): flex
  0.40-0.48x against SDPA 0.90x of a contiguous-KV loop at 8 requests), because flex rebuilds its
  block mask every step. The Triton interpreter is a test tool, never ``auto``'s choice.
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import torch

#: Every backend name ``KVCache(attention=...)`` knows.
NAMES = ("auto", "sdpa", "triton", "flex", "varlen", "flashinfer")

#: Smallest page (KV block) flex's CUDA decoding kernel takes.
FLEX_CUDA_MIN_PAGE = 16


def _has_flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


def _has_varlen() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "block_table" in inspect.signature(varlen_attn).parameters


def interpreted() -> bool:
    """Whether Triton runs kernels under its interpreter (``TRITON_INTERPRET``, on CPU
    tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` here, or ``None`` when they can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (torch's CUDA builds bring it; pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if interpreted():
            return None
        return (
            "the Triton kernels run on CUDA devices; on the CPU only under Triton's interpreter "
            "(set TRITON_INTERPRET=1 before torch and triton are imported)"
        )
    return f"the Triton kernels run on CUDA devices, got {device.type}"


def available(device: torch.device) -> list[str]:
    """Backend names usable on ``device`` with the installed packages."""
    names = ["auto", "sdpa"]
    if triton_problem(device) is None:
        names.append("triton")
    if _has_flex():
        names.append("flex")
    if device.type == "cuda":
        if _has_varlen():
            names.append("varlen")
        if importlib.util.find_spec("flashinfer") is not None:
            names.append("flashinfer")
    return names


def check_name(name: str, device: torch.device) -> str:
    """``name`` if it is usable on ``device``; ``ValueError`` saying why not (for ``triton``)
    or listing the usable ones."""
    ok = available(device)
    if name not in ok:
        why = triton_problem(device) if name == "triton" else None
        if why is not None:
            raise ValueError(f"attention='triton' cannot run on {device}: {why}")
        raise ValueError(
            f"attention must be one of {', '.join(map(repr, ok))} on {device.type} with the "
            f"installed packages, got {name!r}"
        )
    return name


def check_pool(name: str, device: torch.device, page_size: int) -> None:
    """``ValueError`` for a backend that cannot serve a pool of ``page_size`` on ``device``:
    flex's CUDA decoding kernel takes KV blocks (pages) of at least 16 slots."""
    if name == "flex" and device.type == "cuda" and page_size < FLEX_CUDA_MIN_PAGE:
        raise ValueError(
            f"attention='flex' on CUDA needs pages of at least {FLEX_CUDA_MIN_PAGE} slots (its "
            f"decoding kernel's smallest KV block), the cache has page_size={page_size}: make "
            "the cache with a larger page_size, or use attention='triton' or 'auto'"
        )


def auto_choice(device: torch.device, dtype: torch.dtype, decode: bool) -> str:
    """The backend ``"auto"`` picks for a group on ``device`` (see the module docstring)."""
    if device.type != "cuda":
        return "sdpa"
    names = available(device)
    for name in ("triton", "flashinfer", "varlen"):
        if name in names:
            return name
    return "sdpa"


def auto_reason(device: torch.device) -> str | None:
    """Why ``"auto"`` on ``device`` does not use its first choice, or ``None`` when it does
    (the CPU's first choice is SDPA)."""
    if device.type != "cuda":
        return None
    why = triton_problem(device)
    if why is None:
        return None
    return f"attention='auto' uses {auto_choice(device, torch.float32, True)!r} on {device}: {why}"
