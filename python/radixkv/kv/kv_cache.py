"""`KVCache`: the paged K/V tensors of every layer, indexed by a `RadixCache` or `BlockCache`.

The Rust cache decides which *slot* holds the KV of which token; this class owns the tensors those
slots index. Slot ``s`` of layer ``l`` is row ``s`` of ``k[l]`` and ``v[l]``:

```text
  k[l]:  [num_pages * page_size, num_kv_heads, head_dim]      ("NHD", slot-major)
          |-- page 0 --|-- page 1 --| ... one page = page_size consecutive slots
```

With a host tier (a cache made with ``host_pages > 0``, and ``KVCache(..., host_device="cpu")``)
the index moves cached pages between the device pools ``k``/``v`` and the host pools
``host_k``/``host_v`` and logs the copies; the :class:`~radixkv.kv.tiers.host.HostTier` performs
them (:meth:`KVCache.apply_copies`, called by every :meth:`KVCache.plan`; on CUDA on a side
stream that each layer's attention waits for).

With a disk tier as well (``disk_pages > 0``, ``KVCache(..., disk_dir=...)``) the log also holds
``spill(h, s)`` and ``persist(d, s)``, performed through :mod:`radixkv.kv.tiers.disk` (a log
holding them is performed without the side stream's overlap).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

import radixkv
from radixkv.kv import backends as _backends
from radixkv.kv import devices as _devices
from radixkv.kv.backends.mirror import DecodeMirror
from radixkv.kv.step import Step
from radixkv.kv.tiers.disk import DiskTier
from radixkv.kv.tiers.host import (
    COPY_PERSIST,
    COPY_SPILL,
    HostTier,
    check_host_device,
    check_log,
    copy_limits,
)
from radixkv.kv.tiers.shared import SharedTier

#: Element types the pool may hold.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in DTYPES:
        names = ", ".join(str(d) for d in DTYPES)
        raise ValueError(f"dtype must be one of {names}, got {dtype!r}")
    return dtype


def _window_layers(layers: Any, num_layers: int, cache: radixkv.Cache) -> frozenset[int]:
    """The window layers, checked against the cache's window group."""
    try:
        out = sorted({int(x) for x in layers})
    except (TypeError, ValueError):
        raise TypeError(
            f"window_layers must be a sequence of layer indices, got {layers!r}"
        ) from None
    bad = [x for x in out if not 0 <= x < num_layers]
    if bad:
        raise ValueError(f"window_layers must be in [0, {num_layers}), got {bad[0]}")
    if out and not cache.window:
        raise ValueError(
            f"window_layers={out} needs a cache with a window group: make it with window= and "
            "window_pages="
        )
    if cache.window and not out:
        raise ValueError(
            f"the cache has a window group (window={cache.window}, window_pages="
            f"{cache.window_pages}): pass window_layers, the layers that attend through it"
        )
    return frozenset(out)


_AUTO_SAID: set[str] = set()


def _say_auto_reason(device: torch.device) -> None:
    """Warns once per device when ``attention="auto"`` cannot take its first choice there."""
    why = _backends.auto_reason(device)
    if why is not None and str(device) not in _AUTO_SAID:
        _AUTO_SAID.add(str(device))
        warnings.warn(why, RuntimeWarning, stacklevel=3)


