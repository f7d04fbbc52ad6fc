"""The torch layer: paged K/V tensors over a prefix cache, and attention over them.

- :class:`KVCache` (:mod:`radixkv.kv.kv_cache`): the per-layer K/V pools whose slots a
  ``RadixCache``/``BlockCache`` hands out; ``plan`` and ``commit`` one forward pass each.
- :class:`Step` (:mod:`radixkv.kv.step`): one planned forward pass; ``Step.attention`` writes
  the new tokens' K/V and attends over each request's cached prefix.
"""

from radixkv._extras import require_torch

require_torch("radixkv.kv")

from radixkv.kv.kv_cache import KVCache  # noqa: E402
from radixkv.kv.step import Step  # noqa: E402

__all__ = ["KVCache", "Step"]
