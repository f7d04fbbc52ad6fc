"""What radixkv needs of a transformers model, checked up front, and the attention function it
registers with transformers.

transformers (>= 4.56) looks each layer's attention function up by name in its
``AttentionInterface`` and calls it with the layer module and the layer's q/k/v, after the model
has applied its own projections, norms and RoPE. Keyword arguments given to the model's forward
reach that function. radixkv registers :data:`ATTENTION` once; :func:`paged_attention` hands the
call to the :class:`radixkv.Step` passed as the ``radixkv_step`` keyword. Names outside
transformers' ``AttentionMaskInterface`` get no 4D mask built for them, which is right here: the
step knows every request's positions and lengths.

A model runs under :data:`ATTENTION` only inside :func:`paged_mode`, which restores the model's
own implementation on the way out, so the same model keeps working with plain ``generate``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import AttentionInterface

from radixkv.hf import _hybrid
from radixkv.kv.kv_cache import DTYPES

#: The name radixkv's attention function is registered under in transformers.
ATTENTION = "radixkv_paged"
#: The keyword argument of the model's forward that carries the step to the attention function.
STEP_KWARG = "radixkv_step"
#: The keyword argument of a probe forward: a list each attention call appends its
#: ``(layer, query heads)`` to.
CALLS_KWARG = "radixkv_calls"
#: The layer types (``config.layer_types``) radixkv.hf serves: full causal attention, and
#: causal attention through a sliding window (served exactly over the full KV).
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")
#: The layer types of a hybrid model served besides: recurrent layers (their state in radixkv's
#: state pools, :mod:`radixkv.hf._hybrid_adapter`) and Nemotron-H's stateless MLP/MoE layers.
HYBRID_LAYER_TYPES = _hybrid.RECURRENT_LAYER_TYPES + _hybrid.STATELESS_LAYER_TYPES
#: The keyword argument of a hybrid model's forward: its attention layers' indices into the KV
#: pool (a dict from ``layer_idx``), which holds attention layers only.
LAYERS_KWARG = "radixkv_kv_layers"
#: The oldest transformers whose attention interface and caches this package relies on.
MIN_TRANSFORMERS = (4, 56)

_lock = threading.Lock()


def transformers_version() -> tuple[int, int]:
    """The installed transformers' (major, minor)."""
    parts = transformers.__version__.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over a radixkv step: ``query`` is
    ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]`` (the step's packed tokens, RoPE
    applied); returns ``([1, T, Hq, D], None)`` as transformers' own functions do."""
    step = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION!r} runs only inside radixkv.hf (a model "
            "forward given a radixkv step); set the model back to 'sdpa' or 'eager' to use it "
            "on its own"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            f"{type(module).__name__} passes a position_bias to its attention: radixkv.hf "
            "serves causal attention with RoPE (optionally windowed, softcapped or with sinks)"
        )
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError(
            f"{type(module).__name__} is not causal: radixkv.hf serves causal attention only"
        )
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(
            f"{type(module).__name__} has no int layer_idx (got {layer!r}): radixkv.hf maps "
            "each attention call to its layer's KV through it"
        )
    kv_layers = kwargs.get(LAYERS_KWARG)
    if kv_layers is not None:
        layer = kv_layers[layer]
    calls = kwargs.get(CALLS_KWARG)
    if calls is not None:
        calls.append((layer, query.shape[1]))
    # [1, H, T, D] -> [T, H, D]: views, no copy (one as_strided call each: a layer's every
    # torch call runs cold after the math before it).
    q, k, v = (_token_major(x) for x in (query, key, value))
    # What a layer of Mistral, Qwen2, Gemma 2/3, Cohere2 or gpt-oss adds to causal attention:
    # its sliding window, Gemma 2's softcapping, gpt-oss's sinks (radixkv.kv.windowed).
    window = kwargs.get("sliding_window")
    out = step.attention(
        layer,
        q,
        k,
        v,
        scaling,
        window=int(window) if window is not None else None,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )
    return out.unsqueeze(0), None


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """``x[0].transpose(0, 1)`` of a ``[1, H, T, D]`` tensor, as one view."""
    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"attention inputs must be [1, H, T, D], got {tuple(x.shape)}")
    s = x.stride()
    return x.as_strided((x.shape[2], x.shape[1], x.shape[3]), (s[2], s[1], s[3]))


