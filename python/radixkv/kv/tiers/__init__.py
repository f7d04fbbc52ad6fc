"""The tiers below a ``KVCache``'s device pools: where its pages go when the device is full, and
where they come back from. The index (``RadixCache``/``BlockCache``) decides which page moves
where and logs the copies; each tier here performs its own.

- :mod:`.host`: :class:`HostTier`, the host pools and the copies between them and the device's.
- :mod:`.disk`: :class:`DiskTier`, the ``KVCache``'s side of the disk tier, over
  :mod:`.disk_pool` (:class:`DiskPool`: the data file and the manifest) and :mod:`.lock` (one
  process a directory).
- :mod:`.shared`: :class:`SharedTier`, pages shared by every replica on one store
  (:mod:`.store`: the stores; :mod:`.breaker`: the circuit breaker in front of one).
- :mod:`.page`: the page format (header and slot), :mod:`.payload`: a page's K/V as bytes, both
  shared by the disk and shared tiers; :mod:`.fingerprint`: what a page's KV depends on
  (:func:`model_fingerprint`).

Importing this package loads none of them (and not torch): each name is imported on first use,
so the disk pool's files and the stores can be used without the torch layer.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public names and the module of this package each lives in (imported on first use).
_LAZY = {
    "DiskTier": "disk",
    "HostTier": "host",
    "DiskPool": "disk_pool",
    "DiskLockedError": "lock",
    "DiskMismatchError": "disk_pool",
    "check_unlocked": "lock",
    "SharedTier": "shared",
    "SharedStore": "store",
    "SharedStoreError": "store",
    "open_store": "store",
    "Breaker": "breaker",
    "model_fingerprint": "fingerprint",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
