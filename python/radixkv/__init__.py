"""radixkv: a prefix cache for LLM key/value tensors that any PyTorch inference loop can drop in.

The index (which pages hold the KV of which prefix, refcounts, LRU eviction) lives in a Rust
core; this package owns the tensors. Two indexes behind one interface:

- :class:`RadixCache`: a radix tree over token ids (token-exact reuse at ``page_size=1``).
- :class:`BlockCache`: chained block hashes over full pages (``page_size=16`` by default).

The torch layer (:class:`KVCache`, :class:`Step`, :class:`Engine`, :mod:`radixkv.models`) is
imported on first use, so ``import radixkv`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixkv._radixkv import (
    BlockCache,
    CacheStats,
    CorruptionError,
    Error,
    InvalidRequest,
    OutOfPages,
    RadixCache,
    Request,
    Scheduler,
    block_hashes,
    plan_step,
)

__version__ = "0.1.0"

#: Names of the torch layer, and the module each lives in (imported on first use).
_LAZY = {
    "KVCache": "radixkv.kv",
    "Step": "radixkv.step",
    "Engine": "radixkv.engine",
    "Session": "radixkv.session",
    "models": "radixkv.models",
}

__all__ = [
    "BlockCache",
    "CacheStats",
    "CorruptionError",
    "Engine",
    "Error",
    "InvalidRequest",
    "KVCache",
    "OutOfPages",
    "RadixCache",
    "Request",
    "Scheduler",
    "Session",
    "Step",
    "block_hashes",
    "models",
    "plan_step",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name == "models" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
