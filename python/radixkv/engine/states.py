"""`EngineStates`: a hybrid model's recurrent states in the engine: one working slot per running
request, the snapshots the index hands out (``state_slots``), and when each is copied.

A recurrent layer folds the whole prefix into one state that cannot be cut back, so a request
runs on a *working* slot of its own, and a prefix hit is only as good as the *snapshot* the
index found for it (see docs/SEMANTICS.md, "State slots"):

```text
  admitted with a hit   snapshot[req.state_slot] -> working[w], then release_state(req)
  admitted, no hit      working[w] = 0 (the state before any token)
  a step                the model reads and writes working[w]; a capture at pos inside the
                        chunk writes the state there into the snapshot take_state gave
  prompt end, junction  captured during the forward that computes that position
  finish, preemption    take_state(req, num_computed), working[w] -> that snapshot
```

Captures are planned before the forward (:meth:`EngineStates.plan`): the position where the
prompt ends; for a branch context, one token before it too (a branch with an empty suffix can
hit at most all of its prompt but the last token); and a *junction*: where a request's KV match
ran past the snapshot it hit (``req.kv_matched > num_cached``), so the next request sharing
that prefix hits all of it. Positions are floored to a page (token-exact at ``page_size=1``);
a request that ends off a page boundary takes no snapshot at its end.

A snapshot the index gives out is pending until the request's next ``commit`` or ``finish``,
and freed by an ``abort``: a failed step never leaves a half-written snapshot to be found.

Under tensor parallelism (``Engine(group=...)``) every rank keeps pools shaped from its own
modules (``model.state_specs``): transformers' plans keep each family's recurrent modules whole
on every rank (Qwen3.5's and Qwen3-Next's projections gather their outputs; the Mamba, Mamba2
and short-convolution modules are not in the plans), so each rank holds every layer's whole
state. Every decision here (working slots, captures, restores, snapshots taken) follows from the
index's, which the ranks make alike; the step check compares :meth:`EngineStates.digest` with
the cache's state digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import radixkv
from radixkv.kv.state_pool import StatePool, StateSpec, snapshot_pool


@dataclass
class RowStates:
    """What one row (request) of a step does with states: its working ``slot``, the tokens
    before its chunk (``start``), and ``captures``: ``(pos, snapshot slot)`` with
    ``start < pos <= end``, in order."""

    slot: int
    start: int
    end: int
    captures: list[tuple[int, int]] = field(default_factory=list)


class EngineStates:
    """The working and snapshot pools of a hybrid model over ``cache`` (made with
    ``state_slots > 0``), and the engine's side of the index's state slots. ``working``
    grows as requests run (it starts with ``working_slots``); ``snapshot_dtype`` holds the
    snapshots in a narrower dtype (``None``: the states' own)."""

    def __init__(
        self,
        specs: Seq[StateSpec],
        cache: radixkv.Cache,
        working_slots: int,
        device: torch.device | str = "cpu",
        snapshot_dtype: torch.dtype | None = None,
        snapshots: StatePool | None = None,
    ) -> None:
        n = cache.stats.state_slots
        if n < 1:
            raise ValueError("the cache has no state slots (make it with state_slots=N)")
        self.cache = cache
        self.page_size = cache.stats.page_size
        self.specs = tuple(specs)
        self.device = torch.device(device)
        self.working = StatePool(self.specs, working_slots, self.device)
        #: The snapshots: ``snapshots`` when given (the pool of a KVCache shared with a
        #: PrefixCache, :func:`radixkv.kv.state_pool.snapshot_pool`), else a pool of their own.
        self.snapshots = (
            snapshots
            if snapshots is not None
            else StatePool(self.specs, n, self.device, dtype=snapshot_dtype)
        )
        self._free = list(range(working_slots - 1, -1, -1))
        #: Working slot of each running request, by sequence id.
        self.slot: dict[int, int] = {}
        #: Positions each running request still wants a snapshot at, by sequence id.
        self._wanted: dict[int, list[int]] = {}
        #: The rows of the step being computed (set by :meth:`plan`, read by the model).
        self.rows: list[RowStates] = []
        #: Snapshots restored into a working slot, and taken, by this engine.
        self.restored = 0
        self.taken = 0
        #: The engine's :class:`radixkv.engine.engine.EngineStats` (its ``state_*`` counters
        #: are kept here), or None.
        self.stats: Any = None
        self._evicted_before = cache.stats.evicted_states

    def describe(self) -> str:
        """One line: how many snapshots the cache holds and their size."""
        b = self.snapshots.bytes_per_slot
        return (
            f"{self.snapshots.n_slots} state snapshots of {b / 2**20:.3g} MiB "
            f"({self.snapshots.nbytes / 2**20:.3g} MiB in all, "
            f"{self.snapshots.tensor(self.specs[0].layer, self.specs[0].name).dtype})"
        )

    # ---- a request's life -------------------------------------------------------------------

    def start(self, seq_id: int, req: radixkv.Request, prompt_len: int, context: bool) -> None:
        """``req`` was admitted for sequence ``seq_id``: gives it a working slot holding the
        state at ``req.num_computed`` (the snapshot it hit, copied, then released; or zeros),
        and records where it wants snapshots (see the module doc)."""
        w = self._alloc()
        self.slot[seq_id] = w
        snap = req.state_slot
        if snap is not None:
            self.snapshots.copy(snap, w, into=self.working)
            self.cache.release_state(req)
            self.restored += 1
            if self.stats is not None:
                self.stats.state_restored += 1
                self.stats.state_hit_tokens += req.num_cached
        else:
            self.working.zero(w)
        p = self.page_size
        wanted = {prompt_len // p * p}
        if context:
            wanted.add((prompt_len - 1) // p * p)
        if req.kv_matched > req.num_cached:
            wanted.add(req.kv_matched // p * p)
        self._wanted[seq_id] = sorted(x for x in wanted if x > req.num_computed)

    def plan(self, seqs: Seq[tuple[int, radixkv.Request, int, int]]) -> list[RowStates]:
        """The rows of a step of ``(seq id, request, num_computed, num_tokens)``: working slots
        and the snapshots (``take_state``) captured inside each chunk. Sets :attr:`rows`."""
        rows = []
        for seq_id, req, start, end in seqs:
            row = RowStates(self.slot[seq_id], start, end)
            wanted = self._wanted.get(seq_id)
            while wanted and wanted[0] <= end:
                pos = wanted.pop(0)
                if pos <= start:
                    continue
                snap = self.cache.take_state(req, pos)
                if snap is not None:
                    row.captures.append((pos, snap))
                    self._took()
            rows.append(row)
        self.rows = rows
        return rows

    def snapshot(self, seq_id: int, req: radixkv.Request, num_computed: int) -> bool:
        """Before ``req`` is finished (or given back, then committed): a snapshot of its
        working state at ``num_computed`` when that is a page boundary and the index has none
        there; returns whether one was taken."""
        w = self.slot.get(seq_id)
        if w is None or num_computed < 1 or num_computed % self.page_size:
            return False
        snap = self.cache.take_state(req, num_computed)
        if snap is None:
            return False
        self.working.copy(w, snap, into=self.snapshots)
        self._took()
        return True

    def _took(self) -> None:
        self.taken += 1
        if self.stats is not None:
            self.stats.state_taken += 1

    def count_evicted(self) -> None:
        """Sets the engine stats' ``state_evicted``: the snapshots the cache evicted since this
        engine started (after each step: evictions happen inside the cache)."""
        if self.stats is not None:
            self.stats.state_evicted = self.cache.stats.evicted_states - self._evicted_before

    def digest(self) -> int:
        """A 64-bit digest of this engine's side of the states: each running request's working
        slot and the positions it still wants snapshots at, the working pool's size, and how
        many snapshots were restored and taken. Tensor-parallel ranks that made the same
        decisions have equal digests (the step check compares it with the cache's
        ``state_digest()``, which covers the index's state slots)."""
        words = [self.working.n_slots, self.restored, self.taken, len(self.slot)]
        for seq_id in sorted(self.slot):
            wanted = self._wanted.get(seq_id, [])
            words += [seq_id, self.slot[seq_id], len(wanted), *wanted]
        raw = np.asarray(words, dtype=np.int64).tobytes()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")

    def free(self, seq_id: int) -> None:
        """Sequence ``seq_id`` no longer runs: its working slot is free."""
        w = self.slot.pop(seq_id, None)
        self._wanted.pop(seq_id, None)
        if w is not None:
            self._free.append(w)

    def _alloc(self) -> int:
        if not self._free:  # more running requests than slots: double the pool
            old = self.working
            grown = StatePool(self.specs, old.n_slots * 2, self.device)
            idx = list(range(old.n_slots))
            old.copy(idx, idx, into=grown)
            self.working = grown
            self._free = list(range(grown.n_slots - 1, old.n_slots - 1, -1))
        return self._free.pop()


def engine_states(
    model: torch.nn.Module,
    kv: object,
    max_batch: int,
    speculative: object,
    cuda_graphs: object,
) -> EngineStates | None:
    """The :class:`EngineStates` of an engine over ``model`` when the model keeps recurrent
    state (``model.state_specs``, as :class:`radixkv.hf.HFCausalLM` of a hybrid model has),
    else None; ``ValueError`` naming what is not built for a hybrid model."""
    specs = tuple(getattr(model, "state_specs", ()) or ())
    if not specs:
        return None
    name = type(getattr(model, "model", model)).__name__
    cache = kv.cache  # type: ignore[attr-defined]
    refused = [
        (
            speculative is not None,
            "speculative decoding (drafts would advance the recurrent "
            "state before they are verified): pass speculative=None",
        ),
        (
            bool(cuda_graphs),
            "CUDA graphs (hybrid models run eager: the decode step's state "
            "update is not captured): pass cuda_graphs=None or False",
        ),
        (
            getattr(kv, "shared", None) is not None,
            "a shared tier (its pages travel without the recurrent-state snapshots a hit "
            "needs, so no replica could hit them): leave shared_store= out",
        ),
        (
            bool(cache.window),
            "a cache with a window group (the core keeps no snapshots beside "
            "one): make the cache without window=",
        ),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"{name} is a hybrid model: radixkv does not serve it with {what}")
    if cache.stats.state_slots < 1:
        raise ValueError(
            f"{name} is a hybrid model: its cache must be made with state_slots=N, the "
            "snapshots of its recurrent state a prefix hit restores"
        )
    dtype = getattr(model, "snapshot_dtype", None)
    return EngineStates(
        specs,
        cache,
        max_batch,
        kv.device,  # type: ignore[attr-defined]
        dtype,
        snapshot_pool(kv, specs, dtype),
    )
