"""A hybrid model's recurrent layers inside a radixkv step: each request scanned on its own.

:class:`radixkv.hf.HFCausalLM` runs a step's requests packed back to back as one row. Attention
layers attend per request through the paged KV; a recurrent layer (Gated DeltaNet, Mamba,
Mamba2, a short convolution) would scan across the row from one request into the next. Inside
:meth:`HybridRunner.running`, each recurrent module's forward is replaced by one that splits
the packed hidden states by request and runs transformers' own module on each part, with a
transformers cache holding that request's working state (restored from its slot of the working
pool, :mod:`radixkv.hf._hybrid_cache`):

```text
  packed row:  [ r0 prefill chunk | r1 decode | r2 decode | r3 prefill chunk ]
  groups:      (r0) one cache       (r1, r2) one cache, a batch of 1-token rows    (r3)
  r3's chunk:  [start ...... pos | pos ...... end]   a capture at pos: the layer's state there
                                                     goes into the snapshot take_state gave
```

After the model's forward, :meth:`StepRun.write_back` copies every group's states into its
working slots (only then: a forward that raises leaves the working states as they were).
Jamba's module scans a multi-token forward from a zero state, so a part that continues a state
is stepped token by token (transformers' past-recording mode, as
:func:`radixkv.hf._hybrid_cache.forward_suffix` does); positions are the step's own (Bamba's
model would count them from 0). Falcon-H1's layers run attention and Mamba2 side by side: only
the Mamba2 submodule is replaced.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from radixkv.hf import _hybrid, _hybrid_cache
from radixkv.kv.state_pool import StatePool


class Row(Protocol):
    """One request of a step (see :class:`radixkv.engine.states.RowStates`)."""

    slot: int
    start: int
    end: int
    captures: list[tuple[int, int]]


class _Group:
    """Requests run through a recurrent module together: one prefill chunk, or a batch of
    one-token rows. ``tokens``: their rows of the packed step; ``cache``: their states."""

    def __init__(self, rows: list[Row], tokens: list[int], cache: Any) -> None:
        self.rows = rows
        self.tokens = tokens
        self.cache = cache


class HybridRunner:
    """The recurrent modules of a hybrid ``model`` and how to run them inside a step."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.family = _hybrid.family(model)
        self.layers = _hybrid.recurrent_layers(model)
        decoder = model.model.layers
        self.mixers = {
            layer.layer: getattr(decoder[layer.layer], self.family.mixer) for layer in self.layers
        }
        self._by_index = {layer.layer: layer for layer in self.layers}

    @contextlib.contextmanager
    def running(
        self,
        step: Any,
        rows: Sequence[Row],
        working: StatePool,
        snapshots: StatePool,
    ) -> Iterator[StepRun]:
        """Inside the block, every recurrent module of the model runs ``step``'s requests
        (``rows``, in the step's order) on their working slots; the modules are restored on
        the way out. Call :meth:`StepRun.write_back` after a forward that succeeded."""
        run = StepRun(self, step, rows, working, snapshots)
        for index, mixer in self.mixers.items():
            mixer.forward = functools.partial(run.mixer, index, type(mixer).forward.__get__(mixer))
        try:
            yield run
        finally:
            for mixer in self.mixers.values():
                mixer.__dict__.pop("forward", None)


