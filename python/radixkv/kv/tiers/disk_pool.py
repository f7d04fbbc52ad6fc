"""`DiskPool`: the files of the disk tier, where KV pages evicted from host memory are kept.

The Rust index decides which page goes to which disk *slot*; this class owns the files those slots
index, in one directory:

- ``pages.bin``: the data file, ``num_pages`` slots of ``slot_bytes`` each, preallocated at open
  (extended with ``ftruncate``; a sparse file where the file system allows).
- ``manifest.bin``: the index (which key lives in which slot), written only by
  :meth:`DiskPool.save`, and read at open so that the pages survive a restart.

Slot ``s`` starts at byte ``s * slot_bytes``: a page in the format of :mod:`.page` (a 128-byte
header naming the page's key, a checksum and the pool's setup, then the payload), then zero
padding up to ``slot_bytes`` (:func:`~.page.slot_bytes_for`).

The manifest (all integers little-endian):

```text
  8          magic b"RKVMANI1"
  4          u32: length L of the JSON header
  L          JSON: {"fingerprint": ..., "format": 1, "num_pages": ..., "page_bytes": ...,
                    "slot_bytes": ...}
  8          u64: entry count n
  n * 32     the keys, concatenated
  n * 4      u32: the slot of each key
  32         _page_checksum(b"radixkv.manifest", every byte before it)
```

The ``fingerprint`` (what the KV depends on: model config, weights digest, dtype, page size,
KV layout...) and the layout in the JSON header must equal the pool's at open, or the directory
is refused (:class:`DiskMismatchError`) or reset (``on_mismatch="reset"``).

Crash rules:

- Pages are written in place, by one background thread (:meth:`DiskPool.write`), one ``pwritev``
  of header and payload each; a crash may tear a page, and a slot may be overwritten (reused)
  after the last :meth:`DiskPool.save`.
- The manifest is only replaced atomically (``manifest.bin.tmp.<pid>.<random>``, a name of
  this writer's own, ``fsync``, ``os.replace``, ``fsync`` of the directory), after an ``fsync``
  of the data file: after a crash the directory holds the last saved manifest whole, or none.
  A manifest that is truncated, has a bad magic, fails its checksum, or lists a slot or a key
  twice is treated as missing (a ``RuntimeWarning``; the pool starts empty); leftover
  ``manifest.bin.tmp*`` files are removed at open.
- One process at a time: the pool holds an exclusive lock (``flock``) on the directory's
  ``lock`` file from open to close, and writes its holder (pid, host, time) into it; a second
  opener, in this process or another, is refused (:class:`DiskLockedError` naming the
  holder), so two processes never overwrite each other's slots or manifest. The lock ends with
  the process, however it ends: a crashed holder leaves nothing to clean up (:mod:`.lock`).
- Every page read is checked against the key the caller expects there, against the pool's
  setup (a page another model or layout wrote into this directory is not this pool's, whatever
  its key) and against its checksum (:meth:`DiskPool.read`): a page torn by a crash, overwritten
  after the last save, written for another setup or corrupted on disk is reported bad (``None``)
  and the caller recomputes it; it is never served.
- At open (``recover=True``) every slot's header is read: pages written after the last save
  (its manifest does not list them, or lists another key in their slot) are entries again, after
  the saved ones, so a crash loses no page that reached the disk. Only headers of this setup
  count; each page is still checked when it is read.

This module needs only numpy and the standard library (no torch).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import struct
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import radixkv
from radixkv._radixkv import _page_checksum

# DiskLockedError and check_unlocked: also named here, where they were before the lock had a
# module of its own (radixkv.kv.disk.check_unlocked, in the docs).
from radixkv.kv.tiers.lock import DiskLockedError, acquire, check_unlocked  # noqa: F401
from radixkv.kv.tiers.page import (
    CHECKSUM_BYTES,
    HEADER,
    HEADER_STRUCT,
    KEY_BYTES,
    PAGE_MAGIC,
    check_key,
    pack_header,
    slot_bytes_for,
    unpack_header,
)

#: First bytes of the manifest.
MANIFEST_MAGIC = b"RKVMANI1"
#: Version of the slot and manifest layouts, stored in the manifest.
FORMAT = 1
#: The key ``_page_checksum`` takes for the manifest's own checksum.
MANIFEST_CHECKSUM_KEY = b"radixkv.manifest"
#: File names inside the pool's directory.
DATA_FILE = "pages.bin"
MANIFEST_FILE = "manifest.bin"
MANIFEST_TMP = "manifest.bin.tmp"  # the prefix of each writer's own temporary manifest
#: What ``on_mismatch`` may be.
ON_MISMATCH = ("error", "reset")

#: Fields of the manifest's JSON header that fix the data file's layout.
_LAYOUT_FIELDS = ("format", "num_pages", "page_bytes", "slot_bytes")
_ABSENT = "<absent>"


class DiskMismatchError(radixkv.Error):
    """The directory of a :class:`DiskPool` holds a manifest written for another setup (another
    fingerprint, or another layout: ``num_pages``, ``page_bytes``, ``slot_bytes``, format).

    ``differences`` maps each differing field (``"num_pages"``, ``"fingerprint['dtype']"``...) to
    ``(stored, given)``; the message names every one, with both values, and how to proceed."""

    def __init__(self, message: str, differences: dict[str, tuple[Any, Any]]) -> None:
        super().__init__(message)
        self.differences = differences


def _remove_temporaries(path: str) -> None:
    """Removes the temporary manifests writers left behind (the lock is held: none is live)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name.startswith(MANIFEST_TMP):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(entry.path)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _canonical(value: Any) -> str:
    """``value`` as canonical JSON text (what is compared: ``true`` differs from ``1``)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _normalize_fingerprint(fingerprint: Any) -> dict[str, Any]:
    """``fingerprint`` as it reads back from the manifest's JSON (tuples become lists...)."""
    if not isinstance(fingerprint, Mapping):
        raise TypeError(
            f"fingerprint must be a mapping (e.g. a dict of the model config, dtype, page "
            f"size...), got {type(fingerprint).__name__}"
        )
    try:
        text = _canonical(dict(fingerprint))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"fingerprint must be JSON-serializable (str keys; str, number, bool, None, list "
            f"and dict values; no NaN): {e}; got {fingerprint!r}"
        ) from None
    normalized: dict[str, Any] = json.loads(text)
    return normalized


