"""The lock of a disk tier's directory: one process at a time.

A :class:`~radixkv.kv.tiers.disk_pool.DiskPool` holds an exclusive ``flock`` on the directory's
``lock`` file from open to close (:func:`acquire`) and writes its holder (pid, host, time) into
it; a second opener, in this process or another, is refused (:class:`DiskLockedError` naming
the holder), so two processes never overwrite each other's slots or manifest. The lock ends
with the process, however it ends: a crashed holder leaves nothing to clean up.
:func:`check_unlocked` asks without taking it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import radixkv

#: The lock file's name inside the directory.
LOCK_FILE = "lock"


class DiskLockedError(radixkv.Error):
    """The directory of a :class:`DiskPool` is open in another pool (of this process or
    another): two writers would overwrite each other's slots and manifest. ``holder``: what
    the holder wrote into the lock file (``pid``, ``host``, ``since``), empty if unknown."""

    def __init__(self, message: str, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.holder = holder


def acquire(path: str) -> int:
    """An open descriptor of ``path``'s lock file, holding its exclusive ``flock``, with this
    process named in it; :class:`DiskLockedError` naming the holder when another has it."""
    lock_path = os.path.join(path, LOCK_FILE)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on this platform: unguarded, as before
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        error = _held(path, fd)
        os.close(fd)
        raise error from None
    try:
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError:  # the lock holds even where its note cannot be written
        pass
    return fd


def _held(path: str, fd: int) -> DiskLockedError:
    """The error of ``path``'s lock file (open as ``fd``) held by another: its holder named."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
    except (OSError, ValueError):
        holder = {}
    if not isinstance(holder, dict):
        holder = {}
    who = (
        f"process {holder.get('pid', '?')} on {holder.get('host', '?')}, open since "
        f"{holder.get('since', '?')}"
        if holder
        else "another process"
    )
    return DiskLockedError(
        f"the disk tier at {path!r} is in use by {who}: one directory serves one process "
        "at a time (stop that one, or give this one another directory)",
        holder,
    )


def check_unlocked(path: str) -> None:
    """:class:`DiskLockedError` naming the holder if another pool holds ``path``'s lock now
    (what opening a :class:`DiskPool` there would raise), for a caller that checks before it
    spends time on what the pool needs (a server loading its model); nothing is created or
    written, and the lock is not kept."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY)
    except OSError:  # no lock file (no directory yet): nobody holds it
        return
    try:
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise _held(path, fd) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    except ImportError:  # pragma: no cover - no flock on this platform: unguarded
        pass
    finally:
        os.close(fd)
