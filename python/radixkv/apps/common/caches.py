"""A cache chosen by name, as the command line's ``--cache radix|block`` does."""

from __future__ import annotations

import radixkv

KINDS = ("radix", "block")


def make_cache(
    kind: str,
    num_pages: int,
    page_size: int,
    host_pages: int = 0,
    disk_pages: int = 0,
    window: int = 0,
    window_pages: int = 0,
    window_host_pages: int | None = None,
) -> radixkv.Cache:
    """A ``RadixCache`` (``kind="radix"``) or ``BlockCache`` (``kind="block"``), with a host
    tier of ``host_pages`` pages, a disk tier of ``disk_pages`` pages and a window group of
    ``window_pages`` pages for a sliding window of ``window`` tokens when those are > 0 (its
    host tier ``window_host_pages``, None: ``host_pages``)."""
    win: dict = {"window": window, "window_pages": window_pages} if window or window_pages else {}
    if window_host_pages is not None:
        win["window_host_pages"] = window_host_pages
    if kind == "radix":
        return radixkv.RadixCache(num_pages, page_size, host_pages, disk_pages, **win)
    if kind == "block":
        return radixkv.BlockCache(num_pages, page_size, host_pages, disk_pages, **win)
    raise ValueError(f"cache must be 'radix' or 'block', got {kind!r}")
