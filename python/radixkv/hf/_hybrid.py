"""What radixkv knows of each hybrid model family in transformers 5.x: which layers keep a
recurrent state, the shape and dtype of each state, and what a family's modules get wrong when a
forward continues from a cached state.

transformers 5.x names a layer's kind in ``config.layer_types``: ``"linear_attention"`` (Gated
DeltaNet, Mamba, Mamba2), ``"conv"`` (LFM2's short convolution), ``"hybrid"`` (Falcon-H1:
attention and Mamba2 side by side in one layer), beside ``"full_attention"`` and the stateless
``"mlp"``/``"moe"`` layers of Nemotron-H. Every recurrent layer keeps one conv state (the last
``kernel`` inputs of its causal convolution) and, but for LFM2, one recurrent state:

| family (``model_type``) | module | recurrent state |
|---|---|---|
| Qwen3.5 (``qwen3_5_text``), Qwen3-Next | Gated DeltaNet | ``[value heads, key dim, value dim]`` |
| GraniteMoeHybrid, Nemotron-H, Falcon-H1, Bamba | Mamba2 | ``[heads, head dim, state size]`` |
| Jamba | Mamba | ``[intermediate size, state size]`` |
| LFM2 | short convolution | none |

The conv state is kept in the model's dtype and the recurrent state in float32 (what
transformers' modules write, whatever the model's dtype).

Shapes are read from the model's own modules, so a model built on the meta device (published
sizes, no weights) gives its snapshot size.

Measured quirks (transformers 5.25, tiny random configs, CPU): Bamba's model numbers the tokens of
every forward from 0 (``position_ids`` default to ``arange(len)``, ignoring the cache), so a
forward after a cached prefix must be given its positions; Jamba's Mamba module scans a
multi-token forward from a zero state (its ``mamba_selective_scan`` takes no initial state), so a
suffix must be stepped one token at a time through its own single-token update (see
:mod:`radixkv.hf._hybrid_cache`). The other six continue exactly through their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixkv.kv.state_pool import StateSpec

#: Layer types (``config.layer_types``) that keep a recurrent state.
RECURRENT_LAYER_TYPES = ("linear_attention", "conv", "hybrid")
#: Layer types that keep nothing between tokens (Nemotron-H's MLP and MoE layers).
STATELESS_LAYER_TYPES = ("mlp", "moe")
#: Layer types with attention KV (``"hybrid"`` has both KV and a recurrent state).
ATTENTION_LAYER_TYPES = ("full_attention", "hybrid")

#: Kinds of recurrent module.
GATED_DELTANET = "gated_deltanet"
MAMBA2 = "mamba2"
MAMBA = "mamba"
SHORT_CONV = "short_conv"


@dataclass(frozen=True)
class Family:
    """A hybrid family: its name, the attribute of a decoder layer holding the recurrent
    module, the module's kind, and what a forward continuing from a cached state must do."""

    name: str
    mixer: str
    kind: str
    #: The model numbers a forward's tokens from 0: pass ``position_ids`` after a prefix.
    positions_from_zero: bool = False
    #: The module scans a multi-token forward from a zero state: step the suffix token by token.
    stepwise_suffix: bool = False


#: The families radixkv recognises, by ``config.model_type``.
FAMILIES: dict[str, Family] = {
    "qwen3_5_text": Family("Qwen3.5", "linear_attn", GATED_DELTANET),
    "qwen3_next": Family("Qwen3-Next", "linear_attn", GATED_DELTANET),
    "lfm2": Family("LFM2", "conv", SHORT_CONV),
    "granitemoehybrid": Family("GraniteMoeHybrid", "mamba", MAMBA2),
    "nemotron_h": Family("NemotronH", "mixer", MAMBA2),
    "falcon_h1": Family("FalconH1", "mamba", MAMBA2),
    "bamba": Family("Bamba", "mamba", MAMBA2, positions_from_zero=True),
    "jamba": Family("Jamba", "mamba", MAMBA, stepwise_suffix=True),
}


@dataclass(frozen=True)
class RecurrentLayer:
    """One layer's recurrent states: ``conv`` (``[channels, kernel]``) and ``recurrent`` (None
    for a short convolution)."""

    layer: int
    layer_type: str
    kind: str
    conv: StateSpec
    recurrent: StateSpec | None

    @property
    def specs(self) -> tuple[StateSpec, ...]:
        """The layer's states, conv first."""
        return (self.conv,) if self.recurrent is None else (self.conv, self.recurrent)

    @property
    def kernel(self) -> int:
        """The conv state's width: the convolution's kernel size."""
        return self.conv.shape[-1]


def layer_types(model: Any) -> list[str]:
    """``model.config.layer_types``; ``ValueError`` when the config has none."""
    types = getattr(model.config, "layer_types", None)
    if types is None:
        raise ValueError(f"{type(model).__name__}'s config has no layer_types")
    return list(types)


