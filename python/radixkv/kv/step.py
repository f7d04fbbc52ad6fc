"""`Step`: one planned forward pass, and attention over cached prefixes through a backend.

Request ``b`` of a step computes its tokens ``num_computed..num_tokens``; they sit in the packed
batch at rows ``q_start[b]..q_start[b+1]`` and attend to keys ``0..=pos`` of their own request:

```text
  keys of b:     [ cached / computed earlier ........ | new tokens ]   kv_len[b] = num_tokens
                 0                             num_computed
  query at pos:  sees keys 0..=pos                   (bottom-right aligned causal mask)
```

The plan describes the keys by page tables (``block_table``, FlashInfer's CSR triplet), never by
one slot per key. The step splits its requests into a decode group (one new token each) and a
prefill group; each runs through the backend ``KVCache(attention=...)`` picks for it
(:mod:`radixkv.kv.backends`), which prepares what it needs once per step (masks, slot matrix,
block mask) and shares it with every layer.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import torch

import radixkv
from radixkv.kv import windowed as _windowed
from radixkv.kv.backends import Backend, Group, slot_matrix
from radixkv.kv.host_copy import to_device


def _aligned_views(ints: np.ndarray, sizes: list[int], dev: torch.device) -> list[torch.Tensor]:
    """``ints`` (int32, sections of ``sizes`` back to back) on ``dev`` in one host-to-device
    copy, each section starting at a multiple of 16 bytes: Triton compiles a kernel
    again for a pointer that is not 16-byte aligned, so a section's alignment must not depend
    on how long the sections before it are this step (a new kernel variant mid-serving)."""
    width = [-(-n // 4) * 4 for n in sizes]
    flat = np.zeros(sum(width), dtype=np.int32)
    src = dst = 0
    for n, w in zip(sizes, width):
        flat[dst : dst + n] = ints[src : src + n]
        src, dst = src + n, dst + w
    parts = to_device(flat, dev).split(width)
    return [t[:n] for t, n in zip(parts, sizes)]


class Pool(Protocol):
    """What a step needs of its :class:`~radixkv.KVCache`: the pools, their shape, backends."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    num_slots: int
    dtype: torch.dtype
    device: torch.device

    def gather_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch tensors of ``rows`` slot rows each for the gathered K and V."""
        ...

    def backend(self, name: str) -> Backend:
        """The pool's backend object ``name`` (made on first use)."""
        ...

    def backend_for(self, decode: bool, batch: int) -> Backend:
        """The backend object serving a decode (or prefill) group of ``batch`` requests."""
        ...

    @property
    def mirror(self) -> Any:
        """The :class:`~radixkv.kv.backends.mirror.DecodeMirror` of the full pool's decode
        groups."""
        ...


class StepLike(Protocol):
    """What a model's forward uses of a step: a planned :class:`Step`, or the
    :class:`~radixkv.kv.static_step.StaticDecodeStep` that CUDA graphs replay. ``input_ids``
    and ``positions`` are ``[T]``, ``last_token_index`` ``[B]`` (the row of each request's last
    token); ``attention`` writes a layer's new K/V and attends (see :meth:`Step.attention`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    last_token_index: torch.Tensor
    num_tokens: int
    is_decode: bool

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, Hq, D]``: each query attended to its request's keys, its own K/V written."""
        ...