def register() -> None:
    """Registers :func:`paged_attention` as :data:`ATTENTION` (idempotent)."""
    with _lock:
        AttentionInterface.register(ATTENTION, paged_attention)


@contextlib.contextmanager
def paged_mode(model: Any) -> Iterator[None]:
    """Runs ``model`` with radixkv's attention inside the block and restores its own
    implementation (``sdpa``, ``eager``, ...) on the way out, exceptions included. Not for a
    model that another thread runs at the same time.

    The first switch of a model goes through transformers' ``set_attn_implementation`` (which
    checks the name and walks every module for sub-models) and records which configs it changed
    and from what; later switches set those configs' fields directly, as long as they still
    hold what was recorded (a walk of the model's modules costs about 1% of a decode step of a
    30-layer model, twice a step)."""
    switch = _switches.get(model)
    if switch is None or not switch.still_valid():
        switch = _Switch.learn(model)
    switch.apply(ATTENTION)
    try:
        yield
    finally:
        switch.restore()


class _Switch:
    """The configs of a model that ``set_attn_implementation(ATTENTION)`` changes, with the
    implementation each held before (see :func:`paged_mode`)."""

    def __init__(self, changed: list[tuple[Any, Any]]) -> None:
        self.changed = changed

    @classmethod
    def learn(cls, model: Any) -> _Switch:
        configs = _configs(model)
        before = [(c, getattr(c, "_attn_implementation_internal", None)) for c in configs]
        _set_implementation(model, ATTENTION)
        changed = [
            (c, prev)
            for c, prev in before
            if getattr(c, "_attn_implementation_internal", None) != prev
        ]
        switch = cls(changed)
        if all(hasattr(c, "_attn_implementation_internal") for c, _ in changed) and changed:
            _switches[model] = switch
        switch.restore()
        return switch

    def still_valid(self) -> bool:
        """Whether every recorded config still holds the implementation recorded for it."""
        return all(c._attn_implementation_internal == prev for c, prev in self.changed)

    def apply(self, name: str) -> None:
        for c, _ in self.changed:
            c._attn_implementation_internal = name

    def restore(self) -> None:
        for c, prev in self.changed:
            c._attn_implementation_internal = prev


#: Each model's learnt switch (weakly held: a model that is gone takes its entry along).
_switches: weakref.WeakKeyDictionary[Any, _Switch] = weakref.WeakKeyDictionary()


def _configs(model: Any) -> list[Any]:
    """Every config of ``model``: those of its sub-models and their sub-configs, each once."""
    seen: dict[int, Any] = {}
    todo = [m.config for m in model.modules() if hasattr(m, "config")]
    while todo:
        c = todo.pop()
        if id(c) in seen or not hasattr(c, "_attn_implementation"):
            continue
        seen[id(c)] = c
        for key in getattr(c, "sub_configs", {}) or {}:
            sub = getattr(c, key, None)
            if sub is not None:
                todo.append(sub)
    return list(seen.values())


