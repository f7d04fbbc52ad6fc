"""`PrefixCache`: prefix reuse across ``model.generate()`` calls of a transformers model.

Each call looks its prompt up in a radixkv index; the cached prefix's K/V is read out of the
pool into a transformers ``DynamicCache`` that ``generate`` continues from, so only the rest of
the prompt is computed. Afterwards the K/V ``generate`` computed (what the DynamicCache then
holds: the prompt and every generated token but the last, which no forward has seen yet) is
written into the request's pages and published for the next call.

```text
  lookup:    input_ids [ cached (pool -> DynamicCache) | rest ]   pages admitted and pinned
  generate:  DynamicCache grows by rest + out[:-1]
  store:     pool <- DynamicCache[cached:]; commit; finish        (published, pins released)
```

A model with sliding-window layers gets a ``DynamicCache`` of full layers, which keeps every
token's K/V: transformers' own window mask still limits what each query reads, so ``generate``
gives its own tokens. Over a cache with a window group the window layers' K/V comes from and
goes to the window pool; the keys of pages released there (older than any query reads) are
handed over as zeros, which the window mask hides.

A hybrid model (recurrent layers beside attention) needs a cache made with ``state_slots=N``:
a hit also restores the recurrent states' snapshot it ends at (copied into the DynamicCache),
``lookup`` computes the rest of the prompt but its last token itself (exactly, for every family)
and snapshots are taken on the way and at the end (:class:`radixkv.hf._hybrid_cache.PrefixStates`;
docs/SEMANTICS.md, "Hybrid models in hf.PrefixCache").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

import radixkv
from radixkv.hf._adapter import _check_hybrid_cache, kv_for
from radixkv.hf._hybrid import recurrent_layers
from radixkv.hf._hybrid_cache import PrefixStates, state_length
from radixkv.hf._support import check_model
from radixkv.kv.kv_cache import KVCache

#: ``generate`` arguments that :meth:`PrefixCache.generate` refuses, and why.
_REFUSED = {
    "past_key_values": "PrefixCache supplies the cache itself",
    "cache": "PrefixCache supplies the cache itself",
    "inputs_embeds": "the cache is keyed by token ids",
    "assistant_model": "assisted decoding rewinds the cache",
    "prompt_lookup_num_tokens": "prompt-lookup decoding rewinds the cache",
}


@dataclass
class _Open:
    """A lookup not yet stored: the DynamicCache handed out and its pinned request."""

    past: Any
    request: radixkv.Request
    tokens: np.ndarray


class PrefixCache:
    """Prefix reuse for a transformers causal LM's ``generate()``, one sequence per call.

    ``cache``: a :class:`radixkv.RadixCache` or :class:`radixkv.BlockCache` (a
    :class:`radixkv.KVCache` shaped from ``model.config`` is made for it, in the model's dtype
    on its device), or a ``KVCache`` to share, such as an engine's ``engine.kv``. ``namespace``:
    the radixkv namespace every lookup uses (``None``: the default one).

    :meth:`generate` is ``model.generate`` with the reuse built in and returns what it returns.
    For callers that call ``generate`` themselves, :meth:`lookup` gives a transformers Cache
    holding the cached prefix (pass it as ``past_key_values``), :meth:`store` publishes prompt
    and output afterwards and :meth:`abort` gives a lookup up without publishing. Until one of
    them, the prefix's pages stay pinned.

    Batch size 1 only (``ValueError`` otherwise), greedy or sampled, without beams.
    ``last_cached`` is the number of tokens the last lookup found cached.

    A hybrid model's ``cache`` must be made with ``state_slots=N`` (refused otherwise, as
    :func:`radixkv.hf.engine` refuses it); its snapshots are shared with an engine over the same
    ``KVCache`` (``radixkv.hf.engine(model, prefix.kv)``).
    """

    def __init__(
        self,
        model: Any,
        cache: radixkv.Cache | KVCache,
        namespace: str | bytes | None = None,
    ) -> None:
        self.spec = check_model(model)
        if self.spec.tp_size > 1:
            raise ValueError(
                f"radixkv.hf.PrefixCache serves one process; this model is tensor-parallel "
                f"(tp_size={self.spec.tp_size}): use radixkv.hf.engine(model, cache), which runs "
                f"the ranks in lockstep"
            )
        if namespace is not None and not isinstance(namespace, (str, bytes)):
            raise ValueError(
                f"namespace must be None, a str or bytes, got {namespace!r} "
                f"({type(namespace).__name__})"
            )
        if self.spec.kv_layers:
            _check_hybrid_cache(model, cache, None)
        self.model = model
        self.kv = kv_for(self.spec, cache)
        self.cache = self.kv.cache
        #: Of a hybrid model: its recurrent states' snapshots and how they are restored and
        #: taken (:class:`radixkv.hf._hybrid_cache.PrefixStates`); None for other models.
        self.states: PrefixStates | None = None
        if self.spec.kv_layers:
            if self.kv.shared is not None:
                raise ValueError(
                    f"{type(model).__name__} is a hybrid model: radixkv does not serve it with a "
                    "shared tier (its pages travel without the recurrent-state snapshots a hit "
                    "needs, so no replica could hit them): use a KVCache without shared_store="
                )
            self.states = PrefixStates(model, self.kv, recurrent_layers(model))
        self.namespace = namespace
        self.last_cached = 0
        self._open: dict[int, _Open] = {}

    @property
    def num_open(self) -> int:
        """Lookups neither stored nor aborted (each pins its prefix's pages)."""
        return len(self._open)

    # ---- step by step -----------------------------------------------------------------------

    def lookup(self, input_ids: Any) -> Any:
        """A transformers ``DynamicCache`` holding the K/V of the longest cached prefix of
        ``input_ids`` (``[1, n]`` or ``[n]`` token ids): pass it to ``model.generate`` as
        ``past_key_values``, then hand it to :meth:`store` (or :meth:`abort`). The request's
        pages are admitted and pinned until then. Of a hybrid model the cache also holds the
        hit's recurrent states, and the rest of ``input_ids`` but the last token, which this
        call computes through the model. Raises ``ValueError`` for bad ids or a batch
        of more than one row, :class:`radixkv.OutOfPages` when the pool cannot hold the
        prompt."""
        tokens = self._tokens(input_ids, "input_ids")
        req = self.cache.admit(tokens, self.namespace)
        try:
            # A hit on the host tier is in the pool only once the pending copies are done.
            self.kv.apply_copies()
            cached = req.num_cached
            if self.states is not None:
                past = self._lookup_hybrid(req, tokens)
            else:
                past = _new_dynamic_cache(self.model.config, full=self.spec.windowed)
            if cached and self.states is None:
                slots = self._slots(req, 0, cached)
                held = self._window_rows(req, 0, cached) if self.kv.window else None
                for layer in range(self.spec.num_layers):
                    k, v = self._read(layer, slots, held, cached)  # [c, Hkv, D] each
                    past.update(
                        k.transpose(0, 1).unsqueeze(0).to(self.spec.dtype),
                        v.transpose(0, 1).unsqueeze(0).to(self.spec.dtype),
                        layer,
                    )
        except BaseException:
            self.cache.abort(req)
            raise
        self._open[id(past)] = _Open(past, req, tokens)
        self.last_cached = cached
        return past

    def store(self, past: Any, output: Any) -> int:
        """Writes the K/V that ``generate`` added to ``past`` (a cache from :meth:`lookup`) into
        the request's pages and publishes them with the tokens they belong to, the first
        ``past.get_seq_length()`` of ``output`` (``generate``'s return: a ``[1, N]`` tensor or
        an output with ``sequences``, which must begin with the looked-up ids); then releases
        the pins. Returns how many tokens are now cached for this sequence. Where the pool has
        no pages for the generated tokens, the prompt alone is stored.

        ``ValueError``, changing nothing, for a ``past`` this object did not hand out (or
        already stored) or an ``output`` that does not match it."""
        entry = self._open.get(id(past))
        if entry is None or entry.past is not past:
            raise ValueError(
                "past must be a cache returned by this PrefixCache's lookup() and not yet "
                "stored or aborted"
            )
        sequences = getattr(output, "sequences", output)
        row = self._tokens(sequences, "output", check_vocab=False)
        prompt, req = entry.tokens, entry.request
        n, cached = len(prompt), req.num_cached
        if len(row) < n or not np.array_equal(row[:n], prompt):
            raise ValueError(
                f"output must begin with the {n} looked-up input ids (generate's return for "
                f"them), got {len(row)} tokens that do not"
            )
        length = int(past.get_seq_length())
        if not cached <= length <= len(row):
            raise ValueError(
                f"past holds {length} tokens: expected between the {cached} it was given and the "
                f"{len(row)} of output"
            )
        layers = _layers(past, self.spec.kv_layers or None)
        # The end's state is snapshotted only where it folds in exactly the tokens stored.
        end_state = self.states is not None and state_length(past, self.states.layers) == length
        want = (1, self.spec.num_kv_heads, length, self.spec.head_dim)
        if len(layers) != self.spec.num_layers or any(
            tuple(k.shape) != want or tuple(v.shape) != want for k, v in layers
        ):
            raise ValueError(
                f"past must hold {self.spec.num_layers} layers of K/V shaped {want} (a "
                "DynamicCache continued by generate over batch 1)"
            )
        del self._open[id(past)]
        try:
            if length > n:
                try:
                    self.cache.extend(req, row[n:length])
                except radixkv.OutOfPages:
                    length = n  # keep the prompt; the pool has no room for the output
            if length > cached:
                # Offloads of pages admit/extend handed out read them before they are written.
                self.kv.apply_copies()
                slots = self._slots(req, cached, length)
                wrows = self._window_rows(req, cached, length)[1] if self.kv.window else None
                for layer, (k, v) in enumerate(layers):
                    rows = wrows if layer in self.kv.window_layers else slots
                    self.kv.k[layer].index_copy_(0, rows, _token_major(k, cached, length))
                    self.kv.v[layer].index_copy_(0, rows, _token_major(v, cached, length))
                if end_state and self.states is not None:  # before the commit that covers it
                    self.states.capture(past, req, length)
                self.cache.commit(req, length)
            self.cache.finish(req)
        except BaseException:
            if not req.closed:
                self.cache.abort(req)
            raise
        return length

    def abort(self, past: Any) -> None:
        """Gives up a lookup: releases its pins and publishes nothing. ``ValueError`` for a
        ``past`` this object did not hand out or already stored."""
        entry = self._open.pop(id(past), None)
        if entry is None or entry.past is not past:
            if entry is not None:
                self._open[id(past)] = entry
            raise ValueError(
                "past must be a cache returned by this PrefixCache's lookup() and not yet "
                "stored or aborted"
            )
        self.cache.abort(entry.request)

    # ---- all in one -------------------------------------------------------------------------

    def generate(self, input_ids: Any, **kwargs: Any) -> Any:
        """``model.generate(input_ids, **kwargs)`` continuing from the cached prefix of
        ``input_ids`` (one row), then storing prompt and output for the next call. Returns what
        ``generate`` returns, with the same tokens a plain call gives.

        ``ValueError`` for a batch of more than one row, an ``attention_mask`` that masks
        anything, beam search or several return sequences, and arguments that manage the
        cache themselves (``past_key_values``, ``use_cache=False``, assisted decoding)."""
        for name, why in _REFUSED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"PrefixCache.generate takes no {name}: {why}")
        if kwargs.get("use_cache", True) is False:
            raise ValueError("PrefixCache.generate needs use_cache=True (got False)")
        config = kwargs.get("generation_config")
        for name in ("num_beams", "num_return_sequences"):
            value = kwargs.get(name, getattr(config, name, None))
            if value is None:
                value = getattr(self.model.generation_config, name, 1)
            if value not in (None, 1):
                raise ValueError(
                    f"PrefixCache.generate serves one sequence per call: {name} must be 1, "
                    f"got {value!r}"
                )
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError(
                "PrefixCache.generate takes no padding: attention_mask must be all ones"
            )
        ids = input_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            ids = torch.as_tensor(self._tokens(input_ids, "input_ids").astype(np.int64))[None]
            ids = ids.to(self.spec.device)
        past = self.lookup(ids)
        hook = None
        if self.states is not None:
            hook = self.model.register_forward_hook(self._prompt_end(past))
        try:
            output = self.model.generate(ids, **{self.spec.cache_kwarg: past}, **kwargs)
        except BaseException:
            self.abort(past)
            raise
        finally:
            if hook is not None:
                hook.remove()
        self.store(past, output)
        return output

    # ---- hybrid models ----------------------------------------------------------------------

    def _lookup_hybrid(self, req: radixkv.Request, tokens: np.ndarray) -> Any:
        """The transformers cache of a hybrid model's lookup: the hit's attention K/V and its
        state snapshot (copied), then the rest of the prompt but its last token computed into
        it (exactly, with snapshots at the junction and there): ``generate`` then computes one
        token before decoding, which every family continues exactly."""
        assert self.states is not None
        cached = req.num_cached
        kv = []
        if cached:
            slots = self._slots(req, 0, cached)
            for i, layer in enumerate(self.spec.kv_layers):
                k, v = self._read(i, slots, None, cached)  # [c, Hkv, D] each
                kv.append(
                    (
                        layer,
                        k.transpose(0, 1).unsqueeze(0).to(self.spec.dtype),
                        v.transpose(0, 1).unsqueeze(0).to(self.spec.dtype),
                    )
                )
        past = self.states.restore(req, kv)
        ids = torch.from_numpy(tokens.astype(np.int64))[None].to(self.spec.device)
        self.states.prefill(past, req, ids, len(tokens) - 1)
        return past

    def _prompt_end(self, past: Any) -> Any:
        """A forward hook for ``generate`` over ``past`` (from :meth:`lookup`): after the
        forward that computes the prompt's last token, a snapshot of the state there (the
        prompt's end, which a longer prompt sharing this one hits in full)."""
        entry = self._open[id(past)]
        n = len(entry.tokens)
        done = False
        thread = threading.get_ident()  # the hook is the model's: ignore other threads' calls

        def hook(module: Any, args: Any, output: Any) -> None:
            nonlocal done
            if not done and threading.get_ident() == thread:
                done = True
                if int(past.get_seq_length()) == n:
                    assert self.states is not None
                    self.states.capture(past, entry.request, n)

        return hook

    # ---- helpers ----------------------------------------------------------------------------

    def _tokens(self, ids: Any, name: str, check_vocab: bool = True) -> np.ndarray:
        """One row of token ids as uint32; ``ValueError`` naming ``name`` otherwise."""
        if isinstance(ids, torch.Tensor):
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
            arr = ids.detach().cpu().numpy()
        else:
            try:
                arr = np.asarray(ids)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name} must be token ids, got {type(ids).__name__}") from e
            if arr.dtype == object or arr.dtype.kind not in "iu":
                if arr.size or arr.dtype == object:
                    raise ValueError(f"{name} must hold integer token ids, got {arr.dtype}")
        if arr.ndim == 2:
            if arr.shape[0] != 1:
                raise ValueError(
                    f"{name} has batch size {arr.shape[0]}: PrefixCache serves one sequence "
                    "per call (batch 1); call it once per row"
                )
            arr = arr[0]
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(
                f"{name} must be [1, n] or [n] token ids with n >= 1, got shape {tuple(arr.shape)}"
            )
        arr = arr.astype(np.int64, copy=False)
        hi = self.spec.vocab_size if check_vocab else 2**32
        if int(arr.min()) < 0 or int(arr.max()) >= hi:
            raise ValueError(
                f"{name} must hold token ids in [0, {hi}), got {int(arr.min())}..{int(arr.max())}"
            )
        return arr.astype(np.uint32)

    def _slots(self, req: radixkv.Request, start: int, stop: int) -> torch.Tensor:
        """Pool rows of the request's tokens ``start:stop``, on the pool's device."""
        slots = np.asarray(req.slots[start:stop], dtype=np.int64)
        return torch.from_numpy(slots).to(self.kv.device)

    def _window_rows(
        self, req: radixkv.Request, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Of the request's tokens ``start:stop``, the offsets (from ``start``) of those whose
        window page the request holds, and their rows of the window pool, on its device."""
        p = self.kv.page_size
        i = np.arange(start, stop, dtype=np.int64)
        w = np.asarray(req.window_pages, dtype=np.int64)[i // p]
        held = w >= 0
        offsets = torch.from_numpy(np.flatnonzero(held)).to(self.kv.device)
        rows = torch.from_numpy(w[held] * p + i[held] % p).to(self.kv.device)
        return offsets, rows

    def _read(
        self,
        layer: int,
        slots: torch.Tensor,
        held: tuple[torch.Tensor, torch.Tensor] | None,
        n: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V of the request's first ``n`` tokens in ``layer``, ``[n, Hkv, D]``: from
        the full pool at ``slots``, or for a window layer of a window group from the window pool
        (``held``: :meth:`_window_rows` of those tokens), zeros where its pages are released
        (keys no query past ``n`` reads)."""
        if layer not in self.kv.window_layers:
            return self.kv.k[layer].index_select(0, slots), self.kv.v[layer].index_select(0, slots)
        assert held is not None  # a window layer means a window group
        offsets, rows = held
        out = []
        for pool in (self.kv.k[layer], self.kv.v[layer]):
            x = pool.new_zeros((n, *pool.shape[1:]))
            x[offsets] = pool.index_select(0, rows)
            out.append(x)
        return out[0], out[1]

    def __repr__(self) -> str:
        return f"PrefixCache({type(self.model).__name__}, {self.kv}, namespace={self.namespace!r})"


def _new_dynamic_cache(config: Any, full: bool = False) -> Any:
    """An empty ``DynamicCache`` laid out for ``config``; with ``full``, of full layers only
    (a sliding-window layer's would drop the keys ``store`` writes back)."""
    if full:
        return DynamicCache()
    try:
        return DynamicCache(config=config)
    except TypeError:  # pragma: no cover - a transformers whose DynamicCache takes no config
        return DynamicCache()


def _layers(
    past: Any, indices: tuple[int, ...] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (keys, values) of a transformers cache, ``[1, Hkv, L, D]`` each; with
    ``indices``, those layers' only (a hybrid model's attention layers)."""
    layers = getattr(past, "layers", None)
    if layers is None:
        raise ValueError(f"past must be a transformers DynamicCache, got {type(past).__name__}")
    if indices is not None:
        if len(layers) <= max(indices):
            raise ValueError(f"past holds {len(layers)} layers, the model has {max(indices) + 1}+")
        layers = [layers[i] for i in indices]
    out = []
    for layer in layers:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise ValueError("past has a layer without key/value tensors")
        out.append((k, v))
    return out


def _token_major(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``[1, H, L, D]`` -> the tokens ``start:stop`` as ``[n, H, D]``."""
    return x[0, :, start:stop].transpose(0, 1)