def _diff_tree(
    where: str, stored: dict[str, Any], given: dict[str, Any], out: dict[str, tuple[Any, Any]]
) -> None:
    """Into ``out``: each leaf of ``stored`` and ``given`` that differs, as
    ``where['key']['inner']...`` -> ``(stored, given)`` in canonical JSON (``"<absent>"`` for
    a key one side lacks). Nested objects are compared key by key, so a model config that
    differs in one field names that field, not two dumps of the whole config."""
    for k in sorted(set(stored) | set(given)):
        s, g = stored.get(k, _ABSENT), given.get(k, _ABSENT)
        path = f"{where}[{k!r}]"
        if isinstance(s, dict) and isinstance(g, dict):
            _diff_tree(path, s, g, out)
            continue
        s_text = _canonical(s) if k in stored else _ABSENT
        g_text = _canonical(g) if k in given else _ABSENT
        if s_text != g_text:
            out[path] = (s_text, g_text)


def _pwrite_all(fd: int, header: bytes, payload: np.ndarray, offset: int) -> int:
    """Writes ``header`` then ``payload`` at ``offset`` of ``fd`` (one ``pwritev``, or one
    ``pwrite`` of their concatenation where ``pwritev`` is missing; continued after a short
    write); returns the bytes written."""
    total = len(header) + payload.nbytes
    if hasattr(os, "pwritev"):
        done = os.pwritev(fd, [header, payload.data], offset)
        if done == total:
            return total
        data = memoryview(header + payload.tobytes())
    else:
        data = memoryview(header + payload.tobytes())
        done = os.pwrite(fd, data, offset)
    while done < total:
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote nothing at offset {offset + done} of the disk tier")
        done += n
    return total


def _pread_into(fd: int, buf: np.ndarray, offset: int) -> int:
    """Reads into ``buf`` (uint8) from ``offset`` of ``fd`` until it is full or the file ends;
    returns the bytes read (fewer than ``buf.nbytes`` past the end of the file)."""
    view = buf.data.cast("B")
    got = 0
    while got < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[got:]], offset + got)
        else:
            data = os.pread(fd, len(view) - got, offset + got)
            n = len(data)
            view[got : got + n] = data
        if n == 0:
            break
        got += n
    return got


#: Bytes of pages queued for the writer at most; a write past it waits for the disk.
MAX_QUEUED_BYTES = 256 * 2**20
#: Bytes one read takes at most (a run of consecutive slots longer than this is split).
MAX_READ_BYTES = 8 * 2**20


