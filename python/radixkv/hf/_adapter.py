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

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

import radixkv
from radixkv.engine.engine import Engine
from radixkv.engine.states import RowStates
from radixkv.hf import _compile
from radixkv.hf._hybrid import snapshot_bytes
from radixkv.hf._hybrid_adapter import HybridRunner
from radixkv.hf._load import eos_token_ids
from radixkv.hf._support import (
    CALLS_KWARG,
    LAYERS_KWARG,
    STEP_KWARG,
    ModelSpec,
    check_model,
    paged_mode,
    register,
    tp_group,
)
from radixkv.kv import devices
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.state_pool import StatePool, StateSpec
from radixkv.kv.step import StepLike


class HFCausalLM(torch.nn.Module):
    """radixkv's model interface over a transformers causal LM (the ``model`` attribute):
    ``forward(step)`` returns float32 logits ``[B, vocab]`` of each request's last planned
    token and writes the step's K/V into the pool. ``config`` is the model's config (the engine
    reads ``config.vocab_size``).

    Construction checks the model (:func:`check_model`: ``ValueError`` saying why for
    chunked, hybrid or cross attention, and the like), then runs one probe token
    through a scratch pool to check that every layer's attention goes through radixkv with the
    KV shape the config gives. The model keeps its own attention implementation outside
    ``forward``: plain ``model.generate`` works on it as before.
    """

    def __init__(
        self,
        model: Any,
        snapshot_dtype: torch.dtype | None = None,
        compile: bool | str | Callable[..., Any] = False,
    ) -> None:
        super().__init__()
        self.spec: ModelSpec = check_model(model)
        register()
        self.model = model
        self.config = model.config
        #: Of a hybrid model: its recurrent modules (:mod:`radixkv.hf._hybrid_adapter`), the
        #: states a slot holds (what :class:`radixkv.Engine` makes its state pools of), the
        #: dtype of its snapshots (None: the states' own), and the engine's states, which
        #: every forward reads its rows from (set by the engine).
        self.hybrid: HybridRunner | None = None
        self.state_specs: tuple[StateSpec, ...] = ()
        self.snapshot_dtype = snapshot_dtype
        self.states: Any = None
        if self.spec.kv_layers:
            self.hybrid = HybridRunner(model)
            if self.spec.tp_size > 1:
                _check_whole_states(self.hybrid, type(model).__name__)
            self.state_specs = tuple(s for layer in self.hybrid.layers for s in layer.specs)
        #: The model's ``torch.compile``d call (:mod:`radixkv.hf._compile`), or None (eager);
        #: made after the probe, which runs eagerly.
        self.compiled: Any = None
        _probe(self)
        if compile is not False:
            self.compiled = _compiled(self.spec, model, compile)

    @torch.inference_mode()
    def forward(self, step: StepLike, all_logits: bool = False) -> torch.Tensor:
        """Float32 logits ``[B, vocab]`` of each request's last planned token, or ``[T, vocab]``
        of every planned token with ``all_logits``."""
        return self._forward(step, all_logits)

    def _forward(
        self, step: StepLike, all_logits: bool = False, calls: list[tuple[int, int]] | None = None
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            STEP_KWARG: step,
            "position_ids": step.positions[None],
            "use_cache": False,
        }
        if calls is not None:
            kwargs[CALLS_KWARG] = calls
        # A decode step's rows are its requests' last tokens, in order: every row is kept.
        keep = None if all_logits or step.is_decode else step.last_token_index
        if keep is not None and self.spec.logits_to_keep:
            kwargs["logits_to_keep"] = keep
        if self.compiled is not None and calls is None:
            out = self._compiled_forward(step, kwargs, keep)
        elif self.hybrid is None:
            with paged_mode(self.model):
                out = self.model(input_ids=step.input_ids[None], **kwargs)
        else:
            out = self._hybrid_forward(step, kwargs, self.states)
        logits = out.logits[0]
        if keep is not None and not self.spec.logits_to_keep:
            logits = logits[keep]
        return logits.float()

    def _compiled_forward(
        self, step: StepLike, kwargs: dict[str, Any], keep: torch.Tensor | None
    ) -> Any:
        """The compiled call over ``step``: the graph gets the one stand-in step
        (:data:`~radixkv.hf._compile.COMPILED_STEP`), whose attention op attends over ``step``;
        the packed length and the kept rows are dynamic sizes."""
        input_ids = step.input_ids[None]
        kwargs[STEP_KWARG] = _compile.COMPILED_STEP
        _compile.mark_dynamic(
            (input_ids, 1), (kwargs["position_ids"], 1), (kwargs.get("logits_to_keep"), 0)
        )
        with paged_mode(self.model), _compile.running(step):
            return self.compiled(input_ids=input_ids, **kwargs)

    def _hybrid_forward(self, step: StepLike, kwargs: dict[str, Any], states: Any) -> Any:
        """The forward of a hybrid model: its recurrent modules run each request on its
        working slot of ``states`` (an :class:`radixkv.engine.states.EngineStates`, or what
        the probe makes), written back once the forward has succeeded."""
        assert self.hybrid is not None
        if states is None:
            raise RuntimeError(
                f"{type(self.model).__name__} is a hybrid model: it runs inside a radixkv.Engine "
                "(radixkv.hf.engine), which holds its recurrent states"
            )
        kwargs[LAYERS_KWARG] = {layer: i for i, layer in enumerate(self.spec.kv_layers)}
        with (
            paged_mode(self.model),
            self.hybrid.running(step, states.rows, states.working, states.snapshots) as run,
        ):
            out = self.model(input_ids=step.input_ids[None], **kwargs)
            run.write_back()
        return out

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """``(layers, KV heads, head dim)`` of the KV the model writes and reads (of a
        tensor-parallel model: this rank's KV heads), which :class:`radixkv.Engine` checks its
        ``KVCache`` against."""
        return self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim

    def make_kv_cache(self, cache: radixkv.Cache) -> KVCache:
        """A :class:`radixkv.KVCache` for ``cache`` shaped from the model's config (layers, KV
        heads, head dim; of a tensor-parallel model, this rank's KV heads) in the model's dtype,
        on its device."""
        return make_kv_cache(self.spec, cache)

    def __repr__(self) -> str:
        return f"HFCausalLM({type(self.model).__name__}, {self.spec})"


