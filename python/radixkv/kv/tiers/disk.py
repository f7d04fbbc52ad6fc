"""`DiskTier`: a ``KVCache``'s side of the cache's disk tier (``disk_pages > 0``).

The index (``RadixCache``/``BlockCache`` with ``disk_pages``) decides which page goes to which
disk slot and logs the copies; this object performs them between the ``KVCache``'s pools and a
:class:`radixkv.kv.tiers.disk_pool.DiskPool` (one preallocated file under ``disk_dir``), reads
pages back for a prompt before it is admitted (:meth:`DiskTier.prefetch`), and saves the tier's
index so that the next process finds the pages again (:meth:`DiskTier.save`, reopened by the next
``KVCache(..., disk_dir=...)``).

A page on disk is a slot's header (:mod:`.page`) and every layer's K and V of its ``page_size``
tokens (:mod:`.payload`).

Copies, as the index logs them (``cache.drain_copies(keys=True)``; see SEMANTICS.md, "Disk
tier")::

    spill(h, s):    disk slot s <- host page h      (the host tier dropped h; written in the
    persist(d, s):  disk slot s <- device page d     background, after a synchronous copy out)
    prefetch:       host page h <- disk slot s      (checked against the page's key and
                                                     checksum first: a bad page is recomputed)

Nothing read from disk is served unless it names the page it is asked for and its checksum
holds: a page torn by a crash, overwritten since the last save or damaged on disk is dropped
from the tier (``disk_bad_pages``) and its tokens are computed again.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import radixkv
from radixkv.kv.tiers.disk_pool import DiskPool
from radixkv.kv.tiers.fingerprint import layout_fingerprint
from radixkv.kv.tiers.payload import page_payload, scatter_payload


class DiskTier:
    """The disk pool of a ``KVCache`` and the copies between it and the pools.

    ``fingerprint``: what the KV depends on besides the pool's layout (the model's config, a
    digest of its weights; :func:`radixkv.kv.tiers.fingerprint.model_fingerprint` computes one for a
    torch model). It is stored with the directory together with the layout (page size, layers,
    heads, head dim, dtype, format version); a directory written under another fingerprint is
    refused (``on_mismatch="error"``, :class:`radixkv.kv.tiers.DiskMismatchError` naming what
    differs) or started empty (``"reset"``).
    """

    def __init__(
        self,
        kv: Any,  # the KVCache (not imported: kv_cache imports this module)
        path: str | os.PathLike[str],
        fingerprint: Mapping[str, object] | None = None,
        on_mismatch: str = "error",
    ) -> None:
        if fingerprint is not None and not isinstance(fingerprint, Mapping):
            raise TypeError(
                f"fingerprint must be a mapping (e.g. model_fingerprint(model)), got "
                f"{type(fingerprint).__name__}"
            )
        self.kv = kv
        self.page_bytes = type(kv).bytes_per_page(
            kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.page_size
        )
        full = layout_fingerprint(kv, fingerprint)
        self.pool = DiskPool(path, kv.cache.disk_pages, self.page_bytes, full, on_mismatch)
        keys, slots = self.pool.entries
        if len(slots):
            try:
                kv.cache.disk_restore(keys, slots)
            except ValueError as e:
                self.pool.close()
                raise ValueError(
                    f"the cache's disk tier cannot take the {len(slots)} pages saved in "
                    f"{os.fspath(path)!r}: {e} (give KVCache a new cache)"
                ) from None
        #: Pages this process restored from the directory at open.
        self.restored_pages = len(slots)
        #: The error that stopped writes to the disk (None while it works).
        self.failed: BaseException | None = None

    # ---- pages <-> bytes ------------------------------------------------------------------

    def _page_bytes(self, k: list[torch.Tensor], v: list[torch.Tensor], page: int) -> np.ndarray:
        """Every layer's K and V of ``page`` of the pools ``k``/``v``, as one fresh uint8 array."""
        return page_payload(self.kv, k, v, page)

    def _scatter(self, payload: np.ndarray, host_page: int) -> None:
        """Writes ``payload`` (as :meth:`_page_bytes` made it) into host page ``host_page``."""
        scatter_payload(self.kv, payload, self.kv.host_k, self.kv.host_v, host_page)

    # ---- the index's copies ------------------------------------------------------------

    def write(self, rows: np.ndarray, keys: bytes) -> None:
        """Performs disk copies (rows ``(kind, src, dst)`` of kind ``COPY_SPILL`` or
        ``COPY_PERSIST``, with their 32-byte ``keys`` in order): each page is copied out of its
        pool now (a later copy may overwrite that page) and written in the background."""
        if len(keys) != 32 * len(rows):
            raise ValueError(
                f"keys must be 32 bytes for each of the {len(rows)} disk copies, got {len(keys)}"
            )
        kv = self.kv
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)  # offloads queued on the side stream land first
        for i, (kind, src, dst) in enumerate(np.asarray(rows).tolist()):
            if kind == radixkv.COPY_SPILL:
                payload = self._page_bytes(kv.host_k, kv.host_v, src)
            elif kind == radixkv.COPY_PERSIST:
                payload = self._page_bytes(kv.k, kv.v, src)
            else:
                raise ValueError(f"disk copy row {i} has kind {kind}, not a disk copy")
            if self.failed is not None:
                continue  # the disk failed: the page is lost (a later read of it fails too)
            try:
                self.pool.write(dst, keys[32 * i : 32 * i + 32], payload)
            except (OSError, RuntimeError) as e:
                # A full or failing disk must not stop the forward passes: the pages it should
                # have taken are lost, and reading them back fails its check, so nothing wrong
                # is ever served.
                self.failed = e
                warnings.warn(
                    f"writing the disk tier failed ({e}); its pages from now on are lost",
                    RuntimeWarning,
                    stacklevel=2,
                )

    # ---- reading back, saving ------------------------------------------------------------

    def prefetch(self, tokens: Sequence[int] | np.ndarray, namespace: Any = None) -> int:
        """Reads back from disk the pages of ``tokens`` past what the device and host tiers
        hold, into host pages, so that admitting ``tokens`` next finds them as host hits.
        Returns how many tokens came back (0 when the disk holds none of them). A page that
        reads torn or corrupted ends the run there and leaves the tier; its tokens are
        computed again."""
        cache = self.kv.cache
        fetch = cache.disk_prefetch(tokens, namespace)
        if fetch is None:
            return 0
        fid, _, slots, keys, host = fetch
        good, bad = 0, False
        try:
            # Spills logged so far (some made room for this prefetch) land before their slots
            # are read: the pool performs queued writes before any read.
            self.kv.apply_copies()
            payloads = self.pool.read(slots, keys)
            for payload, h in zip(payloads, host.tolist()):
                if payload is None:
                    bad = True
                    break
                self._scatter(payload, h)
                good += 1
        finally:
            entered = cache.disk_confirm(fid, good, bad)
        return entered * self.kv.page_size

    def save(self) -> int:
        """Writes every page the cache holds that the disk lacks, waits for every write, then
        replaces the directory's index atomically; returns how many pages it wrote. After it,
        a new process opening the directory finds every page the cache held."""
        n = self.kv.cache.disk_persist()
        self.kv.apply_copies()
        keys, slots = self.kv.cache.disk_entries()
        self.pool.save(keys, slots)
        return n

    def close(self) -> None:
        """Waits for the queued writes and closes the pool (saving nothing)."""
        self.pool.close()
