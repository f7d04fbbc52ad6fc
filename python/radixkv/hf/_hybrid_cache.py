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
from radixkv.kv.state_pool import Slots, StatePool

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