def make_kv_cache(
    spec: ModelSpec,
    cache: radixkv.Cache,
    disk_dir: str | os.PathLike[str] | None = None,
    fingerprint: Mapping[str, object] | None = None,
    on_mismatch: str = "error",
    attention: str = "auto",
    shared_store: str | None = None,
    shared_store_key: bytes | str | None = None,
) -> KVCache:
    """A :class:`radixkv.KVCache` for ``cache`` shaped as ``spec`` says; a cache with a host
    tier gets its host pools in CPU memory, one with a disk tier its pool under ``disk_dir``
    (``fingerprint``: the model's, see :func:`radixkv.kv.tiers.fingerprint.model_fingerprint`);
    ``attention``: its backend (``KVCache(attention=...)``); ``shared_store`` and
    ``shared_store_key``: its shared tier (``KVCache(shared_store=...)``)."""
    if not isinstance(cache, radixkv.Cache):
        raise ValueError(
            f"cache must be a radixkv.RadixCache, BlockCache or KVCache, got {type(cache).__name__}"
        )
    window_layers: tuple[int, ...] = ()
    if cache.window:
        if not spec.window_layers:
            raise ValueError(
                f"the cache has a window group (window={cache.window}) but the model has no "
                "sliding-window layers: make the cache without window= and window_pages="
            )
        if cache.window < spec.window:
            raise ValueError(
                f"the cache's window group holds the last {cache.window} keys, the model's "
                f"sliding_window is {spec.window}: make it with window={spec.window}"
            )
        window_layers = spec.window_layers
    return KVCache(
        cache,
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        spec.device,
        host_device="cpu" if cache.host_pages else None,
        disk_dir=disk_dir,
        fingerprint=fingerprint,
        on_mismatch=on_mismatch,
        window_layers=window_layers,
        attention=attention,
        shared_store=shared_store,
        shared_store_key=shared_store_key,
    )


def check_kv(spec: ModelSpec, kv: KVCache, name: str) -> None:
    """``ValueError`` unless ``kv``'s pools have the model's KV shape, dtype and device."""
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device)
    got = (kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.device)
    if want[:4] != got[:4] or not devices.same(spec.device, kv.device):
        raise ValueError(
            f"{name} is shaped (layers, KV heads, head dim, dtype, device) = {got}, the model "
            f"needs {want}"
        )


