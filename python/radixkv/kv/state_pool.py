"""`StatePool`: the recurrent states of a hybrid model's layers, ``n_slots`` of each, on the
device, owned by radixkv.

A recurrent layer (Gated DeltaNet, Mamba, Mamba2, a short convolution) folds the whole prefix into
fixed-size tensors: the last ``kernel - 1`` (or ``kernel``) inputs of its causal convolution, and,
for most families, a state matrix. A *slot* holds every recurrent layer's tensors at one token
position of one sequence: a running request's own state, or a snapshot a prefix hit restores.

```text
  tensor(layer, "conv"):       [n_slots, *conv shape]        (one pool tensor per state)
  tensor(layer, "recurrent"):  [n_slots, *recurrent shape]
           row s of every tensor = slot s
```

A hit restores by copy (:meth:`StatePool.copy`, copy-on-write): the request runs on its own slot
and the snapshot is never written through it. Snapshots may live in a second pool of a narrower
dtype (``dtype=torch.bfloat16`` halves fp32 states); :meth:`copy` with ``into=`` converts.

The pool knows nothing of models: :mod:`radixkv.hf._hybrid` says which states a model keeps.
The snapshots of one KV cache's state slots live in one pool whoever takes them (an engine, a
``PrefixCache``, or both sharing the KV cache): :func:`snapshot_pool`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: Element types a state may be held in.
STATE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one layer: ``name`` (``"conv"`` or ``"recurrent"``), its ``shape``
    for one sequence (no batch dimension), and the dtype the model keeps it in."""

    layer: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Elements of one sequence's tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


Slots = int | Sequence[int] | torch.Tensor


