"""Moving a hybrid model's recurrent states between transformers' cache object and radixkv's
:class:`~radixkv.kv.state_pool.StatePool`, and continuing a forward exactly from them.

transformers 5.x keeps a recurrent layer's states in its ``DynamicCache`` as a
``LinearAttentionLayer`` (``conv_states[0]``, ``recurrent_states[0]``, batch first). After a
forward, :func:`read_states` copies batch row ``b`` of every recurrent layer into pool slot
``slots[b]``; :func:`restore_cache` builds a fresh cache whose recurrent layers hold copies of
pool slots, marked as continuing after ``num_tokens`` tokens (the request's own working copy: a
snapshot slot is never written through it). :func:`forward_suffix` runs the model over the tokens
after the cached prefix, exactly:

```text
  tokens:    [0 ............ num_tokens) [num_tokens ... num_tokens + T)
  state:      folded into the slot        run by forward_suffix, positions given explicitly
```

Positions are passed explicitly (Bamba's model would number the suffix from 0). For a family
whose module scans a multi-token forward from a zero state (Jamba), the cache is put in
transformers' own past-recording mode with ``recurrent_states_to_keep = T``: the module then
steps every token of the suffix through its single-token update from the cached state, inside one
forward (the attention and MLP layers still run the suffix at once). That keeps ``T`` copies of
each such layer's state until the forward ends, so the suffix is run in pieces of at most
:data:`STEPWISE_TOKENS` tokens. Measured on one CPU thread (a 4-layer Jamba, hidden 256, 64 cached
tokens): 0.9x, 1.15x and 1.24x the time of the inexact multi-token forward for suffixes of 16, 64
and 256 tokens, where one model forward a token costs 5.6x, 13x and 20x. On a GPU with
``mamba_ssm``'s fused scan the stepped path gives up that kernel for these layers (not measured).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from radixkv.hf._hybrid import ATTENTION_LAYER_TYPES, RecurrentLayer, family
from radixkv.kv.state_pool import Slots, StatePool, snapshot_pool

#: The most tokens one forward steps through a stepwise family's module (see the module doc).
STEPWISE_TOKENS = 64


def _linear(cache: Any, layer: RecurrentLayer) -> Any:
    held = getattr(cache, "layers", ())
    cache_layer = held[layer.layer] if layer.layer < len(held) else None
    if not isinstance(cache_layer, LinearAttentionCacheLayerMixin):
        raise ValueError(
            f"layer {layer.layer} of the cache is a {type(cache_layer).__name__}, not a "
            "recurrent layer's cache (was it made with DynamicCache(config=model.config)?)"
        )
    return cache_layer


def read_states(
    cache: Any, layers: Sequence[RecurrentLayer], pool: StatePool, slots: Slots
) -> None:
    """Copies every recurrent layer's states of batch row ``b`` of ``cache`` into pool slot
    ``slots[b]``. Everything is checked before the pool is written."""
    idx = pool.slots(slots)
    found = []
    for layer in layers:
        cache_layer = _linear(cache, layer)
        for spec in layer.specs:
            states = (
                cache_layer.conv_states if spec.name == "conv" else cache_layer.recurrent_states
            )
            value = states.get(0)
            if value is None:
                raise ValueError(
                    f"the cache holds no {spec.name} state for layer {layer.layer} (no forward "
                    "has run through it)"
                )
            if tuple(value.shape) != (idx.numel(), *spec.shape):
                raise ValueError(
                    f"layer {layer.layer}'s {spec.name} state is {tuple(value.shape)}; expected "
                    f"{(idx.numel(), *spec.shape)} ({idx.numel()} slots)"
                )
            found.append((spec, value))
    for spec, value in found:
        target = pool.tensor(spec.layer, spec.name)
        target.index_copy_(0, idx, value.to(target.device, target.dtype))


def restore_cache(
    model: Any,
    layers: Sequence[RecurrentLayer],
    pool: StatePool,
    slots: Slots,
    num_tokens: int,
    kv: Sequence[tuple[int, torch.Tensor, torch.Tensor]] = (),
) -> Any:
    """A fresh ``DynamicCache`` for ``model`` whose recurrent layers hold copies of pool
    ``slots`` (batch row ``b`` from slot ``slots[b]``, in the model's state dtypes), continuing
    after ``num_tokens`` tokens; ``kv``: ``(layer, keys, values)`` of the attention layers, each
    ``[batch, kv heads, num_tokens, head dim]``. A state restored into a narrower pool's dtype
    comes back converted."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    idx = pool.slots(slots)
    types = list(model.config.layer_types)
    for layer_index, keys, values in kv:
        if not 0 <= layer_index < len(types) or types[layer_index] not in ATTENTION_LAYER_TYPES:
            raise ValueError(f"kv names layer {layer_index}, which is not an attention layer")
        if keys.shape[-2] != num_tokens or values.shape[-2] != num_tokens:
            raise ValueError(
                f"layer {layer_index}'s KV holds {keys.shape[-2]} tokens, not {num_tokens}"
            )
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    for layer in layers:
        cache_layer = _linear(cache, layer)
        conv = pool.tensor(layer.layer, "conv").index_select(0, idx)
        conv = conv.to(device, layer.conv.dtype)
        rec = None
        if layer.recurrent is not None:
            rec = pool.tensor(layer.layer, "recurrent").index_select(0, idx)
            rec = rec.to(device, layer.recurrent.dtype)
        # The layer's own lazy initialization (device, static addresses), then our values.
        LinearAttentionLayer.lazy_initialization(
            cache_layer, conv_states=conv, recurrent_states=rec, conv_kernel_size=layer.kernel
        )
        cache_layer.conv_states[0].copy_(conv)
        if rec is not None:
            cache_layer.recurrent_states[0].copy_(rec)
        cache_layer.has_previous_state[0] = True
        cache_layer.cumulative_length_linear.fill_(num_tokens)
    for layer_index, keys, values in kv:
        attention: Any = cache.layers[layer_index]
        attention.update(keys.to(device), values.to(device))
    return cache


def cache_kwarg(model: Any) -> str:
    """The forward keyword that takes the cache: ``cache`` (transformers 5.x) or
    ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_suffix(
    model: Any,
    cache: Any,
    input_ids: torch.Tensor,
    num_cached: int,
    layers: Sequence[RecurrentLayer],
) -> torch.Tensor:
    """Logits ``[batch, T, vocab]`` of ``input_ids`` (``[batch, T]``), the tokens after the
    ``num_cached`` tokens ``cache`` holds; ``cache`` then holds all of them. Exact for every
    family of :data:`radixkv.hf._hybrid.FAMILIES` (see the module doc)."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [batch, T] with T >= 1, got {tuple(input_ids.shape)}")
    fam = family(model)
    if not fam.stepwise_suffix or input_ids.shape[1] == 1:
        return _forward(model, cache, input_ids, num_cached)
    out = []
    for start in range(0, input_ids.shape[1], STEPWISE_TOKENS):
        piece = input_ids[:, start : start + STEPWISE_TOKENS]
        stepped = [_linear(cache, layer) for layer in layers]
        for cache_layer in stepped:
            cache_layer.activate_past_recording(recurrent_states_to_keep=piece.shape[1])
        try:
            out.append(_forward(model, cache, piece, num_cached + start))
        finally:
            for cache_layer in stepped:
                # crop(0) trims the conv state back to its kernel and drops the recorded past.
                cache_layer.crop(0)
                cache_layer.conv_states[0] = cache_layer.conv_states[0].contiguous()
                cache_layer.record_past = False
    return torch.cat(out, dim=1)


