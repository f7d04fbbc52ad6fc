"""The torch layer: paged K/V tensors over a prefix cache, and attention over them.

- :class:`KVCache` (:mod:`radixkv.kv.kv_cache`): the per-layer K/V pools whose slots a
  ``RadixCache``/``BlockCache`` hands out; ``plan`` and ``commit`` one forward pass each.
- :class:`Step` (:mod:`radixkv.kv.step`): one planned forward pass; ``Step.attention`` writes
  the new tokens' K/V and attends over each request's cached prefix.
"""

from radixkv.kv.kv_cache import KVCache
from radixkv.kv.step import Step

__all__ = ["KVCache", "Step"]