def kv_for(
    spec: ModelSpec, cache: radixkv.Cache | KVCache, attention: str | None = None
) -> KVCache:
    """The :class:`KVCache` to use: ``cache`` itself when it is one (checked against the
    model; ``attention`` must then be ``None``: the pool has its backend), else a new one over
    the index ``cache`` with ``attention`` (default ``"auto"``)."""
    if isinstance(cache, KVCache):
        check_kv(spec, cache, "cache")
        if attention is not None and attention != cache.attention:
            raise ValueError(
                f"attention={attention!r} is for a cache this call makes its KVCache for; the "
                f"KVCache passed in attends through {cache.attention!r} (KVCache(attention=...))"
            )
        return cache
    return make_kv_cache(spec, cache, attention=attention or "auto")


def _probe(adapter: HFCausalLM) -> None:
    """Runs one token through a scratch two-slot pool and checks that the model called
    radixkv's attention once per layer, with the K/V shape of its config and the query heads
    that config gives this process (of a tensor-parallel model: its shard of the heads, read
    from the query tensors): a model that computes attention (or state) some other way is
    refused here, not mid-generation. Collective for a tensor-parallel model (one forward)."""
    spec = adapter.spec
    name = type(adapter.model).__name__
    per_rank = f" per rank of {spec.tp_size}" if spec.tp_size > 1 else ""
    scratch = radixkv.RadixCache(2, page_size=1)
    kv = KVCache(
        scratch, spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device
    )
    req = scratch.admit([0])
    calls: list[tuple[int, int]] = []
    held = adapter.states
    if adapter.hybrid is not None:  # one working slot (and a snapshot pool it never uses)
        adapter.states = _ProbeStates(StatePool(adapter.state_specs, 1, spec.device))
    try:
        step = kv.plan([req])
        with torch.inference_mode():
            logits = adapter._forward(step, calls=calls)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{name} does not run on radixkv's paged attention as its config describes it "
            f"({spec.num_layers} layers, {spec.num_kv_heads} KV heads{per_rank} of dim "
            f"{spec.head_dim}): {e}"
        ) from e
    finally:
        adapter.states = held
        scratch.abort(req)
    layers = sorted(layer for layer, _ in calls)
    if layers != list(range(spec.num_layers)):
        raise ValueError(
            f"{name} called radixkv's attention for layers {layers} of "
            f"{spec.num_layers}: every layer must compute full causal attention through "
            "transformers' AttentionInterface (hybrid, recurrent or custom attention is not "
            "supported)"
        )
    heads = sorted({h for _, h in calls})
    if heads != [spec.num_heads]:
        raise ValueError(
            f"{name}'s attention got {heads} query heads, its config gives "
            f"{spec.num_heads}{per_rank}"
        )
    if tuple(logits.shape) != (1, spec.vocab_size):
        raise ValueError(
            f"{name} returned logits of shape {tuple(logits.shape)} for one token, expected "
            f"(1, {spec.vocab_size})"
        )


def _check_whole_states(runner: HybridRunner, name: str) -> None:
    """``ValueError`` unless every recurrent module of a tensor-parallel hybrid model keeps its
    whole state on this rank: its convolution's weight is not split among the ranks.
    transformers' plans keep them whole (Qwen3.5's and Qwen3-Next's projections gather their
    outputs; Mamba, Mamba2 and short convolutions are not in the plans), and the state pools
    are shaped whole from the modules' own sizes."""
    for index, mixer in runner.mixers.items():
        conv = getattr(mixer, "conv1d", None) or getattr(mixer, "conv", None)
        placements = getattr(getattr(conv, "weight", None), "placements", ())
        if any(p.is_shard() for p in placements):
            raise ValueError(
                f"{name}'s tensor-parallel plan splits the recurrent module of layer {index} "
                f"({type(mixer).__name__}: its convolution's weight is sharded {placements}): "
                "radixkv holds a recurrent layer's whole state on every rank; keep its modules "
                "out of the plan, or run it on one process"
            )


class _ProbeStates:
    """The states of the probe's one token: working slot 0, fresh."""

    def __init__(self, pool: StatePool) -> None:
        self.working = self.snapshots = pool
        self.rows = [RowStates(0, 0, 1)]