class _WriterState:
    """What the caller's thread and the worker share (the worker holds no reference to the
    pool, so that a pool nobody closed can still be collected)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queued = 0
        self.pages_written = 0
        self.bytes_written = 0
        self.error: BaseException | None = None
        self.error_slot = -1


def _writer(
    q: queue.Queue[Any],
    fd: int,
    slot_bytes: int,
    page_bytes: int,
    setup: bytes,
    state: _WriterState,
) -> None:
    """The background writer: performs queued ``(slot, key, payload)`` writes until ``None``.
    After an error it keeps the first one in ``state`` and drops the writes queued after it."""
    while True:
        item = q.get()
        try:
            if item is None:
                return
            slot, key, payload = item
            if state.error is None:
                try:
                    digest = _page_checksum(key + setup, payload)
                    header = pack_header(PAGE_MAGIC, key, digest, page_bytes, setup)
                    n = _pwrite_all(fd, header, payload, slot * slot_bytes)
                except BaseException as e:  # kept, re-raised by the caller
                    with state.lock:
                        state.error = e
                        state.error_slot = slot
                else:
                    with state.lock:
                        state.pages_written += 1
                        state.bytes_written += n
            with state.lock:
                state.queued -= 1
        finally:
            q.task_done()


def _shutdown(
    q: queue.Queue[Any], thread_box: list[threading.Thread | None], fd_box: list[int]
) -> None:
    """Stops the worker (after the writes queued before), closes the data file, then the lock
    file (``fd_box[1]``, when held: closing it ends the lock)."""
    thread = thread_box[0]
    if thread is not None:
        q.put(None)
        thread.join()
        thread_box[0] = None
    for i in range(len(fd_box)):
        if fd_box[i] >= 0:
            fd, fd_box[i] = fd_box[i], -1
            os.close(fd)


class DiskPool:
    """The disk tier's files in directory ``path`` (created if missing, parents too): a data file
    of ``num_pages`` slots holding pages of ``page_bytes``, and a manifest saved by :meth:`save`
    (the layouts and the crash rules: see :mod:`radixkv.kv.tiers.disk_pool`).

    ``fingerprint``: a JSON-serializable mapping of what the KV depends on (model config,
    weights digest, dtype, page size, KV layout...), stored in the manifest. At open a valid
    manifest must hold the same fingerprint (compared as canonical JSON) and the same
    ``num_pages``, ``page_bytes``, ``slot_bytes`` and format; otherwise ``on_mismatch="error"``
    raises :class:`DiskMismatchError` naming every differing field with both values, and
    ``on_mismatch="reset"`` warns (``RuntimeWarning``) and starts empty (the old manifest stays
    until the next :meth:`save`; the data file is reused, emptied first where the layout
    differs). A missing manifest is an empty pool; a damaged one is too, with a
    ``RuntimeWarning``. A data file longer than this layout's that no valid manifest of this
    layout accounts for is refused (``ValueError``) with ``"error"`` and emptied with
    ``"reset"``; a shorter one is extended.

    ``recover`` (default True): read every slot's header at open, so that pages written after
    the last save (and so missing from its manifest) are entries again, after the saved ones
    (:attr:`recovered` counts them); only headers of this pool's setup (fingerprint and layout)
    count. One small read a slot (about a second for a million slots).

    ``ValueError`` naming the argument for a ``num_pages`` or ``page_bytes`` that is not a
    positive int, an ``on_mismatch`` other than ``"error"``/``"reset"``, a ``fingerprint`` that
    is not JSON-serializable, or a ``path`` that is not a directory; ``TypeError`` for a
    ``fingerprint`` that is not a mapping.

    Not thread-safe: one thread calls the methods; the pool's own worker thread performs the
    writes. Attributes: ``path``, ``num_pages``, ``page_bytes``, ``slot_bytes``, ``fingerprint``
    (as it reads back from JSON), and the counters of :meth:`stats`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        num_pages: int,
        page_bytes: int,
        fingerprint: Mapping[str, object],
        on_mismatch: str = "error",
        recover: bool = True,
    ) -> None:
        self._closed = True  # until the data file is open (so __repr__/close work on errors)
        self.num_pages = _positive("num_pages", num_pages)
        self.page_bytes = _positive("page_bytes", page_bytes)
        if not isinstance(on_mismatch, str) or on_mismatch not in ON_MISMATCH:
            raise ValueError(f'on_mismatch must be "error" or "reset", got {on_mismatch!r}')
        self.on_mismatch = on_mismatch
        self.fingerprint = _normalize_fingerprint(fingerprint)
        self.slot_bytes = slot_bytes_for(self.page_bytes)
        #: What every page header of this pool names: its fingerprint and layout, digested.
        self.setup = _page_checksum(
            b"radixkv.disk.setup",
            _canonical(
                {
                    "fingerprint": self.fingerprint,
                    "format": FORMAT,
                    "num_pages": self.num_pages,
                    "page_bytes": self.page_bytes,
                    "slot_bytes": self.slot_bytes,
                }
            ).encode(),
        )
        if self.num_pages > 2**32 - 1:
            raise ValueError(f"num_pages must be below 2**32 (slots are u32), got {num_pages!r}")
        self.path = os.fspath(path)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ValueError(f"path must be a directory, got {self.path!r} (not a directory)")
        os.makedirs(self.path, exist_ok=True)
        self._data_path = os.path.join(self.path, DATA_FILE)
        self._manifest_path = os.path.join(self.path, MANIFEST_FILE)
        lock_fd = acquire(self.path)
        try:
            self._open(lock_fd, recover)
        except BaseException:
            os.close(lock_fd)
            raise

    def _open(self, lock_fd: int, recover: bool) -> None:
        """The rest of ``__init__``, with the directory's lock held (``lock_fd``)."""
        _remove_temporaries(self.path)

        self._keys = b""
        self._slots = np.zeros(0, np.uint32)
        self._recover_on = bool(recover)
        layout_known, layout_differs = self._open_manifest()

        fd = os.open(self._data_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            expected = self.num_pages * self.slot_bytes
            size = os.fstat(fd).st_size
            if size > expected and not layout_known and not layout_differs:
                if self.on_mismatch == "error":
                    raise ValueError(
                        f"the data file {self._data_path!r} is {size} bytes, longer than "
                        f"num_pages={self.num_pages} slots of {self.slot_bytes} bytes "
                        f"({expected}), and no manifest of this layout accounts for it: it "
                        "was written for another setup. Use another directory, or pass "
                        'on_mismatch="reset" to discard its pages'
                    )
                warnings.warn(
                    f"DiskPool at {self.path!r}: the data file is {size} bytes, longer than "
                    f"this layout's {expected}; discarding its pages (on_mismatch='reset')",
                    RuntimeWarning,
                    stacklevel=3,
                )
                layout_differs = True
            if layout_differs:
                os.ftruncate(fd, 0)
                size = 0
            if size < expected:
                os.ftruncate(fd, expected)
        except BaseException:
            os.close(fd)
            raise

        #: Entries the header scan found that the manifest did not list (see ``recover``).
        self.recovered = 0
        if recover and size > 0:
            try:
                self._recover(fd)
            except BaseException:
                os.close(fd)
                raise
        # Bounded: when the disk is slower than the pages coming down, a write waits for room
        # (at most MAX_QUEUED_BYTES of pages wait in memory) instead of memory growing.
        self._queue: queue.Queue[Any] = queue.Queue(
            maxsize=max(4, MAX_QUEUED_BYTES // self.page_bytes)
        )
        self._state = _WriterState()
        self._thread_box: list[threading.Thread | None] = [None]
        self._fd_box = [fd, lock_fd]
        self._finalizer = weakref.finalize(
            self, _shutdown, self._queue, self._thread_box, self._fd_box
        )
        self._closed = False
        self._error_reported = False
        self.pages_read = 0
        self.bytes_read = 0
        self.bad_pages = 0

    # ----------------------------------------------------------------------------- manifest

    def _recover(self, fd: int) -> None:
        """Reads every slot's header: the manifest's entries whose slot still names their key
        stay (in their order), then the slots of this setup it does not list, in slot order
        (a key held by two slots keeps the first)."""
        n, sb = self.num_pages, self.slot_bytes
        found: dict[int, bytes] = {}
        size = HEADER_STRUCT.size
        for slot in range(n):
            head = os.pread(fd, size, slot * sb)
            if len(head) < size:
                break
            magic, key, _, length, setup = unpack_header(head)
            if magic == PAGE_MAGIC and setup == self.setup and length == self.page_bytes:
                found[slot] = key
        keys: list[bytes] = []
        slots: list[int] = []
        seen: set[bytes] = set()
        saved = self._keys
        for i, slot in enumerate(self._slots.tolist()):
            key = saved[i * KEY_BYTES : (i + 1) * KEY_BYTES]
            if found.get(slot) == key and key not in seen:
                keys.append(key)
                slots.append(slot)
                seen.add(key)
        listed = set(slots)
        for slot, key in found.items():
            if slot not in listed and key not in seen:
                keys.append(key)
                slots.append(slot)
                seen.add(key)
                self.recovered += 1
        self._keys = b"".join(keys)
        self._slots = np.asarray(slots, dtype=np.uint32)
        self._slots.flags.writeable = False

    def _damaged(self, why: str) -> None:
        then = (
            "the pool starts from what the page headers name"
            if self._recover_on
            else "the pool starts empty (its pages will be recomputed)"
        )
        warnings.warn(
            f"DiskPool at {self.path!r}: the directory's index ({MANIFEST_FILE}) was damaged "
            f"({why}); {then}",
            RuntimeWarning,
            stacklevel=5,
        )

    def _open_manifest(self) -> tuple[bool, bool]:
        """Reads the manifest into ``_keys``/``_slots``; returns ``(layout_known,
        layout_differs)``: whether a valid manifest of this layout was found, and whether a
        valid one of another layout was found (and reset)."""
        try:
            with open(self._manifest_path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return False, False
        parsed = self._parse_manifest(data)
        if isinstance(parsed, str):
            self._damaged(parsed)
            return False, False
        header, keys, slots = parsed
        diffs = self._differences(header)
        if diffs:
            fields = "; ".join(f"{k}: stored {s}, given {g}" for k, (s, g) in diffs.items())
            if self.on_mismatch == "error":
                raise DiskMismatchError(
                    f"the disk tier at {self.path!r} was saved for another setup ({fields}). "
                    'Use another directory for this setup, or pass on_mismatch="reset" to '
                    "discard the saved pages and start empty",
                    diffs,
                )
            warnings.warn(
                f"DiskPool at {self.path!r} was saved for another setup ({fields}); "
                "on_mismatch='reset': the pool starts empty",
                RuntimeWarning,
                stacklevel=4,
            )
            return False, any(k in _LAYOUT_FIELDS for k in diffs)
        n = len(slots)
        if n and int(slots.max()) >= self.num_pages:
            bad = int(slots[slots >= self.num_pages][0])
            self._damaged(f"slot {bad} is not below num_pages={self.num_pages}")
            return False, False
        if len(np.unique(slots)) != n:
            self._damaged("a slot is listed twice")
            return False, False
        if len({keys[i : i + KEY_BYTES] for i in range(0, len(keys), KEY_BYTES)}) != n:
            self._damaged("a key is listed twice")
            return False, False
        self._keys = keys
        self._slots = slots
        self._slots.flags.writeable = False
        return True, False

    @staticmethod
    def _parse_manifest(data: bytes) -> str | tuple[dict[str, Any], bytes, np.ndarray]:
        """``(json header, keys, slots)`` of a manifest, or why it is damaged."""
        if len(data) < len(MANIFEST_MAGIC) + 4 + 8 + CHECKSUM_BYTES:
            return f"{len(data)} bytes, too short"
        if data[: len(MANIFEST_MAGIC)] != MANIFEST_MAGIC:
            return "bad magic"
        body, digest = data[:-CHECKSUM_BYTES], data[-CHECKSUM_BYTES:]
        if _page_checksum(MANIFEST_CHECKSUM_KEY, body) != digest:
            return "checksum mismatch"
        pos = len(MANIFEST_MAGIC)
        (hlen,) = struct.unpack_from("<I", body, pos)
        pos += 4
        if pos + hlen + 8 > len(body):
            return "header length past the end"
        try:
            header = json.loads(body[pos : pos + hlen].decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return "header is not JSON"
        if not isinstance(header, dict) or not isinstance(header.get("fingerprint"), dict):
            return "header is not an object with a fingerprint"
        for field in _LAYOUT_FIELDS:
            value = header.get(field)
            if isinstance(value, bool) or not isinstance(value, int):
                return f"header field {field} is not an int"
        pos += hlen
        if header["format"] != FORMAT:  # another format: the rest may be laid out otherwise
            return header, b"", np.zeros(0, np.uint32)
        (n,) = struct.unpack_from("<Q", body, pos)
        pos += 8
        if len(body) - pos != n * (KEY_BYTES + 4):
            return f"{n} entries do not fit the {len(body) - pos} bytes left"
        keys = bytes(body[pos : pos + n * KEY_BYTES])
        pos += n * KEY_BYTES
        slots = np.frombuffer(body, dtype="<u4", count=n, offset=pos).astype(np.uint32)
        return header, keys, slots

    def _differences(self, header: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Each field of the stored ``header`` that differs from this pool's: ``(stored,
        given)`` (fingerprint fields as JSON text)."""
        diffs: dict[str, tuple[Any, Any]] = {}
        given = {
            "format": FORMAT,
            "num_pages": self.num_pages,
            "page_bytes": self.page_bytes,
            "slot_bytes": self.slot_bytes,
        }
        for field, value in given.items():
            if header[field] != value:
                diffs[field] = (header[field], value)
        _diff_tree("fingerprint", header["fingerprint"], self.fingerprint, diffs)
        return diffs

    def _manifest_bytes(self, keys: bytes, slots: np.ndarray) -> bytes:
        header = _canonical(
            {
                "format": FORMAT,
                "fingerprint": self.fingerprint,
                "num_pages": self.num_pages,
                "page_bytes": self.page_bytes,
                "slot_bytes": self.slot_bytes,
            }
        ).encode("utf-8")
        body = b"".join(
            [
                MANIFEST_MAGIC,
                struct.pack("<I", len(header)),
                header,
                struct.pack("<Q", len(slots)),
                keys,
                slots.astype("<u4").tobytes(),
            ]
        )
        return body + _page_checksum(MANIFEST_CHECKSUM_KEY, body)

    # ----------------------------------------------------------------------------- state

    def _check_usable(self) -> None:
        """``ValueError`` once closed; ``RuntimeError`` (from the worker's error) once failed."""
        if self._closed:
            raise ValueError("the DiskPool is closed")
        if self._state.error is not None:
            raise self._failure() from self._state.error

    def _failure(self) -> RuntimeError:
        """The error that reports the failure kept in ``_state`` (marked reported)."""
        self._error_reported = True
        slot = self._state.error_slot
        where = f"writing slot {slot}" if slot >= 0 else "syncing the data file"
        return RuntimeError(
            f"the DiskPool at {self.path!r} failed {where}: {self._state.error!r}; it refuses "
            "further use: close it and open it again (pages written since the last save are "
            "lost and will read as bad)"
        )

    def _fail(self, error: BaseException) -> None:
        """Marks the pool failed in the caller's thread (an ``fsync`` error: what reached the
        disk is unknown)."""
        with self._state.lock:
            if self._state.error is None:
                self._state.error = error
                self._state.error_slot = -1

    def _wait(self) -> None:
        """Waits until every queued write has been performed (or dropped after an error)."""
        if self._thread_box[0] is not None:
            self._queue.join()

    def _check_slots(self, slots: Any, name: str = "slots") -> np.ndarray:
        """``slots`` as a checked int64 array (ints in ``[0, num_pages)``)."""
        arr = np.asarray(slots)
        if arr.ndim != 1:
            raise ValueError(f"{name} must be a 1-D sequence of slot ids, got {slots!r}")
        if arr.size == 0:
            return np.zeros(0, np.int64)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"{name} must be ints, got {slots!r} (dtype {arr.dtype})")
        wide = arr.astype(np.int64)
        if arr.dtype == np.uint64:
            wide[arr > np.iinfo(np.int64).max] = -1
        bad = (wide < 0) | (wide >= self.num_pages)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"{name}[{i}] = {arr[i].item()!r} is not a slot of this pool (0 <= slot < "
                f"num_pages={self.num_pages})"
            )
        return wide

    def _check_keys(self, keys: Any, n: int) -> bytes:
        if not isinstance(keys, (bytes, bytearray, memoryview)):
            raise ValueError(f"keys must be bytes ({KEY_BYTES} per slot), got {keys!r}")
        keys = bytes(keys)
        if len(keys) != KEY_BYTES * n:
            raise ValueError(
                f"keys must be {KEY_BYTES} bytes per slot ({KEY_BYTES} * {n} = "
                f"{KEY_BYTES * n}), got {len(keys)} bytes"
            )
        return keys

    # ----------------------------------------------------------------------------- API

    @property
    def entries(self) -> tuple[bytes, np.ndarray]:
        """``(keys, slots)`` of the manifest: the keys concatenated (``32 * n`` bytes) and their
        slots (a read-only uint32 array of ``n``), in the order saved; empty when the pool
        started empty. Read at open, replaced by each :meth:`save`."""
        return self._keys, self._slots

    @property
    def queued(self) -> int:
        """Writes queued and not yet performed."""
        return self._state.queued

    @property
    def pages_written(self) -> int:
        """Pages the worker has written."""
        return self._state.pages_written

    @property
    def bytes_written(self) -> int:
        """Bytes the worker has written (header and payload of each page)."""
        return self._state.bytes_written

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def stats(self) -> dict[str, int]:
        """The counters: ``pages_written``, ``bytes_written`` (headers included), ``pages_read``
        (every slot read, bad ones included), ``bytes_read`` (bytes read from the file),
        ``bad_pages`` (reads that returned ``None``) and ``queued`` (writes not yet
        performed). Works after :meth:`close` too."""
        with self._state.lock:
            written, nbytes, queued = (
                self._state.pages_written,
                self._state.bytes_written,
                self._state.queued,
            )
        return {
            "pages_written": written,
            "bytes_written": nbytes,
            "pages_read": self.pages_read,
            "bytes_read": self.bytes_read,
            "bad_pages": self.bad_pages,
            "queued": queued,
        }

    def write(self, slot: int, key: bytes, payload: np.ndarray) -> None:
        """Queues the write of one page (``key``, 32 bytes; ``payload``, a C-contiguous uint8
        array of ``page_bytes``) to ``slot``, performed by the pool's worker thread (started on
        the first write): checksum, then one write of header and payload at the slot's offset.

        The pool keeps a reference to ``payload``: the caller must not change it afterwards
        (pass a fresh copy). ``ValueError`` naming the value for a bad ``slot``, ``key`` or
        ``payload`` (checked here, before anything is queued); ``RuntimeError`` after the worker
        failed (chained from its error); ``ValueError`` after :meth:`close`."""
        self._check_usable()
        if (
            isinstance(slot, bool)
            or not isinstance(slot, (int, np.integer))
            or not 0 <= slot < self.num_pages
        ):
            raise ValueError(
                f"slot must be an int in [0, num_pages={self.num_pages}), got {slot!r}"
            )
        key = check_key(key)
        if not isinstance(payload, np.ndarray):
            raise ValueError(
                f"payload must be a numpy uint8 array of page_bytes={self.page_bytes}, got "
                f"{type(payload).__name__}"
            )
        if payload.dtype != np.uint8:
            raise ValueError(f"payload must be a uint8 array, got dtype {payload.dtype}")
        if payload.nbytes != self.page_bytes:
            raise ValueError(
                f"payload must be page_bytes={self.page_bytes} bytes, got {payload.nbytes} "
                f"(shape {payload.shape})"
            )
        if not payload.flags.c_contiguous:
            raise ValueError("payload must be C-contiguous, got a strided array")
        if self._thread_box[0] is None:
            thread = threading.Thread(
                target=_writer,
                args=(
                    self._queue,
                    self._fd_box[0],
                    self.slot_bytes,
                    self.page_bytes,
                    self.setup,
                    self._state,
                ),
                name=f"radixkv-disk-writer({self.path})",
                daemon=True,
            )
            thread.start()
            self._thread_box[0] = thread
        with self._state.lock:
            self._state.queued += 1
        self._queue.put((int(slot), key, payload.reshape(-1)))

    def read(self, slots: Sequence[int] | np.ndarray, keys: bytes) -> list[np.ndarray | None]:
        """The payload in each of ``slots``, checked against the key expected there (``keys``:
        ``32 * len(slots)`` bytes): a uint8 array of ``page_bytes`` (a view into a buffer of its
        run of slots), or ``None`` for a slot that is torn or holds another page (past the end
        of the file, bad magic, another key, another payload length, or a checksum mismatch).

        Waits first for every queued write, so a read sees the writes queued before it. Runs of
        consecutive slot ids (in the order given) are read with one ``pread`` each, up to
        ``MAX_READ_BYTES`` a read. Counts
        ``pages_read``, ``bytes_read`` and ``bad_pages``. ``ValueError`` naming the value for a
        slot out of range or ``keys`` of the wrong length."""
        self._check_usable()
        ids = self._check_slots(slots)
        keys = self._check_keys(keys, len(ids))
        self._wait()
        self._check_usable()
        out: list[np.ndarray | None] = []
        n = len(ids)
        fd = self._fd_box[0]
        sb, pb = self.slot_bytes, self.page_bytes
        order = ids.tolist()
        i = 0
        # A run is cut at MAX_READ_BYTES: one huge read into a fresh buffer spends longer
        # faulting the buffer's memory in than the reads of its pieces take.
        per_read = max(1, MAX_READ_BYTES // sb)
        while i < n:
            j = i + 1
            while j < n and order[j] == order[j - 1] + 1 and j - i < per_read:
                j += 1
            first = order[i]
            size = (j - i - 1) * sb + HEADER + pb
            buf = np.empty(size, np.uint8)
            got = _pread_into(fd, buf, first * sb)
            self.bytes_read += got
            for r in range(j - i):
                out.append(self._check_page(buf, r * sb, got, keys, i + r))
            i = j
        self.pages_read += n
        self.bad_pages += sum(p is None for p in out)
        return out

    def _check_page(
        self, buf: np.ndarray, off: int, got: int, keys: bytes, index: int
    ) -> np.ndarray | None:
        """The payload of the slot at ``off`` of ``buf`` if it is whole and holds the key expected
        at ``index`` of ``keys``; else ``None``."""
        end = off + HEADER + self.page_bytes
        if got < end:
            return None
        magic, key, digest, length, setup = unpack_header(buf.data, off)
        expected = keys[index * KEY_BYTES : (index + 1) * KEY_BYTES]
        if magic != PAGE_MAGIC or key != expected or length != self.page_bytes:
            return None
        if setup != self.setup:  # written by another model or layout into this directory
            return None
        payload = buf[off + HEADER : end]
        if _page_checksum(expected + setup, payload) != digest:
            return None
        return payload

    def flush(self) -> None:
        """Waits for every queued write, then ``fsync``s the data file. An ``fsync`` error
        leaves the pool failed (what reached the disk is unknown)."""
        self._check_usable()
        self._wait()
        self._check_usable()
        try:
            os.fsync(self._fd_box[0])
        except OSError as e:
            self._fail(e)
            raise

    def save(self, keys: bytes, slots: np.ndarray | Sequence[int]) -> None:
        """Makes ``keys`` (``32 * n`` bytes) in ``slots`` (``n`` distinct slot ids) the saved index:
        :meth:`flush`, then the manifest is written to ``manifest.bin.tmp``, ``fsync``ed,
        renamed over ``manifest.bin`` (``os.replace``) and the directory ``fsync``ed. After it,
        :attr:`entries` returns them. ``ValueError`` (before anything is written) for lengths
        that disagree, a slot out of range, or a slot or a key listed twice."""
        self._check_usable()
        ids = self._check_slots(slots)
        keys = self._check_keys(keys, len(ids))
        if len(np.unique(ids)) != len(ids):
            uniq, counts = np.unique(ids, return_counts=True)
            raise ValueError(f"slots must be distinct, got slot {int(uniq[counts > 1][0])} twice")
        seen: set[bytes] = set()
        for i in range(len(ids)):
            k = keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
            if k in seen:
                raise ValueError(f"keys must be distinct, got key {k.hex()} twice (index {i})")
            seen.add(k)
        slots32 = ids.astype(np.uint32)
        data = self._manifest_bytes(keys, slots32)
        self.flush()
        # A name of this writer's own: no other writer can remove or replace it under this one.
        tmp = os.path.join(self.path, f"{MANIFEST_TMP}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        os.close(fd)
        os.replace(tmp, self._manifest_path)
        self._keys = keys
        slots32.flags.writeable = False
        self._slots = slots32
        dfd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def close(self) -> None:
        """Flushes (waits for the queued writes, ``fsync``s), stops the worker and closes the
        data file. Idempotent; every later :meth:`write`/:meth:`read`/:meth:`flush`/:meth:`save`
        raises ``ValueError``. The files are closed whatever happens; a worker error no call
        has reported yet is raised (``RuntimeError``) after that."""
        self._close(raise_errors=True)

    def _close(self, raise_errors: bool) -> None:
        if self._closed:
            return
        try:
            self._wait()
            if self._state.error is None:
                os.fsync(self._fd_box[0])
        except OSError:
            if raise_errors:
                raise
        finally:
            self._closed = True
            self._finalizer()
        if raise_errors and self._state.error is not None and not self._error_reported:
            raise self._failure() from self._state.error

    def __enter__(self) -> DiskPool:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Closing while an exception propagates must not hide it behind a second one.
        self._close(raise_errors=exc_type is None)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"queued={self.queued}"
        entries = len(getattr(self, "_slots", ()))
        return (
            f"DiskPool(path={getattr(self, 'path', '?')!r}, "
            f"num_pages={getattr(self, 'num_pages', '?')}, "
            f"page_bytes={getattr(self, 'page_bytes', '?')}, "
            f"slot_bytes={getattr(self, 'slot_bytes', '?')}, entries={entries}, {state})"
        )