def is_hybrid(model: Any) -> bool:
    """Whether some layer of ``model`` keeps a recurrent state."""
    types = getattr(model.config, "layer_types", None) or ()
    return any(t in RECURRENT_LAYER_TYPES for t in types)


def family(model: Any) -> Family:
    """The :class:`Family` of ``model``; ``ValueError`` naming its ``model_type`` and its
    recurrent layer types when radixkv does not know it."""
    model_type = getattr(model.config, "model_type", None)
    fam = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if fam is None:
        kinds = sorted({t for t in layer_types(model) if t not in ("full_attention",)})
        raise ValueError(
            f"{type(model).__name__} (model_type {model_type!r}) has {kinds} layers, whose "
            f"recurrent state radixkv does not know how to hold; known hybrid families: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    return fam


def recurrent_layers(model: Any) -> tuple[RecurrentLayer, ...]:
    """Every recurrent layer of ``model`` with the shapes and dtypes of its states, in layer
    order; ``ValueError`` naming the layer type or family radixkv cannot hold."""
    name = type(model).__name__
    types = layer_types(model)
    known = RECURRENT_LAYER_TYPES + STATELESS_LAYER_TYPES + ATTENTION_LAYER_TYPES
    other = sorted({t for t in types if t not in known})
    if other:
        raise ValueError(
            f"{name} has {', '.join(repr(t) for t in other)} layers (config.layer_types): "
            f"radixkv holds {', '.join(known)} layers"
        )
    fam = family(model)
    decoder_layers = model.model.layers
    if len(decoder_layers) != len(types):
        raise ValueError(
            f"{name} has {len(decoder_layers)} decoder layers but {len(types)} layer_types"
        )
    if getattr(model.config, "number_of_conv_states", 1) != 1:
        raise ValueError(
            f"{name} keeps {model.config.number_of_conv_states} conv states a layer: radixkv "
            "holds one"
        )
    out = []
    for i, t in enumerate(types):
        if t not in RECURRENT_LAYER_TYPES:
            continue
        mixer = getattr(decoder_layers[i], fam.mixer, None)
        if mixer is None:
            raise ValueError(
                f"{name}'s layer {i} ({t!r}) has no {fam.mixer!r} module, where {fam.name} "
                "keeps its recurrent module"
            )
        out.append(_layer(i, t, fam.kind, mixer))
    return tuple(out)


def _layer(index: int, layer_type: str, kind: str, mixer: Any) -> RecurrentLayer:
    conv_module = mixer.conv if kind == SHORT_CONV else mixer.conv1d
    conv = StateSpec(
        index,
        "conv",
        (int(conv_module.weight.shape[0]), int(conv_module.kernel_size[0])),
        conv_module.weight.dtype,
    )
    if kind == GATED_DELTANET:
        shape: tuple[int, ...] | None = (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)
    elif kind == MAMBA2:
        shape = (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)
    elif kind == MAMBA:
        shape = (mixer.intermediate_size, mixer.ssm_state_size)
    else:
        shape = None
    recurrent = None
    if shape is not None:
        recurrent = StateSpec(index, "recurrent", tuple(int(d) for d in shape), torch.float32)
    return RecurrentLayer(index, layer_type, kind, conv, recurrent)


def state_specs(model: Any) -> tuple[StateSpec, ...]:
    """Every state a snapshot of ``model`` holds (what :class:`radixkv.kv.state_pool.StatePool`
    is built from)."""
    return tuple(s for layer in recurrent_layers(model) for s in layer.specs)


def snapshot_bytes(model: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of one snapshot of ``model``: every recurrent layer's states, each in its own
    dtype or in ``dtype``."""
    return sum(s.numel * (dtype or s.dtype).itemsize for s in state_specs(model))


def kv_bytes_per_token(model: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of one token's attention K and V over every attention layer of ``model`` (in its
    parameters' dtype, or ``dtype``): what a page of cached tokens costs beside a snapshot."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if dtype is None:
        dtype = next(model.parameters()).dtype
    layers = sum(t in ATTENTION_LAYER_TYPES for t in layer_types(model))
    return layers * 2 * kv_heads * head_dim * dtype.itemsize


def describe(model: Any) -> str:
    """One line: the family, how many recurrent layers of which kinds, and a snapshot's size."""
    layers = recurrent_layers(model)
    fam = family(model)
    kinds = sorted({f"{layer.layer_type}" for layer in layers})
    mib = snapshot_bytes(model) / 2**20
    return (
        f"{fam.name}: {len(layers)} recurrent layers ({', '.join(kinds)}, {fam.kind}), "
        f"{mib:.3g} MiB a snapshot"
    )
