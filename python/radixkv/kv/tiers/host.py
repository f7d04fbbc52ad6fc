"""`HostTier`: the host pools of a ``KVCache``'s host tier and the copies between them and the
device pools.

The index (a cache made with ``host_pages > 0``) moves cached pages between the device and the
host tiers; it only *logs* the copies (``cache.drain_copies()``), and this object performs them,
every layer, in log order:

```text
  offload(d, h):  host_k[l][h*P:(h+1)*P] <- k[l][d*P:(d+1)*P]     (and V; every layer)
  load(h, d):     k[l][d*P:(d+1)*P]      <- host_k[l][h*P:(h+1)*P]
```

With a window group (``window_layers``) the full copies touch the full layers only, and the
window group's own host tier logs ``window_offload``/``window_load`` rows, performed the same way
on the window layers' pools.

On CUDA the copies run on a side stream that waits for the compute queued before them; one
event per layer marks that layer's copies done, and ``Step.attention(layer, ...)`` waits for it
before it touches the pool, so the attention of layer ``l`` overlaps the copies of later layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import radixkv

#: Kinds of a row of ``cache.drain_copies()``, as the core defines them.
COPY_OFFLOAD = radixkv.COPY_OFFLOAD
COPY_LOAD = radixkv.COPY_LOAD
COPY_SPILL = radixkv.COPY_SPILL
COPY_PERSIST = radixkv.COPY_PERSIST
COPY_WINDOW_OFFLOAD = radixkv.COPY_WINDOW_OFFLOAD
COPY_WINDOW_LOAD = radixkv.COPY_WINDOW_LOAD

#: One run of copies: ``(kind, segments)``, each segment ``(src_page, dst_page, num_pages)``
#: copying ``num_pages`` consecutive pages. The segments of a run are independent of each other
#: (no destination page twice), so they may be performed in any order; runs must be performed in
#: order.
CopyRun = tuple[int, list[tuple[int, int, int]]]


def copy_limits(
    num_pages: int, host_pages: int, window_pages: int = 0, window_host_pages: int = 0
) -> dict[int, tuple[int, int]]:
    """``kind -> (source pages, destination pages)`` of the copy kinds a pool of these tiers
    performs (the window kinds only with a window host tier)."""
    out = {COPY_OFFLOAD: (num_pages, host_pages), COPY_LOAD: (host_pages, num_pages)}
    if window_host_pages:
        out[COPY_WINDOW_OFFLOAD] = (window_pages, window_host_pages)
        out[COPY_WINDOW_LOAD] = (window_host_pages, window_pages)
    return out


def _log_error(i: int, row: Any, limits: dict[int, tuple[int, int]], why: str = "") -> ValueError:
    """The error for row ``i`` of a copy log (``why``: what is wrong besides the ranges)."""
    num_pages, host_pages = limits[COPY_OFFLOAD]
    more = ""
    if COPY_WINDOW_OFFLOAD in limits:
        wp, wh = limits[COPY_WINDOW_OFFLOAD]
        more = (
            f", kind {COPY_WINDOW_OFFLOAD} = window page < {wp} -> window host page < {wh}, "
            f"kind {COPY_WINDOW_LOAD} = the other way"
        )
    return ValueError(
        f"log row {i} = {list(row)} is not a copy ({why}kind {COPY_OFFLOAD} = offload "
        f"device page < {num_pages} -> host page < {host_pages}, kind {COPY_LOAD} = load "
        f"host page -> device page{more})"
    )


def check_log(log: Any, limits: dict[int, tuple[int, int]]) -> np.ndarray:
    """``log`` as checked int64 rows ``[N, 3]`` (see :func:`copy_runs` for what is refused);
    ``limits`` as :func:`copy_limits` gives them."""
    try:
        rows = np.asarray(log)
        if rows.dtype.kind not in "iu" and not isinstance(log, np.ndarray):
            # Ints numpy cannot hold in int64 (or that it turned into floats): keep them exact.
            rows = np.array(log, dtype=object)
    except (ValueError, TypeError) as e:  # ragged rows
        raise ValueError(f"log must be shaped [N, 3] (kind, src, dst): {e}") from None
    if rows.ndim == 1 and rows.size == 0:
        rows = rows.reshape(0, 3)  # [] or (): an empty log
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise ValueError(f"log must be shaped [N, 3] (kind, src, dst), got {rows.shape}")
    if len(rows) == 0:
        return np.zeros((0, 3), np.int64)
    if rows.dtype.kind in "iu":
        wide = rows.astype(np.int64, copy=False)
        if rows.dtype == np.uint64:  # ids past int64 would wrap to negative ones
            too_big = np.asarray(rows > np.iinfo(np.int64).max).any(axis=1, keepdims=True)
            wide = np.where(too_big, -1, wide)
        kind, src, dst = wide[:, 0], wide[:, 1], wide[:, 2]
        known = np.zeros(len(wide), dtype=bool)
        src_limit = np.zeros(len(wide), dtype=np.int64)
        dst_limit = np.zeros(len(wide), dtype=np.int64)
        for k, (ls, ld) in limits.items():
            this = kind == k
            known |= this
            src_limit[this], dst_limit[this] = ls, ld
        bad = ~known | (src < 0) | (src >= src_limit) | (dst < 0) | (dst >= dst_limit)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise _log_error(i, rows[i].tolist(), limits)
        return wide
    # Not an integer array: only an object array of Python/numpy ints passes, row by row.
    for i, row in enumerate(rows.tolist()):
        for x in row:
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                why = f"its values must be integers, got {x!r} ({type(x).__name__}); "
                raise _log_error(i, row, limits, why)
        k, s, d = (int(x) for x in row)
        lim_s, lim_d = limits.get(k, (0, 0))
        if not (0 <= s < lim_s and 0 <= d < lim_d):
            raise _log_error(i, [k, s, d], limits)
    return rows.astype(np.int64)


def copy_runs(
    log: np.ndarray,
    num_pages: int,
    host_pages: int,
    window_pages: int = 0,
    window_host_pages: int = 0,
) -> list[CopyRun]:
    """The copies of ``log`` (rows ``(kind, src, dst)`` as ``cache.drain_copies()`` returns
    them) grouped for performing: consecutive rows of one kind form a run, and a run ends early
    where a destination page it already wrote comes again (that second write must follow the
    first). Within a run, a row whose source and destination both continue the previous row's
    (``+1``) extends that row's segment: pages are contiguous slot ranges, so a segment is one
    slice copy. Performing the runs in order, and each run's segments in any order, gives what
    performing the rows one by one in log order gives.

    ``ValueError`` for a ``log`` not shaped ``[N, 3]`` (an empty sequence is an empty log), and
    naming the row for one that is not integers (floats are refused, not truncated), a kind
    other than ``COPY_OFFLOAD``/``COPY_LOAD`` (and, with ``window_host_pages``,
    ``COPY_WINDOW_OFFLOAD``/``COPY_WINDOW_LOAD`` between the ``window_pages`` window pages and
    the window host pages), or a page id outside its tier (device ids ``0..num_pages``, host
    ids ``0..host_pages``; however large): checked before anything is grouped.
    """
    rows = check_log(log, copy_limits(num_pages, host_pages, window_pages, window_host_pages))
    if len(rows) == 0:
        return []
    runs: list[tuple[int, list[list[int]]]] = []
    segs: list[list[int]] = []
    written: set[int] = set()
    last_kind = -1
    for k, s, d in rows.tolist():
        if k != last_kind or d in written:
            segs = [[s, d, 1]]
            runs.append((k, segs))
            written = set()
            last_kind = k
        else:
            seg = segs[-1]
            if s == seg[0] + seg[2] and d == seg[1] + seg[2]:
                seg[2] += 1
            else:
                segs.append([s, d, 1])
        written.add(d)
    return [(k, [(s, d, n) for s, d, n in run]) for k, run in runs]


def check_host_device(
    host_device: str | torch.device | None, host_pages: int
) -> torch.device | None:
    """The checked ``host_device`` of a ``KVCache`` over a cache with ``host_pages`` host pages."""
    if host_device is None:
        if host_pages:
            raise ValueError(
                f"the cache has a host tier (host_pages={host_pages}): pass host_device "
                '(e.g. host_device="cpu") so the KVCache holds the host pool and performs the '
                "copies between the tiers"
            )
        return None
    if not host_pages:
        raise ValueError(
            f"host_device={host_device!r} needs a cache with a host tier, got one with "
            "host_pages=0 (make it with host_pages > 0, or leave host_device=None)"
        )
    if not isinstance(host_device, (str, torch.device)):
        raise TypeError(
            f"host_device must be a str or torch.device, got {type(host_device).__name__}"
        )
    try:
        dev = torch.device(host_device)
    except RuntimeError as e:
        raise ValueError(f"host_device={host_device!r} is not a torch device: {e}") from None
    if dev.type != "cpu":
        # The tier is host memory: "meta" has no storage to copy KV into (the first load of a
        # plan would fail), and a pool on an accelerator is device memory, which the device
        # pool itself would use better (more pages, no copies).
        why = "a meta device has no storage" if dev.type == "meta" else "it is not host memory"
        raise ValueError(
            f"host_device={host_device!r} cannot hold the host tier ({why}): the host pool lives "
            'in CPU memory, pass host_device="cpu"'
        )
    return dev


class HostTier:
    """The host pools ``k[l]``/``v[l]`` of a ``KVCache`` (``kv``) over a cache with a host tier,
    on ``device`` (the CPU: :func:`check_host_device`), and the copies the index logs between
    them and ``kv``'s device pools.

    A full layer's host pools have ``host_pages * page_size`` rows, a window layer's
    ``window_host_pages * page_size``, shaped as the device pools' rows; zeroed, and pinned
    when ``kv`` is on CUDA. If a copy raises, the copies not yet performed stay queued
    (:attr:`pending`) for the next :meth:`perform`.
    """

    def __init__(self, kv: Any, device: torch.device) -> None:
        cache = kv.cache
        self.kv = kv  # the KVCache (not imported: kv_cache imports this module)
        self.device = device
        #: Host pages of the full layers and of the window layers.
        self.pages = cache.host_pages
        self.window_pages = cache.window_host_pages
        #: The tiers' sizes, as :func:`copy_runs` takes them.
        self.tiers = (kv.num_pages, self.pages, cache.window_pages, self.window_pages)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        rows = self.pages * kv.page_size
        window_rows = self.window_pages * kv.page_size
        pin = kv.device.type == "cuda" and device.type == "cpu"
        for layer in range(kv.num_layers):
            shape = (
                window_rows if layer in kv.window_layers else rows,
                kv.num_kv_heads,
                kv.head_dim,
            )
            for pools in (self.k, self.v):
                pools.append(torch.zeros(shape, dtype=kv.dtype, device=device, pin_memory=pin))
        self._stream: Any = None  # torch.cuda.Stream of the copies (CUDA only)
        if kv.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=kv.device)
        self._non_blocking = kv.device.type == "cuda"
        self._last_event: Any = None  # torch.cuda.Event of copies not yet waited for
        self._runs: list[CopyRun] = []  # drained copies not yet performed (after an error)
        self._run_start = [0] * kv.num_layers  # per layer: the first run not yet performed
        self._pending_rows = 0

    @property
    def pending(self) -> int:
        """Runs of copies drained from the log and not performed yet (left by a copy that
        raised; 0 otherwise)."""
        return len(self._runs)

    @property
    def nbytes(self) -> int:
        """Bytes held by the host pools of every layer."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def perform(
        self, overlap: bool = False, log: np.ndarray | None = None
    ) -> tuple[int, list[Any] | None]:
        """Drains the index's log (or takes ``log``, checked as :func:`check_log` does) and
        performs every queued copy: ``(page copies performed, events)``.

        On CUDA: the side stream first waits for the current stream (an offload reads KV that
        compute queued earlier wrote), performs layer by layer, and records one event per layer.
        With ``overlap`` the events are returned for ``Step.attention`` to wait on, layer by
        layer; otherwise (and whenever no copy was queued) the current stream waits for all
        copies queued so far and ``None`` is returned."""
        if log is None:
            log = self.kv.cache.drain_copies()
            if len(log):
                self._runs.extend(copy_runs(log, *self.tiers))
                self._pending_rows += len(log)
        else:  # the caller's rows: checked whatever they are, an empty log included
            rows = check_log(log, copy_limits(*self.tiers))
            if len(rows):
                self._runs.extend(copy_runs(rows, *self.tiers))
                self._pending_rows += len(rows)
        events = None
        done = 0
        if self._runs:
            stream = self._stream
            if stream is None:
                self._perform_runs(None)
            else:
                stream.wait_stream(torch.cuda.current_stream(self.kv.device))
                events = [torch.cuda.Event() for _ in range(self.kv.num_layers)]
                with torch.cuda.stream(stream):
                    self._perform_runs(events)
                self._last_event = events[-1]
            done = self._pending_rows
            self._runs = []
            self._run_start = [0] * self.kv.num_layers
            self._pending_rows = 0
        if self._last_event is not None and (events is None or not overlap):
            torch.cuda.current_stream(self.kv.device).wait_event(self._last_event)
            self._last_event = None
            events = None
        return done, events

    def _perform_runs(self, events: list[Any] | None) -> None:
        """Performs the queued runs, layer by layer (K then V of each segment), advancing
        ``_run_start`` after each run so that an error leaves exactly the rest queued. Records
        ``events[layer]`` after each layer's copies on the current (side) stream."""
        kv = self.kv
        ps = kv.page_size
        runs = self._runs
        nb = self._non_blocking
        for layer in range(kv.num_layers):
            dev_k, dev_v = kv.k[layer], kv.v[layer]
            host_k, host_v = self.k[layer], self.v[layer]
            # A window layer's pools take the window group's copies only, the others the rest.
            down, up = (
                (COPY_WINDOW_OFFLOAD, COPY_WINDOW_LOAD)
                if layer in kv.window_layers
                else (COPY_OFFLOAD, COPY_LOAD)
            )
            for i in range(self._run_start[layer], len(runs)):
                kind, segments = runs[i]
                if kind == down:
                    src_k, src_v, dst_k, dst_v = dev_k, dev_v, host_k, host_v
                elif kind == up:
                    src_k, src_v, dst_k, dst_v = host_k, host_v, dev_k, dev_v
                else:
                    self._run_start[layer] = i + 1
                    continue
                for src, dst, pages in segments:
                    a, b, m = src * ps, dst * ps, pages * ps
                    dst_k[b : b + m].copy_(src_k[a : a + m], non_blocking=nb)
                    dst_v[b : b + m].copy_(src_v[a : a + m], non_blocking=nb)
                self._run_start[layer] = i + 1
            if events is not None:
                events[layer].record()