def _set_implementation(model: Any, name: str) -> None:
    """``model.set_attn_implementation(name)`` where transformers has it (which checks the
    name and updates sub-models), else the config attribute every version reads."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name


@dataclass(frozen=True)
class ModelSpec:
    """The KV shape and placement of a supported model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    #: The forward keyword that takes a transformers Cache: ``cache`` (5.x) or
    #: ``past_key_values``.
    cache_kwarg: str
    #: Whether forward takes ``logits_to_keep`` (a tensor of row indices).
    logits_to_keep: bool
    #: Query heads of each attention call in this process (``num_attention_heads`` over
    #: ``tp_size``, or all of them where the tensor-parallel plan keeps the attention whole:
    #: :func:`attention_sharded`); ``num_kv_heads`` is per process too.
    num_heads: int = 0
    #: The tensor-parallel degree transformers sharded the model with (``tp_plan=...``), else 1.
    tp_size: int = 1
    #: Whether some layer attends through a sliding window (radixkv keeps every token's KV
    #: and masks the window: see :mod:`radixkv.kv.windowed`).
    windowed: bool = False
    #: The sliding window (``config.sliding_window``) and the layers that attend through it:
    #: what a cache with a window group serves from its window pool.
    window: int = 0
    window_layers: tuple[int, ...] = ()
    #: Of a hybrid model: the decoder layers with attention KV, in order (``num_layers`` counts
    #: them: the pool holds attention layers only; layer ``kv_layers[i]`` is pool layer ``i``).
    #: Empty for a model whose every layer attends.
    kv_layers: tuple[int, ...] = ()


def tp_size(model: Any) -> int:
    """The tensor-parallel degree of ``model``: what ``from_pretrained(..., tp_plan="auto")``
    (or a ``DistributedConfig`` with ``tp_size``) sharded it over, else 1."""
    size = getattr(model, "tp_size", None)
    if size is None:  # pragma: no cover - transformers without the property
        size = getattr(model, "_tp_size", None)
    if size is None:
        return 1
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{type(model).__name__}.tp_size must be a positive int, got {size!r}")
    return size


def tp_group(model: Any) -> Any:
    """The ``torch.distributed`` process group over which transformers sharded ``model``'s
    heads: the group of its ``"tp"`` device mesh dimension. ``ValueError`` for a model that is
    not tensor-parallel or whose mesh cannot be found."""
    name = type(model).__name__
    if tp_size(model) == 1:
        raise ValueError(f"{name} is not tensor-parallel (tp_size is 1)")
    mesh = None
    manager = getattr(model, "_mesh_manager", None)  # transformers >= 5.x with DistributedConfig
    if manager is not None:
        mesh = manager.get_mesh("tp")
    if mesh is None:  # pragma: no cover - older transformers keep the TP mesh itself
        mesh = getattr(model, "_device_mesh", None)
        if mesh is not None and mesh.ndim > 1:
            mesh = mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None
    if mesh is None:  # pragma: no cover - the mesh of a sharded weight
        for param in model.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None:
                break
    if mesh is None or mesh.ndim != 1:
        raise ValueError(
            f"{name} is tensor-parallel (tp_size={tp_size(model)}) but radixkv.hf found no "
            "one-dimensional 'tp' device mesh on it: pass group= explicitly"
        )
    return mesh.get_group()


def attention_sharded(model: Any, layers: tuple[int, ...]) -> bool:
    """Whether transformers' tensor-parallel plan split the attention heads of ``model``'s
    decoder layer ``layers[0]`` among the ranks: its ``k_proj`` holds fewer rows on this rank
    than the config's KV heads take (a plan that keeps the attention whole, as LFM2's and
    Falcon-H1's do, leaves every head on every rank). True when no ``k_proj`` is found (the
    heads are taken to be split, as the plans of the attention-only families do)."""
    decoder = getattr(getattr(model, "model", None), "layers", None)
    if decoder is None or layers[0] >= len(decoder):
        return True
    proj = next((m for n, m in decoder[layers[0]].named_modules() if n.endswith("k_proj")), None)
    weight = getattr(proj, "weight", None)
    if weight is None:
        return True
    to_local = getattr(weight, "to_local", None)  # a DTensor: this rank's rows
    rows = int((to_local() if to_local is not None else weight).shape[0])
    config = model.config
    heads = _positive(config, "num_attention_heads") or 1
    kv_heads = _positive(config, "num_key_value_heads") or heads
    head_dim = _positive(config, "head_dim") or (_positive(config, "hidden_size") or 0) // heads
    return rows != kv_heads * head_dim


