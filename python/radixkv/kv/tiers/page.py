"""The page format: how one KV page is laid out as bytes, in a disk slot and in a shared store.

A page is a 128-byte header, then its payload (every layer's K and V: :mod:`.payload`). On disk,
slot ``s`` starts at byte ``s * slot_bytes`` (:func:`slot_bytes_for`: ``HEADER + page_bytes``
rounded up to ``ALIGN``), zero-padded after the payload; a shared store's value is the header
and the payload, unpadded:

```text
  offset  size         field
  0       8            magic: PAGE_MAGIC b"RKVPAGE1" on disk (the shared tier has its own)
  8       32           the page's key
  40      32           checksum of the key, the setup and the payload (blake3, or an HMAC)
  72      8            payload length, u64 little-endian (= page_bytes)
  80      32           setup: a digest of the pool's fingerprint and layout
  112     16           zeros
  128     page_bytes   payload
```

Every page read back is checked against the key it is read for, the setup and the checksum
before its payload is used (the tiers do that; this module only packs and unpacks).

This module needs only the standard library (no torch, no numpy).
"""

from __future__ import annotations

import numbers
import struct
from typing import Any

#: Bytes of a page's header (magic, key, checksum, payload length, setup, zero padding).
HEADER = 128
#: Disk slots are whole multiples of this many bytes (so that a slot starts on a page boundary).
ALIGN = 4096
#: Bytes of a page key.
KEY_BYTES = 32
#: Bytes of a page's checksum (and of the manifest's).
CHECKSUM_BYTES = 32
#: First bytes of every page written to disk.
PAGE_MAGIC = b"RKVPAGE1"
#: The header's fields before its zero padding: magic, key, checksum, length, setup.
HEADER_STRUCT = struct.Struct("<8s32s32sQ32s")


def slot_bytes_for(page_bytes: int) -> int:
    """Bytes of one disk slot for pages of ``page_bytes``: ``HEADER + page_bytes`` rounded up to
    a multiple of ``ALIGN`` (4096). ``ValueError`` for anything but a positive int."""
    if isinstance(page_bytes, bool) or not isinstance(page_bytes, numbers.Integral):
        raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
    if page_bytes < 1:
        raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
    return -(-(HEADER + int(page_bytes)) // ALIGN) * ALIGN


def check_key(key: Any, name: str = "key") -> bytes:
    """``key`` as ``bytes`` if it is ``KEY_BYTES`` bytes long; ``ValueError`` naming it
    otherwise."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ValueError(f"{name} must be {KEY_BYTES} bytes, got {key!r}")
    key = bytes(key)
    if len(key) != KEY_BYTES:
        raise ValueError(f"{name} must be {KEY_BYTES} bytes, got {len(key)} bytes: {key!r}")
    return key


def pack_header(magic: bytes, key: bytes, checksum: bytes, length: int, setup: bytes) -> bytes:
    """The ``HEADER`` bytes of a page: its fields, then zeros."""
    head = HEADER_STRUCT.pack(magic, key, checksum, length, setup)
    return head + bytes(HEADER - len(head))


def unpack_header(buf: Any, offset: int = 0) -> tuple[bytes, bytes, bytes, int, bytes]:
    """``(magic, key, checksum, length, setup)`` of the header at ``offset`` of ``buf``."""
    magic, key, checksum, length, setup = HEADER_STRUCT.unpack_from(buf, offset)
    return magic, key, checksum, length, setup
