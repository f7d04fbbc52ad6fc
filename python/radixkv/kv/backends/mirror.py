"""`DecodeMirror`: the running decode requests' K/V kept contiguous across steps, one lane each.

The SDPA backend reads a request's keys from the pool through a gather, so every decode step
copies every key of every request once per layer: on the CPU that costs as much as the
attention itself (``benches/bench_torch.py`` (d), 32 requests of 1k tokens: 11.5 ms gather
against 9.6 ms SDPA a step). A request decoding step after step adds one key per layer per step.
The mirror keeps each such request's keys in a *lane* of head-major buffers, the layout of a
static cache, and copies in only what a lane lacks: the new token's row, or once the rows a
request had when it started decoding::

    k[layer]:  [lanes, num_kv_heads, capacity, head_dim]   lane i: one request's keys 0..len
    lens[layer, lane]: rows of the lane that hold its request's KV (a step's new rows are
                       entered once, when the mirror is next planned or changed: _settle)

Exact: a lane holds copies of pool rows, so attention over it is attention over the gather, bit
for bit. A lane's rows are copied only when final or rewritten by the step that owns them:

- a row below the request's ``num_computed`` is committed, and a live request's pages never
  change (DESIGN: the page table is append-only), so its copy stays valid;
- the new row of a decode step is written into the lane and the pool together, so the two
  agree on every row a lane holds whether or not that step is committed (a row computed again
  is written again). Every other write of a request's rows into the pool drops or shortens
  its lane first: a step whose groups have no lanes for the request (a prefill group, another
  backend) drops them when planned; a step planned before the newest mirrored plan drops its
  requests' lanes when it writes (:meth:`forget`, from ``Step.attention``); a layer the lanes
  do not serve (a sliding window over the full pool) shortens them below the new row
  (:meth:`bypass`).

A lane belongs to a request object (held by a weak reference: a dropped request is still
aborted when collected), and lasts only across consecutive decode groups that hold it: a
request absent from the newest mirrored decode group loses its lane. Lanes are kept packed in
``[0, B)`` (a lane past the group's size moves into a free one below), so attention runs over
the first ``B`` lanes with the queries permuted into lane order. A step planned before the
newest mirrored one (its lanes may have moved since) falls back to the gather.

Memory: ``lanes * capacity`` token rows per mirrored layer for K and for V, at most
``max_tokens`` (``KVCache(decode_mirror=...)``); a decode group that would need more runs
through the gather, and the mirror is emptied. The CPU default, ``num_slots``, lets the lanes
grow as large as the pool (at most twice the full layers' KV memory, held while requests
decode; ``KVCache.mirror.nbytes`` tells). Buffers start zeroed: a lane's rows past its
request's keys are masked, and must be finite numbers for the mask to hide them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixkv.kv.backends.group import slot_matrix

#: Capacities grow in steps of this many rows (and by a quarter at least), so a request
#: decoding one token a step regrows its buffers rarely.
CAPACITY_STEP = 256
#: Steady decode steps whose lane rows are made at once (``Lanes.rows_ahead``): each step then
#: takes its row indices as a view, one call instead of an addition.
ROWS_AHEAD = 32


@dataclass
class Lanes:
    """The mirror's plan for one decode group: ``lane_of[i]``, the lane of the group's request
    ``i``; ``need[i]``, the rows its lane must hold before the step's new row (``kv_len - 1``);
    ``order``, the group index of each lane ``0..B`` (``None`` when lane ``i`` is request
    ``i``); ``mask``, the additive ``[B, 1, 1, max_kv_len]`` mask in lane order (``None`` when
    every request has as many keys); ``full[layer]``, whether no lane of the group lacks rows
    in that layer (cleared by :meth:`DecodeMirror.bypass`, set once a layer's rows are in);
    ``done[layer]``, whether the step wrote its new rows into that layer's lanes (so the next
    plan of the same group, one token further, finds every lane full there)."""

    generation: int
    lane_of: np.ndarray
    need: np.ndarray
    need1: np.ndarray  # need + 1: the rows a lane holds once the step wrote its new row
    max_kv_len: int
    lane_index: torch.Tensor | None  # [B] int64: lane_of on the device (with ``order``)
    row_index: torch.Tensor  # [B * Hkv] int64: the new rows in a flat view of a buffer
    #: ``[ROWS_AHEAD, B * Hkv]``: ``row_index`` of this plan and the steady ones after it (row
    #: ``ahead`` is this one's).
    rows_ahead: torch.Tensor
    ahead: int
    order: torch.Tensor | None
    mask: torch.Tensor | None
    full: np.ndarray  # [num_layers] bool: every lane of the group holds its ``need`` rows
    done: list[bool]  # [num_layers]: the step's new rows written into the layer's lanes
    kv_list: list[int] | None = None  # need1 as a list, when the plan was given one
    settled: bool = False  # ``lens`` holds what the step wrote (see DecodeMirror._settle)


class DecodeMirror:
    """Lanes of one :class:`~radixkv.KVCache`'s full-pool layers (see the module docstring).

    ``max_tokens``: most ``lanes * capacity`` rows a layer's buffers may hold (0: off)."""

    def __init__(self, kv: Any, max_tokens: int) -> None:
        self.kv = kv
        self.max_tokens = max_tokens
        self.generation = 0
        self.lanes = 0
        self.capacity = 0
        self.k: list[torch.Tensor | None] = [None] * kv.num_layers
        self.v: list[torch.Tensor | None] = [None] * kv.num_layers
        #: ``k``/``v`` as ``[lanes * Hkv * capacity, D]`` views (one index_copy_ writes a row
        #: into every lane of a layer).
        self._flat: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * kv.num_layers
        self.lens = np.zeros((kv.num_layers, 0), dtype=np.int64)
        #: Per lane: ``(id(request), weak reference)`` of its request, or None when free.
        self._refs: list[tuple[int, weakref.ReferenceType[Any]] | None] = []
        self._lane: dict[int, int] = {}  # id(request) -> lane (checked against _refs)
        #: The newest plan (its group's lanes and generation).
        self._last: Lanes | None = None
        #: ``Lanes.done`` of a new plan: True for the layers the lanes never serve (those of
        #: the window pool), which no step writes into lanes.
        window = set(getattr(kv, "window_layers", ()))
        self._done0 = [layer in window for layer in range(kv.num_layers)]
        self._full_layers = [layer for layer in range(kv.num_layers) if layer not in window]

    @property
    def nbytes(self) -> int:
        """Bytes the lanes' buffers hold now."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def _settle(self) -> None:
        """Enters into ``lens`` the rows the newest plan's step wrote into its lanes (each
        layer's :meth:`keys` only marks its layer done): before anything reads or changes
        ``lens`` outside that step's own layers. Once per plan."""
        last = self._last
        if last is None or last.settled:
            return
        last.settled = True
        if last.generation != self.generation:  # lanes freed or moved since: nothing to enter
            return
        done = last.done
        rows = [layer for layer in self._full_layers if done[layer]]
        if not rows:
            return
        lane_of = last.lane_of if last.order is not None else slice(0, len(last.lane_of))
        if len(rows) == self.kv.num_layers:
            self.lens[:, lane_of] = last.need1
        else:
            for layer in rows:
                self.lens[layer, lane_of] = last.need1

    def clear(self) -> None:
        """Drops every lane and frees the buffers."""
        self.k = [None] * self.kv.num_layers
        self.v = [None] * self.kv.num_layers
        self._flat = [None] * self.kv.num_layers
        self.lanes = self.capacity = 0
        self.lens = np.zeros((self.kv.num_layers, 0), dtype=np.int64)
        self._refs = []
        self._lane = {}
        self._last = None
        self.generation += 1

    def _find(self, req: Any) -> int:
        lane = self._lane.get(id(req), -1)
        if lane >= 0:
            entry = self._refs[lane] if lane < len(self._refs) else None
            if entry is None or entry[1]() is not req:
                return -1
        return lane

    def _free(self, lane: int) -> None:
        entry = self._refs[lane]
        if entry is not None and self._lane.get(entry[0]) == lane:
            del self._lane[entry[0]]
        self._refs[lane] = None
        self.lens[:, lane] = 0

    def forget(self, requests: Any) -> None:
        """Drops the lanes of ``requests`` (a step computes them outside the mirror)."""
        if not self._lane:
            return
        self._settle()
        freed = False
        for req in requests:
            lane = self._find(req)
            if lane >= 0:
                self._free(lane)
                freed = True
        if freed:  # a step planned before this one must not write into the freed lanes
            self.generation += 1

    def plan(
        self,
        requests: list[Any],
        kv_len: np.ndarray,
        max_kv: int | None = None,
        kv_list: list[int] | None = None,
    ) -> Lanes | None:
        """Lanes for a decode group of ``requests`` with ``kv_len`` keys each (the new one
        included; ``max_kv``: their most, ``kv_list``: ``kv_len`` as a list, when known), packed
        into ``[0, B)``; ``None`` (mirror emptied) when they would not fit in ``max_tokens``.
        Requests holding a lane keep it; the others' lanes are freed."""
        self._settle()
        b = len(requests)
        if max_kv is None:
            max_kv = int(kv_len.max())
        lanes = max(self.lanes, 1 << (b - 1).bit_length())
        capacity = self.capacity
        if max_kv > capacity:
            capacity = max(max_kv + max_kv // 4, capacity + CAPACITY_STEP)
            capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
        if lanes * capacity > self.max_tokens:  # fewer spare lanes, then fewer spare rows
            lanes = 1 << (b - 1).bit_length()
            capacity = min(capacity, self.max_tokens // lanes)
            if capacity < max_kv:
                if self.lanes:
                    self.clear()
                return None
        if lanes != self.lanes or capacity != self.capacity:
            self._regrow(lanes, capacity)
        last = self._last
        again = last is not None and last.generation == self.generation and len(last.lane_of) == b
        if again:
            assert last is not None
            refs = self._refs
            for lane, r in zip(last.lane_of.tolist(), requests):
                entry = refs[lane]
                if entry is None or entry[1]() is not r:
                    again = False
                    break
            # else: the newest plan's group again, nothing freed or moved since: same lanes
        if again:
            assert last is not None
            self.generation += 1
            lanes = self._next(last, kv_len, max_kv, kv_list)
        else:
            lane_of = self._pack(requests)
            self.generation += 1
            lanes = self._lanes(lane_of, kv_len, max_kv, kv_list)
        self._last = lanes
        return lanes

    def _next(
        self, last: Lanes, kv_len: np.ndarray, max_kv: int, kv_list: list[int] | None
    ) -> Lanes:
        """The plan of the newest plan's group again, in the same lanes: when every request is
        one token further and that step wrote every layer's lanes (a decode loop's steady
        state), what the last plan computed is shifted by one row instead of computed again
        (after a forward pass each numpy or torch call runs cold: the fewer, the better)."""
        steady = all(last.done) and max_kv == last.max_kv_len + 1
        if steady:
            if kv_list is not None and last.kv_list is not None:
                steady = kv_list == [n + 1 for n in last.kv_list]
            else:
                steady = bool((kv_len == last.need1 + 1).all())
        if not steady:
            return self._lanes(last.lane_of, kv_len, max_kv, kv_list)
        # Lengths all equal stay equal one token further; unequal ones need the mask anew.
        mask = None if last.mask is None else self._mask(last.lane_of, kv_len, max_kv)
        ahead = last.ahead + 1
        rows_ahead = last.rows_ahead
        if ahead == ROWS_AHEAD:
            rows_ahead = _ahead(last.row_index + 1)
            ahead = 0
        return Lanes(
            generation=self.generation,
            lane_of=last.lane_of,
            need=last.need1,  # each request's keys before the step: the last step's, plus one
            need1=kv_len,
            max_kv_len=max_kv,
            lane_index=last.lane_index,
            # The row below each lane's new one, one further: the next of the rows made ahead.
            row_index=rows_ahead[ahead],
            rows_ahead=rows_ahead,
            ahead=ahead,
            order=last.order,
            mask=mask,
            # Every layer got the last step's rows: every entry of last.full is True, and the
            # last plan is stale (its keys() and bypass() do nothing), so the array is shared.
            full=last.full,
            done=list(self._done0),
            kv_list=kv_list,
        )

    def _pack(self, requests: list[Any]) -> np.ndarray:
        """The lane of each of ``requests``, packed into ``[0, B)``: lanes held are kept (or
        moved below ``B``), the others' lanes freed, new requests given free ones."""
        b = len(requests)
        lane_of = np.array([self._find(r) for r in requests], dtype=np.int64)
        held = set(lane_of[lane_of >= 0].tolist())
        if len(held) < int((lane_of >= 0).sum()):  # one request named twice: plan_step refuses
            raise ValueError("a decode group names one request twice")
        for lane in range(self.lanes):
            if self._refs[lane] is not None and lane not in held:
                self._free(lane)
        free = [lane for lane in range(b) if self._refs[lane] is None]
        for i in np.flatnonzero((lane_of >= b) | (lane_of < 0)).tolist():
            lane = free.pop(0)
            old = int(lane_of[i])
            if old >= 0:
                self._move(old, lane)
            else:
                self.lens[:, lane] = 0
            self._refs[lane] = (id(requests[i]), weakref.ref(requests[i]))
            self._lane[id(requests[i])] = lane
            lane_of[i] = lane
        return lane_of

    def _lanes(
        self, lane_of: np.ndarray, kv_len: np.ndarray, max_kv: int, kv_list: list[int] | None
    ) -> Lanes:
        """The plan of a group whose requests hold lanes ``lane_of``."""
        b = len(lane_of)
        dev = self.kv.device
        kv_len = kv_len.astype(np.int64, copy=False)
        need = kv_len - 1
        identity = bool((lane_of == np.arange(b)).all())
        order = lane_index = None
        if not identity:
            inv = np.empty(b, dtype=np.int64)
            inv[lane_of] = np.arange(b)
            pair = torch.from_numpy(np.concatenate([inv, lane_of])).to(dev)
            order, lane_index = pair[:b], pair[b:]
        mask = None if int(kv_len.min()) == max_kv else self._mask(lane_of, kv_len, max_kv)
        # Row (lane, head, need) of a [lanes * Hkv * capacity, D] view: one index_copy_ writes
        # every new row of a layer.
        hkv = self.kv.num_kv_heads
        rows = (lane_of[:, None] * hkv + np.arange(hkv)) * self.capacity + need[:, None]
        rows_ahead = _ahead(torch.from_numpy(rows.reshape(-1)).to(dev))
        return Lanes(
            generation=self.generation,
            lane_of=lane_of,
            need=need,
            need1=kv_len,
            max_kv_len=max_kv,
            lane_index=lane_index,
            row_index=rows_ahead[0],
            rows_ahead=rows_ahead,
            ahead=0,
            order=order,
            mask=mask,
            full=(self.lens[:, lane_of] >= need).all(axis=1),
            done=list(self._done0),
            kv_list=kv_list,
        )

    def _mask(self, lane_of: np.ndarray, kv_len: np.ndarray, max_kv: int) -> torch.Tensor:
        """The additive ``[B, 1, 1, max_kv]`` mask of a group with ``kv_len`` keys each, in lane
        order (``lane_of``)."""
        b = len(lane_of)
        lane_kv_len = np.empty(b, dtype=np.int64)
        lane_kv_len[lane_of] = kv_len
        keys = torch.arange(max_kv)
        lens = torch.from_numpy(lane_kv_len)
        allowed = (keys[None, :] < lens[:, None]).view(b, 1, 1, max_kv)
        bias = torch.zeros(allowed.shape, dtype=self.kv.dtype)
        return bias.masked_fill_(~allowed, float("-inf")).to(self.kv.device)

    def _buffer(self, lanes: int, capacity: int) -> torch.Tensor:
        """A zeroed ``[lanes, Hkv, capacity, D]`` buffer (a lane's masked rows must be finite),
        a normal tensor even when made under ``torch.inference_mode`` (an inference tensor
        could not be written by a later step run outside it)."""
        kv = self.kv
        shape = (lanes, kv.num_kv_heads, capacity, kv.head_dim)
        with torch.inference_mode(False):
            return torch.zeros(shape, dtype=kv.dtype, device=kv.device)

    def _regrow(self, lanes: int, capacity: int) -> None:
        """New buffers of ``lanes x capacity`` rows, the held rows copied over."""
        kv = self.kv
        keep = min(lanes, self.lanes)
        rows = min(capacity, self.capacity)
        for pools in (self.k, self.v):
            for layer, old in enumerate(pools):
                if old is None:
                    continue
                new = self._buffer(lanes, capacity)
                if keep and rows:
                    new[:keep, :, :rows] = old[:keep, :, :rows]
                pools[layer] = new
        self._flat = [_flat_pair(k, v) for k, v in zip(self.k, self.v)]
        for lane in range(lanes, self.lanes):
            self._free(lane)
        lens = np.zeros((kv.num_layers, lanes), dtype=np.int64)
        lens[:, :keep] = np.minimum(self.lens[:, :keep], capacity)
        self.lens = lens
        self._refs = self._refs[:keep] + [None] * (lanes - keep)
        self.lanes, self.capacity = lanes, capacity
        self._last = None

    def _move(self, src: int, dst: int) -> None:
        """Lane ``src``'s rows, request and lengths into the free lane ``dst``."""
        for layer in range(self.kv.num_layers):
            n = int(self.lens[layer, src])
            if n:
                for pools in (self.k, self.v):
                    buf = pools[layer]
                    assert buf is not None  # a layer with rows has buffers
                    buf[dst, :, :n] = buf[src, :, :n]
        self.lens[:, dst] = self.lens[:, src]
        entry = self._refs[src]
        self._refs[src] = None
        self.lens[:, src] = 0
        self._refs[dst] = entry
        if entry is not None:
            self._lane[entry[0]] = dst

    def bypass(self, lanes: Lanes, layer: int) -> None:
        """The step of ``lanes`` wrote layer ``layer``'s new rows into the pool only (a layer
        whose window the lanes do not serve): its lanes no longer hold them."""
        if lanes.generation == self.generation:
            lens = self.lens[layer]
            lens[lanes.lane_of] = np.minimum(lens[lanes.lane_of], lanes.need)
            lanes.full[layer] = False
            lanes.done[layer] = False

    def keys(
        self,
        lanes: Lanes,
        layer: int,
        block_table: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s keys and values of the group, ``[B, Hkv, max_kv_len, D]`` views of
        the first ``B`` lanes (lane order), after copying in the rows the lanes lack from the
        pool (``block_table``: the group's page tables, group order) and the step's new rows
        ``k_new``/``v_new`` (``[B, Hkv, D]``, group order, already in the pool). ``None`` for a
        plan older than the newest (lanes may have moved): gather instead."""
        if lanes.generation != self.generation:
            return None
        bk, bv = self.k[layer], self.v[layer]
        if bk is None or bv is None:
            bk = self.k[layer] = self._buffer(self.lanes, self.capacity)
            bv = self.v[layer] = self._buffer(self.lanes, self.capacity)
            self._flat[layer] = _flat_pair(bk, bv)
        flat = self._flat[layer]
        assert flat is not None  # kept beside every layer's buffers (_regrow, here)
        if not lanes.full[layer]:
            have = self.lens[layer, lanes.lane_of]
            short = np.flatnonzero(have < lanes.need)
            if len(short):
                self._fill(layer, lanes, short, have, block_table)
            lanes.full[layer] = True
        d = k_new.shape[-1]
        flat[0].index_copy_(0, lanes.row_index, k_new.reshape(-1, d))
        flat[1].index_copy_(0, lanes.row_index, v_new.reshape(-1, d))
        lanes.done[layer] = True  # lens: entered by _settle
        b, n = len(lanes.lane_of), lanes.max_kv_len
        if b < bk.shape[0]:
            return bk[:b, :, :n], bv[:b, :, :n]
        return bk.narrow(2, 0, n), bv.narrow(2, 0, n)

    def _fill(
        self,
        layer: int,
        lanes: Lanes,
        short: np.ndarray,
        have: np.ndarray,
        block_table: torch.Tensor,
    ) -> None:
        """Copies rows ``have[i]..need[i]`` of each request ``i`` in ``short`` from the pool."""
        kv = self.kv
        bk, bv = self.k[layer], self.v[layer]
        assert bk is not None and bv is not None
        pool_k, pool_v = kv.k[layer], kv.v[layer]
        for i in short.tolist():
            lo, hi = int(have[i]), int(lanes.need[i])
            slots = slot_matrix(block_table[i : i + 1], hi, kv.page_size)[0, lo:]
            lane = int(lanes.lane_of[i])
            bk[lane, :, lo:hi] = pool_k.index_select(0, slots).transpose(0, 1)
            bv[lane, :, lo:hi] = pool_v.index_select(0, slots).transpose(0, 1)


def _flat_pair(
    k: torch.Tensor | None, v: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``[lanes * Hkv * capacity, D]`` views of a layer's K and V lanes (None without them)."""
    if k is None or v is None:
        return None
    return k.view(-1, k.shape[-1]), v.view(-1, v.shape[-1])


def _ahead(row_index: torch.Tensor) -> torch.Tensor:
    """``[ROWS_AHEAD, n]``: ``row_index`` and the rows of the steady steps after it (one
    further each)."""
    steps = torch.arange(ROWS_AHEAD, dtype=row_index.dtype, device=row_index.device)
    return row_index[None, :] + steps[:, None]
