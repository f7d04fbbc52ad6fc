"""A cache chosen by name, as the command line's ``--cache radix|block`` does."""

from __future__ import annotations

import radixkv

KINDS = ("radix", "block")


def make_cache(
    kind: str, num_pages: int, page_size: int, host_pages: int = 0, disk_pages: int = 0
) -> radixkv.Cache:
    """A ``RadixCache`` (``kind="radix"``) or ``BlockCache`` (``kind="block"``), with a host
    tier of ``host_pages`` pages and a disk tier of ``disk_pages`` pages when those are > 0."""
    if kind == "radix":
        return radixkv.RadixCache(num_pages, page_size, host_pages, disk_pages)
    if kind == "block":
        return radixkv.BlockCache(num_pages, page_size, host_pages, disk_pages)
    raise ValueError(f"cache must be 'radix' or 'block', got {kind!r}")
