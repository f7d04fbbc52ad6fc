"""radixkv: a prefix cache for LLM key/value tensors that any PyTorch inference loop can drop in.

The index (which pages hold the KV of which prefix, refcounts, LRU eviction) lives in a Rust
core; this package owns the tensors. Two indexes behind one interface:

- :class:`RadixCache`: a radix tree over token ids (token-exact reuse at ``page_size=1``).
- :class:`BlockCache`: chained block hashes over full pages (``page_size=16`` by default).

Both derive from :class:`Cache` (``isinstance(c, radixkv.Cache)`` holds for either).

The package, by layer (each subpackage imports only the ones above it):

- ``radixkv._radixkv``: the Rust core (caches, ``Scheduler``, ``plan_step``), re-exported here.
- :mod:`radixkv.kv`: the torch layer: :class:`KVCache` (paged K/V tensors) and :class:`Step`
  (one forward pass; attention over cached prefixes).
- :mod:`radixkv.models`: a reference Llama/Qwen2 model over the torch layer, and its loader.
- :mod:`radixkv.engine`: continuous batching: :class:`Engine`, :class:`Session`.
- :mod:`radixkv.apps`: applications: the ``radixkv`` command line, the demo, trace replay.

The torch layer and everything on it are imported on first use, so ``import radixkv`` does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixkv._radixkv import (
    COPY_LOAD,
    COPY_OFFLOAD,
    BlockCache,
    Cache,
    CacheStats,
    CorruptionError,
    Error,
    InvalidRequest,
    OutOfPages,
    RadixCache,
    Request,
    Scheduler,
    StaleStepError,
    StepPlan,
    block_hashes,
    plan_step,
)

__version__ = "0.1.0"

#: Names of the torch layer, and the module each lives in (imported on first use).
_LAZY = {
    "KVCache": "radixkv.kv",
    "Step": "radixkv.kv",
    "Engine": "radixkv.engine",
    "Session": "radixkv.engine",
    "StreamEvent": "radixkv.engine",
    "models": "radixkv.models",
    # Modules with optional dependencies: radixkv[metrics], radixkv[events]; doctor needs none.
    "metrics": "radixkv.metrics",
    "events": "radixkv.events",
    "doctor": "radixkv.doctor",
}

#: Names in _LAZY that are modules, not attributes of their module.
_MODULES = {"models", "metrics", "events", "doctor"}

__all__ = [
    "COPY_LOAD",
    "COPY_OFFLOAD",
    "BlockCache",
    "Cache",
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
    "StaleStepError",
    "Step",
    "StepPlan",
    "StreamEvent",
    "block_hashes",
    "models",
    "plan_step",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name in _MODULES else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