def _forward(model: Any, cache: Any, input_ids: torch.Tensor, num_cached: int) -> torch.Tensor:
    batch, length = input_ids.shape
    positions = torch.arange(num_cached, num_cached + length, device=input_ids.device)
    out = model(
        input_ids=input_ids,
        position_ids=positions.expand(batch, length),
        use_cache=True,
        **{cache_kwarg(model): cache},
    )
    return out.logits


def state_length(cache: Any, layers: Sequence[RecurrentLayer]) -> int | None:
    """The tokens every recurrent layer's state in ``cache`` has folded in, or None when the
    layers disagree (or hold no state yet)."""
    seen = set()
    for layer in layers:
        cache_layer = _linear(cache, layer)
        if cache_layer.conv_states.get(0) is None:
            return None
        seen.add(int(cache_layer.cumulative_length_linear))
    return seen.pop() if len(seen) == 1 else None


class PrefixStates:
    """A :class:`radixkv.hf.PrefixCache`'s side of a hybrid model's states: the snapshots of
    its KV cache's state slots (shared with an engine over the same KV cache,
    :func:`radixkv.kv.state_pool.snapshot_pool`), restored into and taken from the transformers
    cache ``generate`` runs on, which is the request's working state (no pool slot of its own).

    ```text
      lookup:    cache <- snapshot[req.state_slot] (copied) + K/V     tokens [0, num_cached)
                 prefill(num_cached, n - 1): forward_suffix, split at the junction and at n - 1,
                 each a snapshot                                     tokens [num_cached, n - 1)
      generate:  its first forward computes token n - 1: a snapshot at n (the prompt's end)
      store:     a snapshot at the end, where the state covers exactly the K/V stored
    ```
    Snapshots are taken at page boundaries only (token-exact at ``page_size=1``); each is pending
    until the request's ``commit``/``finish``, and an ``abort`` frees it.
    """

    def __init__(self, model: Any, kv: Any, layers: Sequence[RecurrentLayer]) -> None:
        self.model = model
        self.layers = tuple(layers)
        self.cache = kv.cache
        self.page_size = self.cache.stats.page_size
        specs = tuple(s for layer in self.layers for s in layer.specs)
        #: The snapshots, in whatever dtype the first user of ``kv`` chose.
        self.snapshots = snapshot_pool(kv, specs, any_dtype=True)
        #: Snapshots restored into a lookup's cache, and taken, by this PrefixCache.
        self.restored = 0
        self.taken = 0

    def restore(self, req: Any, kv: Sequence[tuple[int, torch.Tensor, torch.Tensor]] = ()) -> Any:
        """A fresh transformers cache for ``req``'s hit: its snapshot (``req.state_slot``)
        copied, then released, and ``kv`` (see :func:`restore_cache`) for its
        ``req.num_cached`` tokens; an empty cache without a hit."""
        if not req.num_cached:
            return DynamicCache(config=self.model.config)
        slot = req.state_slot
        if slot is None:  # the core ends every hit at a snapshot it pins
            raise RuntimeError(f"a hit of {req.num_cached} tokens without its state snapshot")
        cache = restore_cache(self.model, self.layers, self.snapshots, [slot], req.num_cached, kv)
        self.cache.release_state(req)
        self.restored += 1
        return cache

    def prefill(self, cache: Any, req: Any, input_ids: torch.Tensor, stop: int) -> None:
        """Runs the model over ``input_ids[:, req.num_cached:stop]`` into ``cache`` (exact for
        every family: :func:`forward_suffix`), split where a snapshot is wanted: the junction
        (``req.kv_matched``, where the index's K/V match ran past the hit, so the next request
        sharing that prefix hits all of it) and ``stop``, each floored to a page."""
        start = req.num_cached
        p = self.page_size
        wanted = sorted({x for x in (req.kv_matched // p * p, stop // p * p) if start < x <= stop})
        pos = start
        with torch.no_grad():
            for end in [*wanted, stop]:
                if end > pos:
                    forward_suffix(self.model, cache, input_ids[:, pos:end], pos, self.layers)
                    pos = end
                if end in wanted:
                    self.capture(cache, req, end)

    def capture(self, cache: Any, req: Any, pos: int) -> bool:
        """A snapshot of ``cache``'s states as ``req``'s state at ``pos`` tokens, when ``pos``
        is a page boundary, the states cover exactly ``pos`` tokens and the index gives a slot
        (none when one is there already, or every slot is pinned); returns whether one was
        taken."""
        if pos < 1 or pos % self.page_size or state_length(cache, self.layers) != pos:
            return False
        slot = self.cache.take_state(req, pos)
        if slot is None:
            return False
        read_states(cache, self.layers, self.snapshots, [slot])
        self.taken += 1
        return True
