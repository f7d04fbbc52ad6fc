"""`HFCausalLM`: a transformers causal LM driven by radixkv steps, and `engine()`.

The engine calls ``model(step)`` with one planned :class:`radixkv.Step` and wants each
request's last-token logits. The adapter runs the transformers model over the step's packed
tokens as one row (``input_ids[None]``, ``position_ids=positions[None]``, no transformers
cache, no mask), with radixkv's attention function in every layer: transformers does the model
math (embeddings, norms, RoPE of any kind, MLPs, head), radixkv the paged attention.

```text
  step:   input_ids [T] | positions [T]       (requests packed back to back)
  layer:  q [1, Hq, T, D], k/v [1, Hkv, T, D] -> step.attention(layer, ...) -> [1, T, Hq, D]
  out:    logits of rows last_token_index [B] -> [B, vocab] float32
```
"""

from __future__ import annotations

from typing import Any

import torch

import radixkv
from radixkv.engine.engine import Engine
from radixkv.hf._support import (
    CALLS_KWARG,
    STEP_KWARG,
    ModelSpec,
    check_model,
    paged_mode,
    register,
)
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.step import Step

_Cache = radixkv.RadixCache | radixkv.BlockCache


class HFCausalLM(torch.nn.Module):
    """radixkv's model interface over a transformers causal LM (the ``model`` attribute):
    ``forward(step)`` returns float32 logits ``[B, vocab]`` of each request's last planned
    token and writes the step's K/V into the pool. ``config`` is the model's config (the engine
    reads ``config.vocab_size``).

    Construction checks the model (:func:`check_model`: ``ValueError`` saying why for
    sliding-window, chunked, hybrid or cross attention, and the like), then runs one probe token
    through a scratch pool to check that every layer's attention goes through radixkv with the
    KV shape the config gives. The model keeps its own attention implementation outside
    ``forward``: plain ``model.generate`` works on it as before.
    """

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.spec: ModelSpec = check_model(model)
        register()
        self.model = model
        self.config = model.config
        _probe(self)

    @torch.inference_mode()
    def forward(self, step: Step, all_logits: bool = False) -> torch.Tensor:
        """Float32 logits ``[B, vocab]`` of each request's last planned token, or ``[T, vocab]``
        of every planned token with ``all_logits``."""
        return self._forward(step, all_logits)

    def _forward(
        self, step: Step, all_logits: bool = False, calls: list[int] | None = None
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            STEP_KWARG: step,
            "position_ids": step.positions[None],
            "use_cache": False,
        }
        if calls is not None:
            kwargs[CALLS_KWARG] = calls
        keep = None if all_logits else step.last_token_index
        if keep is not None and self.spec.logits_to_keep:
            kwargs["logits_to_keep"] = keep
        with paged_mode(self.model):
            out = self.model(input_ids=step.input_ids[None], **kwargs)
        logits = out.logits[0]
        if keep is not None and not self.spec.logits_to_keep:
            logits = logits[keep]
        return logits.float()

    def make_kv_cache(self, cache: _Cache) -> KVCache:
        """A :class:`radixkv.KVCache` for ``cache`` shaped from the model's config (layers, KV
        heads, head dim) in the model's dtype, on its device."""
        return make_kv_cache(self.spec, cache)

    def __repr__(self) -> str:
        return f"HFCausalLM({type(self.model).__name__}, {self.spec})"


def make_kv_cache(spec: ModelSpec, cache: _Cache) -> KVCache:
    """A :class:`radixkv.KVCache` for ``cache`` shaped as ``spec`` says."""
    if not isinstance(cache, (radixkv.RadixCache, radixkv.BlockCache)):
        raise ValueError(
            f"cache must be a radixkv.RadixCache, BlockCache or KVCache, got {type(cache).__name__}"
        )
    return KVCache(
        cache, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device
    )


def check_kv(spec: ModelSpec, kv: KVCache, name: str) -> None:
    """``ValueError`` unless ``kv``'s pools have the model's KV shape, dtype and device."""
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device)
    got = (kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.device)
    if want != got:
        raise ValueError(
            f"{name} is shaped (layers, KV heads, head dim, dtype, device) = {got}, the model "
            f"needs {want}"
        )


def kv_for(spec: ModelSpec, cache: _Cache | KVCache) -> KVCache:
    """The :class:`KVCache` to use: ``cache`` itself when it is one (checked against the
    model), else a new one over the index ``cache``."""
    if isinstance(cache, KVCache):
        check_kv(spec, cache, "cache")
        return cache
    return make_kv_cache(spec, cache)


def _probe(adapter: HFCausalLM) -> None:
    """Runs one token through a scratch two-slot pool and checks that the model called
    radixkv's attention once per layer, with the K/V shape of its config: a model that
    computes attention (or state) some other way is refused here, not mid-generation."""
    spec = adapter.spec
    name = type(adapter.model).__name__
    scratch = radixkv.RadixCache(2, page_size=1)
    kv = KVCache(
        scratch, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device
    )
    req = scratch.admit([0])
    calls: list[int] = []
    try:
        step = kv.plan([req])
        with torch.inference_mode():
            logits = adapter._forward(step, calls=calls)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{name} does not run on radixkv's paged attention as its config describes it "
            f"({spec.num_layers} layers, {spec.num_kv_heads} KV heads of dim {spec.head_dim}): "
            f"{e}"
        ) from e
    finally:
        scratch.abort(req)
    if sorted(calls) != list(range(spec.num_layers)):
        raise ValueError(
            f"{name} called radixkv's attention for layers {sorted(calls)} of "
            f"{spec.num_layers}: every layer must compute full causal attention through "
            "transformers' AttentionInterface (hybrid, recurrent or custom attention is not "
            "supported)"
        )
    if tuple(logits.shape) != (1, spec.vocab_size):
        raise ValueError(
            f"{name} returned logits of shape {tuple(logits.shape)} for one token, expected "
            f"(1, {spec.vocab_size})"
        )


def engine(model: Any, cache: _Cache | KVCache, token_budget: int = 2048, **kwargs: Any) -> Engine:
    """A :class:`radixkv.Engine` (continuous batching, sessions, ``branch``, the scheduler)
    over the transformers causal LM ``model``.

    ``cache``: a :class:`radixkv.RadixCache` or :class:`radixkv.BlockCache`, for which a
    :class:`radixkv.KVCache` is made, sized from ``model.config`` (layers, KV heads, head dim)
    in the model's dtype on its device; or a ``KVCache`` already made (to share one pool with a
    :class:`radixkv.hf.PrefixCache`: pass ``prefix.kv``). ``token_budget`` and the other keyword
    arguments go to :class:`radixkv.Engine`.

    Raises ``ValueError`` saying why for a model radixkv cannot serve (sliding-window, chunked,
    hybrid or cross attention, encoder-decoders, composite models) and for bad arguments.
    """
    adapter = HFCausalLM(model)
    kv = kv_for(adapter.spec, cache)
    return Engine(adapter, kv, token_budget=token_budget, **kwargs)