def undivided_heads(config: Any, tp: int) -> list[tuple[str, int]]:
    """The head counts of ``config`` that ``tp`` ranks cannot split into whole heads, as
    ``(field, count)``: ``num_attention_heads``, then ``num_key_value_heads`` (the former when
    absent). Empty when both divide, or when the config gives no head count."""
    heads = _positive(config, "num_attention_heads")
    if heads is None:
        return []
    kv_heads = _positive(config, "num_key_value_heads") or heads
    counts = (("num_attention_heads", heads), ("num_key_value_heads", kv_heads))
    return [(what, count) for what, count in counts if count % tp]


def _positive(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model.config.{name} must be a positive int, got {value!r}")
    return value


#: RoPE types whose rotation transformers computes from the length of the whole forward pass
#: (its ``dynamic_rope_update``): dynamic NTK scaling (any type with "dynamic" in its name) and
#: LongRoPE (short or long factors, switching past ``original_max_position_embeddings``).
#: Served through radixkv, a token's rotation would depend on what it was batched with and on
#: the length of the pass that cached its prefix, so these models are refused. Every other
#: type in ``ROPE_INIT_FUNCTIONS`` fixes its frequencies at load time and is served exactly.
def length_dependent_rope(rope_type: str) -> bool:
    """Whether transformers recomputes ``rope_type``'s frequencies from each forward's length."""
    return "dynamic" in rope_type or rope_type == "longrope"


def rope_types(model: Any) -> set[str]:
    """Every RoPE type ``model`` uses: its rotary modules' ``rope_type`` (a str, or a dict by
    layer type), and its config's ``rope_parameters`` (5.x) or ``rope_scaling`` (4.x)."""
    found: set[str] = set()

    def add(value: Any) -> None:
        if isinstance(value, str):
            found.add(value)
        elif isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if isinstance(kind, str):
                found.add(kind)
            else:  # per layer type: {"full_attention": {...}, "sliding_attention": {...}}
                for sub in value.values():
                    add(sub)

    for module in model.modules():
        add(getattr(module, "rope_type", None))
    config = model.config
    for attr in ("rope_parameters", "rope_scaling"):
        add(getattr(config, attr, None))
    return found


def check_model(model: Any) -> ModelSpec:
    """The :class:`ModelSpec` of ``model``, a transformers causal LM every layer of which uses
    causal self-attention, full or through a sliding window (softcapped or with sinks as Gemma
    2 and gpt-oss have them); ``ValueError`` saying why for anything else (chunked, hybrid
    linear/SSM or cross attention, an encoder-decoder, a composite model, a model in training
    mode, a pool dtype radixkv does not hold)."""
    if not isinstance(model, transformers.PreTrainedModel):
        raise ValueError(
            f"model must be a transformers PreTrainedModel (AutoModelForCausalLM), got "
            f"{type(model).__name__}"
        )
    name = type(model).__name__
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder: radixkv.hf serves decoder-only models")
    if config.get_text_config() is not config:
        raise ValueError(
            f"{name} is a composite model (its text model has a config of its own): radixkv.hf "
            "serves plain decoder-only causal LMs"
        )
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"{name} has cross attention: radixkv.hf serves self-attention only")
    if not hasattr(model, "generate"):
        raise ValueError(f"{name} is not a generative model (it has no generate())")
    layer_types = getattr(config, "layer_types", None)
    hybrid = _hybrid.is_hybrid(model)
    if hybrid:
        _hybrid.recurrent_layers(model)  # ValueError naming what radixkv cannot hold
    if layer_types is not None:
        served = SERVED_LAYER_TYPES + (HYBRID_LAYER_TYPES if hybrid else ())
        other = sorted({t for t in layer_types if t not in served})
        if other:
            raise ValueError(
                f"{name} has {', '.join(repr(t) for t in other)} layers (config.layer_types): "
                "radixkv.hf serves full and sliding-window causal attention layers only "
                f"({', '.join(SERVED_LAYER_TYPES)}), and the recurrent layers of the hybrid "
                f"families {', '.join(sorted(_hybrid.FAMILIES))}"
            )
    window = getattr(config, "sliding_window", None)
    windowed = bool(
        (layer_types is not None and "sliding_attention" in layer_types)
        or (
            layer_types is None
            and window is not None
            and getattr(config, "use_sliding_window", True)
        )
    )
    # A hybrid family's config describes its layers with these too (Jamba's attn_layer_period,
    # Nemotron-H's layers_block_type); layer_types above is what was checked for it.
    hybrid_attrs = ("attn_layer_period", "layers_block_type") if hybrid else ()
    for attr in ("attention_chunk_size", "attn_layer_period", "layers_block_type", "ssm_cfg"):
        if getattr(config, attr, None) is not None and attr not in hybrid_attrs:
            raise ValueError(
                f"{name} has config.{attr}={getattr(config, attr)!r} (chunked or hybrid "
                "attention): radixkv.hf serves full causal attention only"
            )
    dynamic = sorted(t for t in rope_types(model) if length_dependent_rope(t))
    if dynamic:
        raise ValueError(
            f"{name} uses rope_type={dynamic[0]!r}, whose rotation transformers computes from the "
            "length of the whole forward pass: a token's KV would depend on its batch-mates and "
            "on the pass that cached its prefix, so radixkv.hf refuses it (rope types with "
            "frequencies fixed at load time, such as 'default', 'linear', 'yarn' and 'llama3', "
            "are served exactly)"
        )
    if model.training:
        raise ValueError(f"{name} is in training mode: call model.eval() first")

    num_layers = _positive(config, "num_hidden_layers")
    heads = _positive(config, "num_attention_heads")
    hidden = _positive(config, "hidden_size")
    vocab = _positive(config, "vocab_size")
    if num_layers is None or heads is None or vocab is None:
        raise ValueError(
            f"{name}'s config lacks num_hidden_layers, num_attention_heads or vocab_size"
        )
    kv_heads = _positive(config, "num_key_value_heads") or heads
    head_dim = _positive(config, "head_dim")
    if head_dim is None:
        if hidden is None or hidden % heads:
            raise ValueError(f"{name}'s config gives no head_dim and hidden_size/heads is none")
        head_dim = hidden // heads
    tp = tp_size(model)
    kv_layers: tuple[int, ...] = ()
    if hybrid:
        kv_layers = tuple(
            i for i, t in enumerate(layer_types or ()) if t in _hybrid.ATTENTION_LAYER_TYPES
        )
    # The ranks the attention heads are split over: tp, or 1 where transformers' plan keeps the
    # attention whole on every rank (LFM2's and Falcon-H1's plans shard the embeddings only).
    heads_tp = tp if tp > 1 and attention_sharded(model, kv_layers[:1] or (0,)) else 1
    for what, count in undivided_heads(config, heads_tp)[:1]:
        raise ValueError(
            f"{name} is tensor-parallel over {tp} ranks but config.{what}={count} is not "
            f"divisible by {tp}: radixkv.hf needs whole heads on every rank"
        )
    param = next(model.parameters(), None)
    if param is None:
        raise ValueError(f"{name} has no parameters")
    if param.dtype not in DTYPES:
        raise ValueError(
            f"{name}'s parameters are {param.dtype}; radixkv.hf holds KV in one of "
            f"{', '.join(str(d) for d in DTYPES)}"
        )
    params = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    if hybrid:
        if not kv_layers:
            raise ValueError(
                f"{name} is a hybrid model with no attention layer (config.layer_types): "
                "radixkv.hf serves hybrid models whose prefix has attention KV"
            )
        num_layers = len(kv_layers)
    return ModelSpec(
        kv_layers=kv_layers,
        num_layers=num_layers,
        num_kv_heads=kv_heads // heads_tp,
        head_dim=head_dim,
        vocab_size=vocab,
        dtype=param.dtype,
        device=param.device,
        cache_kwarg=cache_kwarg,
        logits_to_keep="logits_to_keep" in params,
        num_heads=heads // heads_tp,
        tp_size=tp,
        windowed=windowed,
        window=int(window) if windowed else 0,
        window_layers=tuple(
            i
            for i in range(num_layers)
            if windowed and (layer_types is None or layer_types[i] == "sliding_attention")
        ),
    )