def _group_for(spec: ModelSpec, model: Any, group: Any) -> Any:
    """The process group the engine runs its ranks in lockstep over: ``group`` as given for a
    model that is not tensor-parallel; for one that is, ``group`` checked against the ranks
    transformers sharded it over (``ValueError`` naming both), or those ranks' group."""
    if spec.tp_size == 1:
        return group
    import torch.distributed as dist

    tp = tp_group(model)
    if group is None:
        return tp
    name = type(model).__name__
    if not dist.is_initialized():  # pragma: no cover - a sharded model implies it
        raise ValueError("group= needs torch.distributed initialized")
    size = dist.get_world_size(group)
    if size < 1:  # torch's answer for a group this process is not in
        raise ValueError(
            f"this process (rank {dist.get_rank()}) is not in group, but {name} is "
            f"tensor-parallel over tp_size={spec.tp_size} ranks including it"
        )
    if size != spec.tp_size:
        raise ValueError(
            f"group has {size} ranks but {name} is tensor-parallel over tp_size={spec.tp_size}: "
            "pass the group transformers sharded it over, or leave group= out to use it"
        )
    mine, theirs = dist.get_process_group_ranks(group), dist.get_process_group_ranks(tp)
    if sorted(mine) != sorted(theirs):
        raise ValueError(
            f"group holds ranks {sorted(mine)} but {name} is sharded over ranks {sorted(theirs)}"
        )
    return group


def engine(
    model: Any,
    cache: radixkv.Cache | KVCache,
    token_budget: int = 2048,
    *,
    disk_dir: str | os.PathLike[str] | None = None,
    on_mismatch: str = "error",
    attention: str | None = None,
    shared_store: str | None = None,
    shared_store_key: bytes | str | None = None,
    snapshot_dtype: torch.dtype | None = None,
    compile: bool | str | Callable[..., Any] = False,
    **kwargs: Any,
) -> Engine:
    """A :class:`radixkv.Engine` (continuous batching, sessions, ``branch``, the scheduler)
    over the transformers causal LM ``model``.

    ``cache``: a :class:`radixkv.RadixCache` or :class:`radixkv.BlockCache`, for which a
    :class:`radixkv.KVCache` is made, sized from ``model.config`` (layers, KV heads, head dim)
    in the model's dtype on its device; or a ``KVCache`` already made (to share one pool with a
    :class:`radixkv.hf.PrefixCache`: pass ``prefix.kv``). ``token_budget`` and the other keyword
    arguments go to :class:`radixkv.Engine`.

    A model loaded with ``from_pretrained(..., tp_plan="auto")`` (tensor-parallel, one process
    per rank) gets a pool of its own heads: ``num_key_value_heads / tp_size`` KV heads (all
    of them where the plan does not split the attention), and
    its engine runs the ranks in lockstep (see :class:`radixkv.Engine`: rank 0 submits, the
    others call ``follow()``) over ``group=``, by default the group transformers sharded the
    model over; a ``group`` of other ranks is refused. Call it on every rank together: it runs
    one probe forward, and the engine agrees on its settings across ranks.

    Requests stop at the model's end-of-sequence ids (``generation_config.eos_token_id``) by
    default (``stop_tokens=``; ``submit(..., stop=())`` turns it off for one request), and
    ``tokenizer=`` gives results their text and makes ``stop_strings`` work.

    ``disk_dir``: for a ``cache`` made with ``disk_pages > 0``, the directory of its disk tier,
    fingerprinted with the model (:func:`radixkv.kv.tiers.fingerprint.model_fingerprint`: its config
    and a digest of its weights), so that pages saved by one process (``engine.kv.save()``) are
    hits for the next one over the same model and refused for another (``on_mismatch="error"``,
    or ``"reset"`` to start empty).

    ``shared_store``: a store URL (``redis://host:port``, ``unix:///path``) whose pages this
    engine shares with every replica of the same model on it (:mod:`radixkv.kv.tiers.shared`;
    keyed by the model's fingerprint, as the disk tier is); ``shared_store_key``: the
    operator's secret, which every page's MAC is keyed with (required for a store that is not
    on a loopback address or a unix socket).

    ``attention``: the attention backend of the ``KVCache`` this call makes (``"auto"`` by
    default: the Triton kernels on CUDA; see :class:`radixkv.KVCache`).

    ``compile``: run the model's forward through ``torch.compile`` around radixkv's attention
    (the custom op ``radixkv::paged_attention``, :mod:`radixkv.hf._compile`): ``True`` for
    Inductor (on the CPU it needs a C++ compiler), or a ``torch.compile`` backend name or
    callable. The packed length is a dynamic size, so a handful of graphs serve every batch
    size; each new one compiles on its first step (on CUDA before the decode graphs are
    captured). Not for hybrid or tensor-parallel models. Off by default: measure it first.

    A hybrid model (Qwen3.5, Qwen3-Next, LFM2, Granite-4.0-H, Nemotron-H, Falcon-H1, Bamba,
    Jamba: recurrent layers beside attention) keeps its attention KV in the pool and each
    recurrent layer's state in the engine's state pools (:mod:`radixkv.engine.states`): the
    ``cache`` must be made with ``state_slots=N``, the snapshots a prefix hit restores
    (``engine.states.describe()`` says what they take); ``snapshot_dtype`` keeps them narrower
    (``torch.bfloat16`` halves fp32 states, at a logit error measured in
    tests/python/hf/test_hybrid_states.py). It runs eager, without speculative decoding, a
    window group or a disk tier (each refused, saying so). Tensor-parallel, each rank holds the
    whole state of every recurrent layer (transformers' plans keep those modules whole: see
    :mod:`radixkv.engine.states`) and its own share of the attention heads (all of them where
    the plan keeps the attention whole, as LFM2's and Falcon-H1's do).

    Raises ``ValueError`` saying why for a model radixkv cannot serve (chunked or cross
    attention, a recurrent layer it cannot hold, encoder-decoders, composite models, heads
    that do not divide among the tensor-parallel ranks) and for bad arguments.
    """
    spec = check_model(model)
    kwargs["group"] = _group_for(spec, model, kwargs.get("group"))
    if isinstance(cache, KVCache):
        check_kv(spec, cache, "cache")
    elif not isinstance(cache, radixkv.Cache):
        raise ValueError(
            f"cache must be a radixkv.RadixCache, BlockCache or KVCache, got {type(cache).__name__}"
        )
    if spec.kv_layers:
        _check_hybrid_cache(model, cache, snapshot_dtype)
    elif snapshot_dtype is not None:
        raise ValueError(f"snapshot_dtype is for hybrid models; {type(model).__name__} is not one")
    adapter = HFCausalLM(model, snapshot_dtype, compile)
    if disk_dir is not None or shared_store is not None:
        if isinstance(cache, KVCache):
            raise ValueError(
                "disk_dir= and shared_store= are for a cache this call makes its KVCache for; a "
                "KVCache passed in brings its own tiers (KVCache(..., disk_dir=..., "
                "shared_store=...))"
            )
        from radixkv.kv.tiers.fingerprint import model_fingerprint

        kv = make_kv_cache(
            adapter.spec,
            cache,
            disk_dir,
            model_fingerprint(model),
            on_mismatch,
            attention=attention or "auto",
            shared_store=shared_store,
            shared_store_key=shared_store_key,
        )
    else:
        kv = kv_for(adapter.spec, cache, attention)
    kwargs.setdefault("stop_tokens", eos_token_ids(model))
    return Engine(adapter, kv, token_budget=token_budget, **kwargs)