class Step:
    """One forward pass planned by :meth:`KVCache.plan`. Tensors are on ``kv.device``.

    int64: ``input_ids``, ``positions``, ``write_slots`` (``[T]``), ``last_token_index`` and
    ``kv_len`` (``[B]``). int32 page tables: ``block_table`` (``[B, max_pages]``, row ``b``
    starts with request ``b``'s ``pages``), ``seq_lens`` (``[B]``), ``qo_indptr`` (``[B+1]``),
    ``paged_kv_indptr`` (``[B+1]``), ``paged_kv_indices``, ``paged_kv_last_page_len`` (``[B]``,
    ``1..page_size``). Python: ``requests``, ``q_len_list``, ``kv_len_list``, ``num_tokens`` (T),
    ``max_q_len``, ``max_kv_len``, ``max_pages``, ``backends`` (the backend name of each group).

    Safety rule: a step is valid until :meth:`KVCache.commit` or until any of its requests is
    extended, committed, finished or aborted; plan a new one after that. ``attention`` and
    ``KVCache.commit`` enforce it: on a stale step they raise :class:`radixkv.StaleStepError`
    and write nothing (a stale step's slots may hold KV published since, or pages handed to
    another request). With a host tier on CUDA,
    ``attention(layer, ...)`` first makes the current stream wait for that layer's tier copies
    (see :meth:`KVCache.plan`): read the pool of a layer only through it, or after
    :meth:`KVCache.apply_copies`.
    """

    # Built on first use (:meth:`_build`).
    input_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    last_token_index: torch.Tensor
    kv_len: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    paged_kv_indices: torch.Tensor
    window_write_slots: torch.Tensor
    window_block_table: torch.Tensor
    backends: list[str]

    def __init__(
        self,
        kv: Pool,
        requests: list[radixkv.Request],
        plan: radixkv.StepPlan,
        copy_events: list[Any] | None = None,
    ) -> None:
        self.kv = kv
        self._plan = plan  # checks, on every use, that the requests are as planned
        # CUDA events, one per layer, of tier copies still running on a side stream: attention
        # of layer l waits for copy_events[l] before it touches the pool (None: nothing to wait).
        self._copy_events = copy_events
        self.requests = requests
        q_start = plan.q_start
        kv_len = plan.kv_len
        b = len(requests)
        self.page_size = kv.page_size
        self.num_tokens = plan.num_tokens
        self.max_q_len = plan.max_q_len
        self.max_kv_len = plan.max_kv_len
        self.max_pages = plan.max_pages
        self.is_decode = self.max_q_len == 1
        q_len = np.ones(b, dtype=np.int64) if self.is_decode else np.diff(q_start)
        self.q_len_list: list[int] = q_len.tolist()
        self.kv_len_list: list[int] = kv_len.tolist()
        self.is_fresh_prefill = b == 1 and self.q_len_list[0] == self.kv_len_list[0]
        self._lens = (q_start, kv_len, q_len)
        self._window_layers = getattr(kv, "window_layers", ())
        # The window layers' groups (a cache with a window group only) and SDPA's groups over
        # the full pool, for layers whose window, softcap or sinks a group's backend does not
        # take: made on the first such layer's call.
        self._window: tuple[Backend, Group] | None = None
        self._sdpa_groups: list[tuple[Backend, Group]] | None = None
        self._kv_slots: torch.Tensor | None = None
        #: Whether the step's device tensors and backend groups are built
        #: (:meth:`_build`: on first use; a CUDA graph's decode step never builds them).
        self.built = False

    #: What :meth:`_build` makes: read one and the step builds them all.
    _BUILT = frozenset(
        {
            "input_ids",
            "positions",
            "write_slots",
            "last_token_index",
            "kv_len",
            "block_table",
            "seq_lens",
            "qo_indptr",
            "paged_kv_indptr",
            "paged_kv_last_page_len",
            "paged_kv_indices",
            "window_write_slots",
            "window_block_table",
            "backends",
            "_groups",
            "_mirror_gen",
        }
    )

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes not set yet: the device tensors, until first used.
        if name in Step._BUILT and not self.__dict__.get("built", True):
            self._build()
            return getattr(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _build(self) -> None:
        """The step's device tensors and each group's backend preparation, made on first use:
        a decode step that a CUDA graph replays reads its plan from fixed buffers
        (:mod:`radixkv.kv.static_step`) and builds none of this. Two host-to-device copies in
        all, pinned and non-blocking on CUDA (:func:`~radixkv.kv.host_copy.to_device`): the
        int64 index arrays, then the int32 page tables, each packed back to back by the plan.
        Attributes set before (the engine's own ``last_token_index``) are kept."""
        self.built = True
        plan, kv = self._plan, self.kv
        dev = kv.device
        t, b = self.num_tokens, len(self.requests)
        made: dict[str, Any] = {}
        views = to_device(plan.longs, dev).split_with_sizes([t, t, t, b, b])
        made["input_ids"], made["positions"], made["write_slots"] = views[0], views[1], views[2]
        made["last_token_index"], made["kv_len"] = views[3], views[4]
        pages = b * self.max_pages
        sizes = [pages, b, b + 1, b + 1, b, len(plan.ints) - pages - 4 * b - 2]
        v32 = _aligned_views(np.asarray(plan.ints), sizes, dev)
        made["block_table"] = v32[0].view(b, self.max_pages)
        made["seq_lens"], made["qo_indptr"], made["paged_kv_indptr"] = v32[1], v32[2], v32[3]
        made["paged_kv_last_page_len"], made["paged_kv_indices"] = v32[4], v32[5]
        if self._window_layers:
            made["window_write_slots"] = to_device(plan.window_write_slots, dev)
            made["window_block_table"] = to_device(plan.window_block_table, dev)
        for name, value in made.items():
            self.__dict__.setdefault(name, value)
        self._groups = self._make_groups(*self._lens, self.block_table)
        # The decode mirror's lanes hold only rows their own plan's step wrote: this step's
        # requests outside its lanes lose theirs now, and all of them do if the mirror is
        # planned again before this step writes the pool (:meth:`attention`).
        mirror = kv.mirror
        for _, g in self._groups:
            if not (isinstance(g.state, dict) and g.state.get("lanes") is not None):
                mirror.forget([self.requests[i] for i in g.req])
        self._mirror_gen = mirror.generation
        self.backends = [backend.name for backend, _ in self._groups]

    def _make_groups(
        self,
        q_start: np.ndarray,
        kv_len: np.ndarray,
        q_len: np.ndarray,
        block_table: torch.Tensor,
        sdpa_only: bool = False,
    ) -> list[tuple[Backend, Group]]:
        """Decode and prefill requests as one group, or two where their backends differ; each
        prepared by its backend (the SDPA backend for every group with ``sdpa_only``)."""
        kv = self.kv
        b = len(q_len)
        if self.is_decode:  # every request decodes (no numpy over q_len)
            decode, n_dec = None, b
        else:
            decode = q_len == 1
            n_dec = int(decode.sum())
        if sdpa_only:
            parts = [(kv.backend("sdpa"), np.arange(b))]
        elif 0 < n_dec < b:
            parts = [
                (kv.backend_for(True, n_dec), np.flatnonzero(decode)),
                (kv.backend_for(False, b - n_dec), np.flatnonzero(~decode)),
            ]
            if parts[0][0] is parts[1][0]:
                parts = [(parts[1][0], np.arange(b))]
        else:
            parts = [(kv.backend_for(n_dec == b, b), np.arange(b))]
        groups = []
        for backend, req in parts:
            if len(req) == b:
                g = Group(
                    req=req,
                    rows=None,
                    q_len=q_len,
                    kv_len=kv_len,
                    q_start=q_start,
                    positions=self.positions,
                    block_table=block_table,
                    seq_lens=self.seq_lens,
                    is_decode=n_dec == b,
                    mirror=not sdpa_only,
                    max_q_len=self.max_q_len,
                    max_kv_len=self.max_kv_len,
                )
            else:
                assert decode is not None  # a group short of the step: not every request decodes
                rows_np = np.concatenate([np.arange(q_start[i], q_start[i + 1]) for i in req])
                rows = to_device(rows_np, kv.device)
                idx = to_device(req, kv.device)
                pages = int(-(-kv_len[req].max() // kv.page_size))
                g = Group(
                    req=req,
                    rows=rows,
                    q_len=q_len[req],
                    kv_len=kv_len[req],
                    q_start=np.concatenate([[0], np.cumsum(q_len[req])]),
                    positions=self.positions.index_select(0, rows),
                    block_table=block_table.index_select(0, idx)[:, :pages],
                    seq_lens=self.seq_lens.index_select(0, idx),
                    is_decode=bool(decode[req].all()),
                    mirror=not sdpa_only,
                )
            backend.prepare(self, g)
            groups.append((backend, g))
        return groups

    @property
    def kv_slots(self) -> torch.Tensor:
        """``[B, max_kv_len]`` int64 slot of every key of each request, padded with slots of
        page 0 (built from ``block_table`` on first use: attention does not need it)."""
        if self._kv_slots is None:
            self._kv_slots = slot_matrix(self.block_table, self.max_kv_len, self.page_size)
        return self._kv_slots

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Writes ``k``/``v`` (``[T, Hkv, D]``) into the pool at the new tokens' slots, then
        attends each query of ``q`` (``[T, Hq, D]``) to its request's keys up to its own
        position. Returns ``[T, Hq, D]`` in ``q``'s dtype.

        ``layer`` must be an int in ``[0, num_layers)``; ``q``, ``k`` and ``v`` floating-point
        torch tensors (``TypeError`` otherwise, raised before anything is written).

        For the layers of models that need them (:mod:`radixkv.kv.windowed`): ``window``, a
        sliding window of that many keys (a query at position ``p`` sees ``p - window < j <=
        p``); ``softcap``, scores squashed to ``softcap * tanh(s / softcap)``; ``sinks``, one
        logit per query head joining each softmax. The pool keeps every token's KV either way.
        """
        kv = self.kv
        self._check_args(layer, q, k, v)
        if window is not None or softcap is not None or sinks is not None:
            _windowed.check_extras(window, softcap, sinks, q.shape[1])
        windowed_pool = layer in self._window_layers
        if windowed_pool and (window is None or window > kv.window):
            raise ValueError(
                f"layer {layer} keeps its KV in the window pool, which holds the last "
                f"{kv.window} keys of each request: pass window= at most {kv.window}, got "
                f"{window!r}"
            )
        if window is not None and self.max_kv_len <= window:
            window = None  # every key is in every query's window: plain causal attention
        self.check_current()
        if not self.built:  # before the mirror's generation is read: building plans its lanes
            self._build()
        if self._copy_events is not None:  # the tier's copies of this layer, on a side stream
            torch.cuda.current_stream(kv.device).wait_event(self._copy_events[layer])
        mirror = kv.mirror
        if not windowed_pool and mirror.generation != self._mirror_gen:
            mirror.forget(self.requests)  # lanes planned since this step: not its own
            self._mirror_gen = mirror.generation
        pool_k, pool_v = kv.k[layer], kv.v[layer]
        slots = self.window_write_slots if windowed_pool else self.write_slots
        if k.dtype != pool_k.dtype or v.dtype != pool_v.dtype:
            k, v = k.to(pool_k.dtype), v.to(pool_v.dtype)
        pool_k.index_copy_(0, slots, k)
        pool_v.index_copy_(0, slots, v)
        out_dtype = q.dtype
        if q.dtype != pool_k.dtype:
            q = q.to(pool_k.dtype)
        if scale is None:
            scale = 1.0 / math.sqrt(kv.head_dim)  # explicit: compiled backends specialise on it
        if windowed_pool:
            return self._attend_window(layer, q, k, v, scale, window, softcap, sinks).to(out_dtype)
        extras = window is not None or softcap is not None or sinks is not None
        if extras:  # each group's backend where it takes them, else SDPA's groups for the layer
            groups = self._groups
            if not all(b.supports(window, softcap, sinks) for b, _ in groups):
                if self._sdpa_groups is None:
                    self._sdpa_groups = self._make_groups(
                        *self._lens, self.block_table, sdpa_only=True
                    )
                groups = self._sdpa_groups
            out = torch.empty_like(q)
            for backend, g in groups:
                rows = g.rows
                if rows is None:
                    o = backend.attend(self, g, layer, q, k, v, scale, window, softcap, sinks)
                    return o.to(out_dtype)
                o = backend.attend(
                    self, g, layer, q[rows], k[rows], v[rows], scale, window, softcap, sinks
                )
                out.index_copy_(0, rows, o)
            return out.to(out_dtype)
        if len(self._groups) == 1 and self._groups[0][1].rows is None:
            backend, g = self._groups[0]
            o = backend.attend(self, g, layer, q, k, v, scale)
            return o if o.dtype == out_dtype else o.to(out_dtype)
        out = torch.empty_like(q)
        for backend, g in self._groups:
            rows = g.rows
            assert rows is not None  # a group that is not the whole step names its rows
            o = backend.attend(self, g, layer, q[rows], k[rows], v[rows], scale)
            out.index_copy_(0, rows, o)
        return out.to(out_dtype)

    def _check_args(self, layer: Any, q: Any, k: Any, v: Any) -> None:
        """The argument checks of :meth:`attention`, each naming the bad value (before anything
        is written)."""
        kv = self.kv
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__} {layer!r}")
        if not 0 <= layer < kv.num_layers:
            raise ValueError(f"layer must be in [0, {kv.num_layers}), got {layer}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if not x.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        t, hkv, d = self.num_tokens, kv.num_kv_heads, kv.head_dim
        if q.dim() != 3 or q.shape[0] != t or q.shape[2] != d or q.shape[1] % hkv != 0:
            raise ValueError(
                f"q must be [T={t}, Hq, D={d}] with Hq a multiple of {hkv}, got {tuple(q.shape)}"
            )
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != (t, hkv, d):
                raise ValueError(f"{name} must be [{t}, {hkv}, {d}], got {tuple(x.shape)}")

    def _attend_window(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """A window layer, its K/V already in the window pool: the Triton kernels (on a pool
        that attends through them) or SDPA over each request's window pages from the first one
        its earliest query reads (see :meth:`_window_group`). ``window`` is ``None`` when every
        key is in every window."""
        if self._window is None:
            self._window = self._window_group()
        backend, g = self._window
        return backend.attend(self, g, layer, q, k, v, scale, window, softcap, sinks)

    def _window_group(self) -> tuple[Backend, Group]:
        """The group of the window layers: each request's window page table from page
        ``lo = max(0, c + 1 - window) // P`` on (``c`` its computed tokens: what its earliest
        query in this step reads first; the pages before are released), its key positions,
        lengths and query positions shifted down by ``lo * P``, so a decode gathers about
        ``window + P`` keys however long the context. The masks SDPA builds from them are the
        same as over the whole table, shifted."""
        q_start, kv_len, q_len = self._lens
        kv, p, dev = self.kv, self.page_size, self.kv.device
        lo = np.maximum(0, kv_len - q_len + 1 - kv.window) // p
        shift = lo * p
        width = max(1, int((-(-(kv_len - shift) // p)).max()))
        cols = torch.arange(width, device=dev)
        lo_t = to_device(lo, dev)
        at = (lo_t[:, None] + cols[None, :]).clamp(max=self.window_block_table.shape[1] - 1)
        table = self.window_block_table.gather(1, at)
        shift_t = to_device(shift, dev)
        per_token = torch.repeat_interleave(shift_t, to_device(q_len, dev))
        g = Group(
            req=np.arange(len(q_len)),
            rows=None,
            q_len=q_len,
            kv_len=kv_len - shift,
            q_start=q_start,
            positions=self.positions - per_token,
            block_table=table,
            seq_lens=self.seq_lens - shift_t.to(self.seq_lens.dtype),
            is_decode=bool((q_len == 1).all()),
        )
        # A backend that reads the window pool through this table as it reads the full pool
        # (Triton's kernels) serves the window layers; every other hands them to SDPA.
        backend = next((b for b, _ in self._groups if b.window_pool), None) or kv.backend("sdpa")
        backend.prepare(self, g)
        return backend, g

    def check_current(self) -> None:
        """Raises :class:`radixkv.StaleStepError`, naming this step and the request, unless every
        request is still as planned (open, same ``num_computed`` and ``num_tokens``)."""
        try:
            self._plan.check_current()
        except radixkv.StaleStepError as e:
            raise radixkv.StaleStepError(f"{self!r} is stale: {e}; plan a new step") from None

    def __repr__(self) -> str:
        return (
            f"Step(requests={len(self.requests)}, tokens={self.num_tokens}, "
            f"max_q_len={self.max_q_len}, max_kv_len={self.max_kv_len}, "
            f"backends={self.backends})"
        )