class KVCache:
    """Per-layer K and V pools shaped ``[num_pages * page_size, num_kv_heads, head_dim]``.

    ``cache`` (a :class:`radixkv.RadixCache` or :class:`radixkv.BlockCache`) decides which slots a
    request's tokens live in; this object holds the tensors. Rows are zero-initialised: padded
    keys of a batch read slot 0, and zeros keep masked-out scores finite.

    ``attention`` picks how steps attend (:mod:`radixkv.kv.backends`): ``"auto"`` (the fastest
    measured choice per device, dtype and step kind: ``"triton"`` on CUDA), ``"sdpa"`` (gather +
    SDPA, the reference; cuDNN excluded on CUDA), ``"triton"`` (paged kernels reading the pool in
    place; CUDA, or the CPU under ``TRITON_INTERPRET=1``), ``"flex"`` (compiled flex attention
    over the pool in place, decode; pages of at least 16 slots on CUDA), ``"varlen"`` (CUDA) or
    ``"flashinfer"`` (CUDA, when installed). A backend unavailable here raises ``ValueError``
    saying why. Call :meth:`warmup` before serving so nothing compiles then. ``device`` is
    compared as torch does: ``"cuda"`` is the current CUDA device (``self.device`` holds its
    index).

    Host tier: for a cache made with ``host_pages > 0``, ``host_device`` (a CPU device:
    ``"cpu"``; ``ValueError`` naming it for any other, ``"meta"`` included, whatever ``device``
    is) is required and gets the host pools ``host_k[l]``/``host_v[l]`` (``[host_pages * page_size,
    num_kv_heads, head_dim]``, zeroed; pinned memory when ``device`` is CUDA and ``host_device``
    the CPU). Every :meth:`plan` performs the copies the index logged first
    (:meth:`apply_copies`); code that reads or writes the pools of a request's pages outside a
    planned step must call :meth:`apply_copies` itself, after the cache call that admitted or
    extended the request. Without a tier ``host_device`` must be ``None``.

    Disk tier: for a cache made with ``disk_pages > 0`` (behind a host tier), ``disk_dir`` (a
    directory, created if missing) is required and gets the disk pool (:mod:`.tiers.disk_pool`: one
    preallocated file, each page written with its block key and checksum). The copies the
    index logs to disk are performed by :meth:`apply_copies` with the rest (pages copied out at
    once, written by a background thread); :meth:`prefetch` reads a prompt's pages back before
    it is admitted (the engine does it for every request), :meth:`save` makes the directory
    hold every page the cache holds, and a ``KVCache`` opened later on the directory restores
    its index. ``fingerprint`` (e.g. :func:`radixkv.kv.tiers.fingerprint.model_fingerprint`) names
    what the KV depends on beyond the pool's layout; a directory written under another one, or
    another layout, raises :class:`radixkv.kv.tiers.DiskMismatchError` (``on_mismatch="error"``) or
    starts empty (``"reset"``). Without a disk tier ``disk_dir`` must be ``None``.

    Shared tier: ``shared_store`` (a store URL: ``redis://host:port``, ``unix:///path``) shares
    pages with every replica on the same store (:mod:`radixkv.kv.tiers.shared`): the pages each
    step completes are sent in the background, and :meth:`prefetch` fetches a prompt's pages
    the local tiers lack. Pages are keyed and checked by ``fingerprint`` and the layout.
    ``shared_store_key`` (the operator's secret, 16 bytes or more) makes every page carry an
    HMAC; without it a store not on a loopback address or unix socket is refused.

    Sliding-window layers: for a cache made with ``window=W, window_pages=N`` (see SEMANTICS.md,
    "Sliding-window layers"), ``window_layers`` names the layers whose queries attend to the last
    ``W`` keys (or fewer); their pools are ``[N * page_size, num_kv_heads, head_dim]``, indexed by
    each request's ``window_pages``, and ``Step.attention`` of such a layer must pass
    ``window=`` (at most ``W``). The other layers' pools are the full ones. Without a window group
    ``window_layers`` must be empty. With a host tier as well, a window layer's host pools have
    ``cache.window_host_pages * page_size`` rows, and the copies of the window group
    (``COPY_WINDOW_OFFLOAD``, ``COPY_WINDOW_LOAD``) are performed on the window layers' pools
    only, those of the full group on the other layers' only.

    Decode mirror: the SDPA backend keeps the running decode requests' keys contiguous across
    steps (:mod:`radixkv.kv.backends.mirror`), so a decode step copies one new row per request
    and layer instead of gathering every key. ``decode_mirror`` caps its rows per full layer,
    for K and for V (``None``: ``num_slots`` on the CPU, where the gather costs as much as the
    attention, 0 elsewhere; 0: off); it is exact either way, and holds at most
    ``2 * decode_mirror`` rows per full layer beside the pool (``mirror.nbytes``).

    Safety rule: the KV in a slot is valid only while the cache keeps that slot's page pinned or
    published; a slot of a finished, unpublished page may be overwritten by the next admission.
    """

    def __init__(
        self,
        cache: radixkv.Cache,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attention: str = "auto",
        host_device: str | torch.device | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        fingerprint: Mapping[str, object] | None = None,
        on_mismatch: str = "error",
        window_layers: Sequence[int] = (),
        decode_mirror: int | None = None,
        shared_store: str | None = None,
        shared_store_key: bytes | str | None = None,
    ) -> None:
        if not isinstance(cache, radixkv.Cache):
            raise TypeError(f"cache must be a RadixCache or BlockCache, got {type(cache).__name__}")
        if not isinstance(attention, str):
            raise TypeError(f"attention must be a str, got {type(attention).__name__}")
        device = _devices.canonical(device)
        _backends.check_name(attention, device)
        _backends.check_pool(attention, device, cache.page_size)
        if attention == "auto":
            _say_auto_reason(device)
        host_pages = cache.host_pages
        host = check_host_device(host_device, host_pages)
        self.attention = attention
        self.cache = cache
        # The cache these pools are sized and indexed for: only its requests may be planned.
        self._owner = cache
        self.num_layers = _positive("num_layers", num_layers)
        self.num_kv_heads = _positive("num_kv_heads", num_kv_heads)
        self.head_dim = _positive("head_dim", head_dim)
        self.dtype = _check_dtype(dtype)
        self.device = device
        self.page_size = cache.page_size
        self.num_pages = cache.num_pages
        self.num_slots = self.num_pages * self.page_size
        #: Tokens a window layer's query reads (0: no window group), the window layers, and the
        #: slots of their pools.
        self.window = cache.window
        self.window_layers = _window_layers(window_layers, self.num_layers, cache)
        self.num_window_slots = cache.window_pages * self.page_size
        shape = (self.num_slots, self.num_kv_heads, self.head_dim)
        wshape = (self.num_window_slots, self.num_kv_heads, self.head_dim)
        self.k, self.v = [], []
        for layer in range(num_layers):
            rows = wshape if layer in self.window_layers else shape
            self.k.append(torch.zeros(rows, dtype=dtype, device=self.device))
            self.v.append(torch.zeros(rows, dtype=dtype, device=self.device))
        #: Host pages of the cache's host tier (0: no tier; every host attribute below empty).
        self.host_pages = host_pages
        self.host_device = host
        self.num_host_slots = host_pages * self.page_size
        #: Pages of the window group's host tier (0: none); window layers' host pools have
        #: ``window_host_pages * page_size`` rows.
        self.window_host_pages = cache.window_host_pages
        #: The tiers' sizes, as :func:`~radixkv.kv.tiers.host.copy_runs` takes them.
        self._tiers = (self.num_pages, host_pages, cache.window_pages, self.window_host_pages)
        #: The host tier's pools and copies (None without one).
        self.host: HostTier | None = None if host is None else HostTier(self, host)
        self.host_k: list[torch.Tensor] = [] if self.host is None else self.host.k
        self.host_v: list[torch.Tensor] = [] if self.host is None else self.host.v
        #: The disk tier's pool and copies (None without one; see :mod:`radixkv.kv.tiers.disk`).
        self.disk: DiskTier | None = None
        self.disk_pages = cache.disk_pages
        if disk_dir is None:
            if self.disk_pages:
                raise ValueError(
                    f"the cache has a disk tier (disk_pages={self.disk_pages}): pass disk_dir "
                    "(a directory) so the KVCache holds the disk pool and performs its copies"
                )
        elif not self.disk_pages:
            raise ValueError(
                f"disk_dir={os.fspath(disk_dir)!r} needs a cache with a disk tier, got one with "
                "disk_pages=0 (make it with host_pages > 0 and disk_pages > 0)"
            )
        else:
            self.disk = DiskTier(self, disk_dir, fingerprint, on_mismatch)
        #: The shared tier (None without one; see :mod:`radixkv.kv.tiers.shared`).
        self.shared: SharedTier | None = None
        if shared_store is not None:
            try:
                self.shared = SharedTier(self, shared_store, fingerprint, shared_store_key)
            except BaseException:
                if self.disk is not None:
                    self.disk.close()
                raise
        elif shared_store_key is not None:
            raise ValueError("shared_store_key needs shared_store (the store's URL)")
        self._gather_k: torch.Tensor | None = None
        self._gather_v: torch.Tensor | None = None
        self._backends: dict[str, _backends.Backend] = {}
        #: The backend names decode and prefill groups run: ``attention`` itself, or what
        #: ``"auto"`` picks for this device and dtype (resolved here, once; flex serves decode
        #: groups only, prefill through SDPA measured faster).
        self._decode_name, self._prefill_name = (
            (
                _backends.auto_choice(device, self.dtype, True),
                _backends.auto_choice(device, self.dtype, False),
            )
            if attention == "auto"
            else (attention, attention)
        )
        if self._prefill_name == "flex":
            self._prefill_name = "sdpa"
        if decode_mirror is None:  # the gather it saves costs as much as SDPA on the CPU only
            decode_mirror = self.num_slots if self.device.type == "cpu" else 0
        elif isinstance(decode_mirror, bool) or not isinstance(decode_mirror, int):
            raise TypeError(f"decode_mirror must be an int, got {type(decode_mirror).__name__}")
        elif decode_mirror < 0:
            raise ValueError(f"decode_mirror must be >= 0 (0: off), got {decode_mirror}")
        #: The SDPA backend's decode lanes (:mod:`radixkv.kv.backends.mirror`).
        self.mirror = DecodeMirror(self, decode_mirror)

    def backend(self, name: str) -> _backends.Backend:
        """This pool's backend object ``name`` (a key of
        :data:`radixkv.kv.backends.BACKENDS`), made on first use and kept: what it builds for
        a step, and what it compiled, serve every later step. ``ValueError`` for a name that is
        not a backend (``"auto"`` is a choice among them: :meth:`backend_for`) or that cannot
        run here, saying why."""
        obj = self._backends.get(name)
        if obj is None:
            make = _backends.BACKENDS.get(name) if isinstance(name, str) else None
            if make is None:
                raise ValueError(
                    f"backend name must be one of {', '.join(map(repr, _backends.BACKENDS))}, "
                    f"got {name!r}"
                )
            _backends.check_name(name, self.device)
            obj = self._backends[name] = make(self)
        return obj

    def backend_for(self, decode: bool, batch: int) -> _backends.Backend:
        """The backend serving a decode (or prefill) group of ``batch`` requests: the one
        ``attention`` names, or the one ``"auto"`` picked when this pool was made. ``"flex"``
        serves decode only (prefill through SDPA measured faster); ``"auto"`` uses flex only
        for batch buckets :meth:`warmup` compiled."""
        name = self._decode_name if decode else self._prefill_name
        if name == "flex" and self.attention == "auto":
            flex = self._backends.get("flex")
            compiled = flex.compiled if isinstance(flex, _backends.FlexBackend) else ()
            if _backends.batch_bucket(batch) not in compiled:
                name = "sdpa"
        return self.backend(name)

    def warmup(
        self,
        num_heads: int,
        batch_sizes: Iterable[int] = (1, 2, 4, 8, 16, 32),
        scale: float | None = None,
    ) -> list[int]:
        """Compiles ahead what decode steps of ``batch_sizes`` requests will run, for queries of
        ``num_heads`` heads (a multiple of ``num_kv_heads``) and softmax ``scale`` (default
        ``1/sqrt(head_dim)``), so serving never compiles on the hot path. Only flex compiles
        (``"flex"``, and ``"auto"`` where flex is the measured choice); returns the batch
        buckets (powers of two) compiled now or before, empty where nothing compiles. Triton
        (``"triton"``, and ``"auto"`` on CUDA) compiles its kernels for each batch size's
        decode grid and both prefill tile sizes, and returns the batch sizes. Reads
        the pool, writes nothing. ``ValueError`` naming the argument for a ``batch_sizes``
        that is not an iterable of positive ints (a single int included) and for a ``scale``
        that is not a positive finite number, checked before anything compiles."""
        heads = _positive("num_heads", num_heads)
        if heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads must be a multiple of num_kv_heads={self.num_kv_heads}, got {heads}"
            )
        if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Iterable):
            raise ValueError(
                f"batch_sizes must be an iterable of positive ints (e.g. (1, 2, 4)), got "
                f"{batch_sizes!r}"
            )
        sizes = [_positive(f"batch_sizes[{i}]", b) for i, b in enumerate(batch_sizes)]
        if scale is not None and (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float, np.integer, np.floating))
            or not math.isfinite(scale)
            or scale <= 0
        ):
            raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
        name = self._decode_name
        if name == "triton":
            s = scale if scale is not None else 1.0 / math.sqrt(self.head_dim)
            triton = self.backend("triton")
            assert isinstance(triton, _backends.TritonBackend)
            return triton.warmup(heads, sizes, s)
        if name != "flex":
            return []
        flex = self.backend("flex")
        done = []
        for bucket in sorted({_backends.batch_bucket(b) for b in sizes}):
            g = _backends.Group(
                req=np.arange(bucket),
                rows=None,
                q_len=np.ones(bucket, np.int64),
                kv_len=np.ones(bucket, np.int64),
                q_start=np.arange(bucket + 1),
                positions=torch.zeros(bucket, dtype=torch.long, device=self.device),
                block_table=torch.zeros(bucket, 1, dtype=torch.int32, device=self.device),
                seq_lens=torch.ones(bucket, dtype=torch.int32, device=self.device),
                is_decode=True,
            )
            flex.prepare(None, g)
            q = torch.zeros(bucket, heads, self.head_dim, dtype=self.dtype, device=self.device)
            s = scale if scale is not None else 1.0 / math.sqrt(self.head_dim)
            flex.attend(None, g, 0, q, q, q, s)
            done.append(bucket)
        return done

    @staticmethod
    def bytes_per_page(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        page_size: int = 1,
    ) -> int:
        """Bytes one page takes across every layer, K and V together."""
        elem = torch.empty((), dtype=_check_dtype(dtype)).element_size()
        per_token = (
            2 * _positive("num_layers", num_layers) * _positive("num_kv_heads", num_kv_heads)
        )
        return (
            per_token * _positive("head_dim", head_dim) * elem * _positive("page_size", page_size)
        )

    @staticmethod
    def pages_for_budget(
        budget_bytes: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        page_size: int = 1,
    ) -> int:
        """How many pages fit in ``budget_bytes`` of K/V memory (at least one page must fit)."""
        page = KVCache.bytes_per_page(num_layers, num_kv_heads, head_dim, dtype, page_size)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)):
            raise TypeError(f"budget_bytes must be an int, got {budget_bytes!r}")
        if budget_bytes < page:
            raise ValueError(f"budget_bytes={budget_bytes} is smaller than one page ({page} bytes)")
        return int(budget_bytes) // page

    def gather_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two contiguous ``[rows, num_kv_heads, head_dim]`` scratch tensors that attention
        gathers each batch's K and V into. Kept between layers and steps (grown when a step
        needs more): allocating megabytes afresh in every layer costs more than the gather
        itself on CPU. Their contents are valid only inside one ``Step.attention`` call."""
        if self._gather_k is None or self._gather_k.shape[0] < rows:
            size = max(rows, 64)
            shape = (size, self.num_kv_heads, self.head_dim)
            # Normal tensors even under torch.inference_mode: a step run outside it later
            # could not write into inference tensors.
            with torch.inference_mode(False):
                self._gather_k = torch.empty(shape, dtype=self.dtype, device=self.device)
                self._gather_v = torch.empty(shape, dtype=self.dtype, device=self.device)
        assert self._gather_v is not None  # allocated together with _gather_k
        return self._gather_k[:rows], self._gather_v[:rows]

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V pools of every layer on ``device`` (the gather buffers,
        the decode mirror's lanes, ``mirror.nbytes``, and the host pools not included)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def host_nbytes(self) -> int:
        """Bytes held by the host pools ``host_k``/``host_v`` of every layer (0 without a host
        tier)."""
        return 0 if self.host is None else self.host.nbytes

    def apply_copies(self, log: np.ndarray | None = None) -> int:
        """Performs the copies between the tiers the index has logged (``cache.drain_copies()``),
        in log order, and returns how many page copies it performed (0 without a host tier).

        :meth:`plan` calls it first; call it yourself before reading or writing the pools of a
        request's pages outside a planned step (after the ``admit``/``extend`` that gave the
        request its pages), e.g. to read a cached prefix out of ``k``/``v``. On CUDA the copies
        run on a side stream and the current stream waits for them before this returns, so
        work queued on it afterwards sees them (the CPU reading the host pools itself must
        ``torch.cuda.synchronize()`` first). If a copy raises, the copies not yet performed stay
        queued for the next call.

        ``log``: rows the caller already drained from the cache itself, performed instead of
        draining (``ValueError`` naming the row, performing nothing, for a ``log`` not shaped
        ``[N, 3]`` or a row that is not integers or not a copy of this pool's tiers; see
        :func:`copy_runs`).
        """
        if self.host is None:
            if log is not None:  # checked all the same: any row is a copy to a missing tier
                check_log(log, copy_limits(*self._tiers))
            return 0
        n, _ = self._apply_copies(overlap=False, log=log)
        return n

    def _apply_copies(
        self, overlap: bool, log: np.ndarray | None = None
    ) -> tuple[int, list[Any] | None]:
        """Performs the logged copies (or ``log``): through the disk tier as well where there
        is one and the log is the index's, else through the host tier alone
        (:meth:`HostTier.perform`: ``(page copies performed, events)``)."""
        assert self.host is not None  # callers check
        if log is None and self.disk is not None:
            return self._apply_with_disk(), None
        return self.host.perform(overlap, log)

    def _apply_with_disk(self) -> int:
        """Drains the log with its disk keys and performs it in order, without overlap: each
        stretch of tier copies through the :class:`HostTier`, each stretch of disk copies through
        the :class:`DiskTier` (pages copied out at once, written in the background)."""
        assert self.disk is not None and self.host is not None
        rows, keys = self.cache.drain_copies(keys=True)
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        done = 0
        if self.host.pending:  # left by an earlier error
            done += self.host.perform(log=np.zeros((0, 3), np.int64))[0]
        disk_row = (rows[:, 0] == COPY_SPILL) | (rows[:, 0] == COPY_PERSIST)
        k = 0  # disk keys used so far
        i = 0
        while i < len(rows):
            j = i
            while j < len(rows) and disk_row[j] == disk_row[i]:
                j += 1
            if disk_row[i]:
                self.disk.write(rows[i:j], keys[32 * k : 32 * (k + j - i)])
                k += j - i
                done += j - i
            else:
                done += self.host.perform(log=rows[i:j])[0]
            i = j
        return done

    def fetch(
        self, tokens: Sequence[int] | np.ndarray, namespace: Any = None
    ) -> tuple[int, int, bool]:
        """Reads back from the disk tier the pages of ``tokens`` the device and host tiers
        lack, and installs what the shared tier fetched of them or starts that fetch (never
        waiting on the store: :meth:`radixkv.kv.tiers.shared.SharedTier.poll`). Returns
        ``(tokens from disk, tokens from the shared tier, whether a shared fetch for them is
        still out)``: the engine holds such a request out of admission a little while, so
        that it finds them as hits. ``(0, 0, False)`` without those tiers."""
        d = 0 if self.disk is None else self.disk.prefetch(tokens, namespace)
        if self.shared is None:
            return d, 0, False
        n, out = self.shared.poll(tokens, namespace)
        return d, n, out

    def prefetch(
        self, tokens: Sequence[int] | np.ndarray, namespace: Any = None, wait_s: float = 0.0
    ) -> int:
        """Reads back from the disk tier, then from the shared tier, the pages of ``tokens``
        the device and host tiers lack, so that admitting ``tokens`` next finds them; returns
        how many tokens came back from either. The shared tier's fetch runs on its own
        thread: ``wait_s`` is how long to wait for it (0: install what came back before, start
        the fetch otherwise). 0 without those tiers. See
        :meth:`radixkv.kv.tiers.disk.DiskTier.prefetch` and
        :meth:`radixkv.kv.tiers.shared.SharedTier.prefetch`."""
        n = 0 if self.disk is None else self.disk.prefetch(tokens, namespace)
        if self.shared is not None:
            n += self.shared.prefetch(tokens, namespace, wait_s)
        return n

    def save(self) -> int:
        """Saves the disk tier so that the next process opening ``disk_dir`` finds every page
        the cache holds now; returns how many pages it wrote. ``ValueError`` without a disk
        tier. See :meth:`radixkv.kv.tiers.disk.DiskTier.save`."""
        if self.disk is None:
            raise ValueError("this KVCache has no disk tier (make it with disk_dir=...)")
        return self.disk.save()

    def close(self) -> None:
        """Waits for the disk tier's queued writes and closes its files (saving nothing; call
        :meth:`save` first to keep the pages), and sends the shared tier's queued pages and
        closes its connections. Nothing to do without those tiers."""
        if self.disk is not None:
            self.disk.close()
        if self.shared is not None:
            self.shared.close()

    def plan(self, requests: Sequence[radixkv.Request]) -> Step:
        """Plans one forward pass over ``requests``: each request's tokens
        ``num_computed:num_tokens``, packed in order. One call into Rust, one host-to-device copy.
        With a host tier, first performs the copies the index logged (:meth:`apply_copies`; on
        CUDA overlapped with the step: ``Step.attention`` waits for each layer's copies).

        Raises ``ValueError``, before anything is computed, for a request of another cache or
        one named twice; ``TypeError`` for anything but a ``Request``.
        """
        requests = list(requests)
        # Checked here before the copies run, by plan_step's own checks (the one owner of them).
        plan = radixkv.plan_step(requests, self._owner)
        events = None
        if self.host_pages:  # the one check the no-tier path pays
            events = self._apply_copies(overlap=True)[1]
        return Step(self, requests, plan, copy_events=events)

    def commit(self, step: Step, num_computed: list[int] | None = None) -> None:
        """Marks the KV of every token planned in ``step`` as written (publishing full pages).
        One call into Rust for the whole step (``commit_many``: all requests or none). A stale
        step (committed already, or a request changed since it was planned) raises
        :class:`radixkv.StaleStepError` and commits nothing. ``num_computed``: each request's
        count to commit instead of all it planned (a speculative step commits a request's
        drafts once they are verified: :meth:`settle`)."""
        if step.kv is not self:
            raise ValueError("step was planned by another KVCache")
        step.check_current()
        counts = step.kv_len_list if num_computed is None else num_computed
        if self.shared is None:
            self.cache.commit_many(step.requests, counts)
            return
        starts = [r.num_computed for r in step.requests]
        self.cache.commit_many(step.requests, counts)
        # The pages this step completed go to the shared store, behind the request.
        self.shared.publish(step.requests, starts, counts)

    def settle(self, req: radixkv.Request, num_computed: int) -> None:
        """After a speculative step: commits ``req`` up to ``num_computed`` tokens (its verified
        ones; publishing the full pages they complete, to the shared tier too) and gives back
        the rest of what the step planned (``cache.truncate``: the rejected drafts, whose slots
        the next step writes again). The truncate comes first: with a window group a commit
        releases the window pages below what the request's next query reads, which a request
        still holding its drafts reads from further on."""
        start = req.num_computed
        self.cache.truncate(req, num_computed)
        self.cache.commit(req, num_computed)
        if self.shared is not None:
            self.shared.publish([req], [start], [num_computed])

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, num_slots={self.num_slots}, dtype={self.dtype}, "
            f"device={self.device}, attention={self.attention!r}"
            + (
                f", host_pages={self.host_pages}, host_device={self.host_device}"
                if self.host_pages
                else ""
            )
            + ")"
        )