class StatePool:
    """``n_slots`` slots of every state in ``specs``, zero-filled, on ``device``.

    ``dtype``: hold every state in this dtype instead of each spec's own (a snapshot pool in
    ``torch.bfloat16`` for fp32 states); ``None`` keeps each spec's dtype.
    """

    def __init__(
        self,
        specs: Iterable[StateSpec],
        n_slots: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
    ) -> None:
        specs = tuple(specs)
        if not specs:
            raise ValueError("specs must name at least one state (a model with no recurrent layer)")
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"n_slots must be a positive int, got {n_slots!r}")
        if dtype is not None and dtype not in STATE_DTYPES:
            raise ValueError(f"dtype must be one of {STATE_DTYPES} or None, got {dtype!r}")
        keys = [(s.layer, s.name) for s in specs]
        if len(set(keys)) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ValueError(f"specs name the state {dup} twice")
        for s in specs:
            if s.dtype not in STATE_DTYPES:
                raise ValueError(f"state {(s.layer, s.name)} has dtype {s.dtype}, not a float")
            if not s.shape or any(not isinstance(d, int) or d < 1 for d in s.shape):
                raise ValueError(f"state {(s.layer, s.name)} has shape {s.shape!r}")
        self.specs = specs
        self.n_slots = n_slots
        self.device = torch.device(device)
        self._tensors = {
            (s.layer, s.name): torch.zeros(
                (n_slots, *s.shape), dtype=dtype or s.dtype, device=self.device
            )
            for s in specs
        }

    def tensor(self, layer: int, name: str) -> torch.Tensor:
        """The pool tensor ``[n_slots, *shape]`` of ``layer``'s state ``name``."""
        try:
            return self._tensors[(layer, name)]
        except KeyError:
            raise KeyError(
                f"no state {name!r} for layer {layer} (the pool holds {list(self._tensors)})"
            ) from None

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot: every state of every layer."""
        return sum(t[0].numel() * t.element_size() for t in self._tensors.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.bytes_per_slot * self.n_slots

    def slots(self, slots: Slots) -> torch.Tensor:
        """``slots`` as a 1-D int64 tensor on the pool's device; ``IndexError`` naming the first
        slot outside ``0 <= s < n_slots``."""
        if isinstance(slots, torch.Tensor):
            if slots.dtype.is_floating_point or slots.dtype == torch.bool or slots.dim() > 1:
                raise ValueError(f"slots must be a 1-D integer tensor, got {slots.dtype} {slots}")
            idx = slots.reshape(-1).to(torch.int64)
        elif isinstance(slots, bool):
            raise ValueError(f"slots must be ints, got {slots!r}")
        elif isinstance(slots, int):
            idx = torch.tensor([slots], dtype=torch.int64)
        else:
            values = list(slots)
            bad = [s for s in values if isinstance(s, bool) or not isinstance(s, int)]
            if bad:
                raise ValueError(f"slots must be ints, got {bad[0]!r}")
            idx = torch.tensor(values, dtype=torch.int64)
        out = (idx < 0) | (idx >= self.n_slots)
        if bool(out.any()):
            raise IndexError(f"slot {int(idx[out][0])} is outside the pool's {self.n_slots} slots")
        return idx.to(self.device)

    def zero(self, slots: Slots) -> None:
        """Resets ``slots`` to the state before any token (what a request with no cached prefix
        starts from)."""
        idx = self.slots(slots)
        for t in self._tensors.values():
            t.index_fill_(0, idx, 0)

    def copy(self, src: Slots, dst: Slots, into: StatePool | None = None) -> None:
        """Copies every state of slots ``src`` to slots ``dst`` (pairwise), of this pool or of
        ``into``, a pool of the same specs (its dtype may differ: the copy converts). ``dst`` must
        not repeat a slot. Everything is checked before anything is written."""
        target = self if into is None else into
        if target is not self and [(s.layer, s.name, s.shape) for s in target.specs] != [
            (s.layer, s.name, s.shape) for s in self.specs
        ]:
            raise ValueError("into must be a pool of the same states (layers, names, shapes)")
        s_idx = self.slots(src)
        d_idx = target.slots(dst)
        if s_idx.numel() != d_idx.numel():
            raise ValueError(f"src has {s_idx.numel()} slots but dst has {d_idx.numel()}")
        if d_idx.unique().numel() != d_idx.numel():
            raise ValueError(f"dst names a slot twice: {d_idx.tolist()}")
        for key, t in self._tensors.items():
            out = target._tensors[key]
            rows = t.index_select(0, s_idx).to(out.device, out.dtype)
            out.index_copy_(0, d_idx, rows)

    def __repr__(self) -> str:
        return (
            f"StatePool({len(self.specs)} states, n_slots={self.n_slots}, "
            f"{self.bytes_per_slot} bytes a slot, device={self.device})"
        )


#: The snapshot pool of each KV cache (the owner of the core cache whose slot ids index it), and
#: the dtype it was asked for.
_SNAPSHOTS: weakref.WeakKeyDictionary[Any, tuple[StatePool, torch.dtype | None]] = (
    weakref.WeakKeyDictionary()
)


def snapshot_pool(
    kv: Any,
    specs: Iterable[StateSpec],
    dtype: torch.dtype | None = None,
    *,
    any_dtype: bool = False,
) -> StatePool:
    """The pool holding the snapshots of ``kv``'s state slots (``kv``: a
    :class:`radixkv.KVCache` over a cache made with ``state_slots=N``): made on the first call,
    ``N`` slots of ``specs`` on ``kv.device`` in ``dtype`` (``None``: each state's own); every
    later call over the same ``kv`` gets the same pool, so that a slot the core hands to one of
    its users holds what another wrote. ``ValueError`` for a later call with other states (a
    different model), or another ``dtype`` unless ``any_dtype`` (take the pool as it is)."""
    specs = tuple(specs)
    held = _SNAPSHOTS.get(kv)
    if held is None:
        n = kv.cache.stats.state_slots
        if n < 1:
            raise ValueError("the cache has no state slots (make it with state_slots=N)")
        pool = StatePool(specs, n, kv.device, dtype=dtype)
        _SNAPSHOTS[kv] = (pool, dtype)
        return pool
    pool, made = held
    if [(s.layer, s.name, s.shape, s.dtype) for s in pool.specs] != [
        (s.layer, s.name, s.shape, s.dtype) for s in specs
    ]:
        raise ValueError(
            "this KVCache's state snapshots are those of another model (other recurrent layers "
            "or state shapes): a KVCache is shared by users of one model only"
        )
    if made != dtype and not any_dtype:
        own = "the states' own dtypes"
        raise ValueError(
            f"this KVCache's state snapshots are held in {made or own} (chosen by the first "
            f"engine or PrefixCache over it), not {dtype or own}: pass snapshot_dtype={made}"
        )
    return pool
