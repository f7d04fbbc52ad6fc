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
import torch. Without torch (``pip install radixkv``, no extra) the core works, ``help(radixkv)``
and ``from radixkv import *`` list what is usable, and a torch-layer name raises a
``ModuleNotFoundError`` whose one line names the extra to install (``radixkv[torch]``), as
``radixkv.metrics`` and ``radixkv.events`` name theirs.
"""

from __future__ import annotations

import importlib
from typing import Any

from radixkv import _extras
from radixkv._radixkv import (
    COPY_LOAD,
    COPY_OFFLOAD,
    COPY_PERSIST,
    COPY_SPILL,
    COPY_WINDOW_LOAD,
    COPY_WINDOW_OFFLOAD,
    EVICTION_CLASSES,
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
from radixkv.tenancy import tenant_namespace

__version__ = "0.1.0"

#: Names of the torch layer, and the module each lives in (imported on first use).
_LAZY = {
    "KVCache": "radixkv.kv",
    "Step": "radixkv.kv",
    "Engine": "radixkv.engine",
    "Session": "radixkv.engine",
    "StreamEvent": "radixkv.engine",
    "Grammar": "radixkv.engine",
    "RequestParams": "radixkv.engine",
    "models": "radixkv.models",
    # Modules with optional dependencies: radixkv[metrics], radixkv[events]; doctor needs none.
    "metrics": "radixkv.metrics",
    "events": "radixkv.events",
    "doctor": "radixkv.doctor",
}

#: Names in _LAZY that are modules, not attributes of their module.
_MODULES = {"models", "metrics", "events", "doctor"}

#: What each lazy module needs beyond numpy: (top-level packages, the extra that installs them).
_NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "radixkv.kv": (("torch",), _extras.TORCH_EXTRA),
    "radixkv.engine": (("torch",), _extras.TORCH_EXTRA),
    "radixkv.models": (("torch",), _extras.TORCH_EXTRA),
    "radixkv.metrics": (("prometheus_client",), "metrics"),
    "radixkv.events": (("zmq", "msgspec"), "events"),
    "radixkv.doctor": ((), ""),
}

#: ``from radixkv import *``: the core's names, and the torch layer's where torch is installed
#: (so that ``import *`` and ``help(radixkv)`` work on a torch-free install too).
__all__ = [
    "COPY_LOAD",
    "COPY_OFFLOAD",
    "COPY_PERSIST",
    "COPY_SPILL",
    "COPY_WINDOW_LOAD",
    "COPY_WINDOW_OFFLOAD",
    "EVICTION_CLASSES",
    "BlockCache",
    "Cache",
    "CacheStats",
    "CorruptionError",
    "Error",
    "InvalidRequest",
    "OutOfPages",
    "RadixCache",
    "Request",
    "Scheduler",
    "StaleStepError",
    "StepPlan",
    "block_hashes",
    "plan_step",
    "tenant_namespace",
]
if _extras.available("torch"):
    __all__ += [
        "Engine",
        "Grammar",
        "KVCache",
        "RequestParams",
        "Session",
        "Step",
        "StreamEvent",
        "models",
    ]


def _usable(name: str) -> bool:
    """Whether the lazy ``name`` can be imported here (its optional packages are installed)."""
    packages, _extra = _NEEDS[_LAZY[name]]
    return _extras.available(*packages)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        packages, extra = _NEEDS[module]
        if e.name not in packages:
            raise
        raise _extras.missing(f"radixkv.{name}", e.name, extra) from None
    value = mod if name in _MODULES else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """Every name, less the lazy ones whose optional packages are missing (so that ``help`` and
    ``dir`` work on any install)."""
    return sorted(set(globals()) | {n for n in _LAZY if _usable(n)})