def _check_hybrid_cache(
    model: Any, cache: radixkv.Cache | KVCache, snapshot_dtype: torch.dtype | None
) -> None:
    """``ValueError`` unless ``cache`` (an index or a KVCache) has state slots, naming what a
    snapshot of ``model`` costs and a count to start from."""
    index = cache.cache if isinstance(cache, KVCache) else cache
    if index.stats.state_slots >= 1:
        return
    each = snapshot_bytes(model, snapshot_dtype)
    kv_pages = index.stats.num_pages * index.stats.page_size
    raise ValueError(
        f"{type(model).__name__} is a hybrid model: make its cache with state_slots=N (the "
        f"snapshots of its recurrent state that prefix hits restore; one takes {each} bytes): "
        f"for instance state_slots={max(4, min(256, kv_pages // 64))}"
    )


def _compiled(spec: ModelSpec, model: Any, compile: bool | str | Callable[..., Any]) -> Any:
    """``compile=``'s compiled call of ``model`` (``True``: Inductor; a str or callable: that
    ``torch.compile`` backend); ``ValueError`` for a value or a model it does not take."""
    if compile is True:
        backend: Any = _compile.DEFAULT_BACKEND
    elif isinstance(compile, str) or callable(compile):
        backend = compile
    else:
        raise ValueError(
            f"compile must be a bool, a torch.compile backend name or a callable, got {compile!r}"
        )
    name = type(model).__name__
    if spec.kv_layers:
        raise ValueError(
            f"compile=True is for models whose every layer attends; {name} is a hybrid model "
            "(its recurrent layers run per request): pass compile=False"
        )
    if spec.tp_size > 1:
        raise ValueError(
            f"compile=True runs one process; {name} is tensor-parallel over {spec.tp_size} "
            "ranks: pass compile=False"
        )
    return _compile.compile_forward(model, backend)
