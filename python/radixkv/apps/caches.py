"""A cache chosen by name, as the command line's ``--cache radix|block`` does."""

from __future__ import annotations

import radixkv

KINDS = ("radix", "block")


def make_cache(
    kind: str, num_pages: int, page_size: int
) -> radixkv.RadixCache | radixkv.BlockCache:
    """A ``RadixCache`` (``kind="radix"``) or ``BlockCache`` (``kind="block"``)."""
    if kind == "radix":
        return radixkv.RadixCache(num_pages, page_size)
    if kind == "block":
        return radixkv.BlockCache(num_pages, page_size)
    raise ValueError(f"cache must be 'radix' or 'block', got {kind!r}")
