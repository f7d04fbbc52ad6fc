"""The torch layer: paged K/V tensors over a prefix cache, and attention over them.

- :class:`KVCache` (:mod:`radixkv.kv.kv_cache`): the per-layer K/V pools whose slots a
  ``RadixCache``/``BlockCache`` hands out; ``plan`` and ``commit`` one forward pass each.
- :class:`Step` (:mod:`radixkv.kv.step`): one planned forward pass; ``Step.attention`` writes
  the new tokens' K/V and attends over each request's cached prefix.
- :mod:`radixkv.kv.tiers`: the host, disk and shared tiers below the device pools.
- :mod:`radixkv.kv.backends`: the attention backends a step runs through.
"""

from radixkv._extras import require_torch

require_torch("radixkv.kv")

from radixkv.kv.kv_cache import KVCache  # noqa: E402
from radixkv.kv.step import Step, StepLike  # noqa: E402
from radixkv.kv.tiers import (  # noqa: E402
    DiskLockedError,
    DiskMismatchError,
    check_unlocked,
    model_fingerprint,
)

# The disk pool's module under its old name, radixkv.kv.disk, which the docs named.
from radixkv.kv.tiers import disk_pool as disk  # noqa: E402, F401

__all__ = [
    "DiskLockedError",
    "DiskMismatchError",
    "KVCache",
    "Step",
    "StepLike",
    "check_unlocked",
    "model_fingerprint",
]