class StepRun:
    """One step's recurrent work (see :meth:`HybridRunner.running`)."""

    def __init__(
        self,
        runner: HybridRunner,
        step: Any,
        rows: Sequence[Row],
        working: StatePool,
        snapshots: StatePool,
    ) -> None:
        q_lens = [int(n) for n in step.q_len_list]
        if len(q_lens) != len(rows):
            raise ValueError(f"the step has {len(q_lens)} requests but {len(rows)} state rows")
        self.runner, self.working, self.snapshots = runner, working, snapshots
        self.groups: list[_Group] = []
        decode_rows: list[Row] = []
        decode_tokens: list[int] = []
        offset = 0
        for row, q in zip(rows, q_lens):
            if row.end - row.start != q:
                raise ValueError(
                    f"a state row covers tokens {row.start}..{row.end} but its request "
                    f"computes {q} tokens"
                )
            if q == 1 and row.start > 0:
                decode_rows.append(row)
                decode_tokens.append(offset)
            else:
                tokens = list(range(offset, offset + q))
                self.groups.append(_Group([row], tokens, self._cache([row])))
            offset += q
        if decode_rows:
            self.groups.append(_Group(decode_rows, decode_tokens, self._cache(decode_rows)))

    def _cache(self, rows: list[Row]) -> Any:
        """A transformers cache holding ``rows``' working states (a fresh one for a request
        with nothing before its chunk)."""
        model = self.runner.model
        if rows[0].start == 0:
            return DynamicCache(config=model.config)
        return _hybrid_cache.restore_cache(
            model, self.runner.layers, self.working, [r.slot for r in rows], rows[0].start
        )

    def mixer(
        self,
        index: int,
        forward: Any,
        hidden_states: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The recurrent module of layer ``index`` over the packed ``hidden_states``
        (``[1, T, hidden]``), one group at a time."""
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
            raise ValueError(
                f"layer {index}'s recurrent module got hidden states {tuple(hidden_states.shape)}"
                ", expected one packed row [1, T, hidden]"
            )
        layer = self.runner._by_index[index]
        out = torch.empty_like(hidden_states)
        for group in self.groups:
            idx = torch.tensor(group.tokens, device=hidden_states.device)
            if len(group.rows) > 1 or group.rows[0].end - group.rows[0].start == 1:
                h = hidden_states[0].index_select(0, idx)[:, None, :]  # [B, 1, hidden]
                o = self._run(forward, layer, group.cache, h)
                out[0].index_copy_(0, idx, o[:, 0].to(out.dtype))
                for b, row in enumerate(group.rows):
                    for _pos, snap in row.captures:  # only at end: a chunk of one token
                        self._capture(group.cache, layer, b, snap)
                continue
            row = group.rows[0]
            cuts = [pos for pos, _ in row.captures if pos < row.end] + [row.end]
            snaps = dict(row.captures)
            first = group.tokens[0]
            a = row.start
            for b in cuts:
                part = hidden_states[:, first + a - row.start : first + b - row.start]
                o = self._run(forward, layer, group.cache, part)
                out[:, first + a - row.start : first + b - row.start] = o.to(out.dtype)
                if b in snaps:
                    self._capture(group.cache, layer, 0, snaps[b])
                a = b
        return out

    def _run(self, forward: Any, layer: _hybrid.RecurrentLayer, cache: Any, h: torch.Tensor) -> Any:
        """The module over ``h`` (``[batch, T, hidden]``) continuing ``cache``."""
        cache_layer = _hybrid_cache._linear(cache, layer)
        stepwise = (
            self.runner.family.stepwise_suffix
            and h.shape[1] > 1
            and cache_layer.has_previous_state.get(0, False)
        )
        if not stepwise:
            return forward(h, cache=cache, attention_mask=None)
        outs = []
        for start in range(0, h.shape[1], _hybrid_cache.STEPWISE_TOKENS):
            piece = h[:, start : start + _hybrid_cache.STEPWISE_TOKENS]
            cache_layer.activate_past_recording(recurrent_states_to_keep=piece.shape[1])
            try:
                outs.append(forward(piece, cache=cache, attention_mask=None))
            finally:
                cache_layer.crop(0)
                cache_layer.conv_states[0] = cache_layer.conv_states[0].contiguous()
                cache_layer.record_past = False
        return torch.cat(outs, dim=1)

    def _capture(self, cache: Any, layer: _hybrid.RecurrentLayer, b: int, snap: int) -> None:
        """Batch row ``b`` of ``layer``'s states in ``cache`` into snapshot slot ``snap``."""
        cache_layer = _hybrid_cache._linear(cache, layer)
        for spec in layer.specs:
            conv = spec.name == "conv"
            states = cache_layer.conv_states if conv else cache_layer.recurrent_states
            target = self.snapshots.tensor(spec.layer, spec.name)
            target[snap].copy_(states[0][b])

    def write_back(self) -> None:
        """Every group's states into its requests' working slots."""
        for group in self.groups:
            _hybrid_cache.read_states(
                group.cache, self.runner.layers, self.working, [r.slot for r in group.rows]
            )
