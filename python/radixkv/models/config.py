"""`ModelConfig`: the shape of a Llama-style decoder, and its reading from a Hugging Face
``config.json`` (families ``llama``, ``mistral``, ``qwen2`` and ``qwen3``).

``ModelConfig.from_hf`` reads both forms transformers has written: 4.x (top-level ``rope_theta``
and ``rope_scaling``) and 5.x (``rope_parameters`` holding ``rope_type`` and ``rope_theta``).
Any key that changes the model's math and that radixkv does not implement (a sliding window, an
unknown RoPE type, a partial rotary factor, another activation, ...) is refused with a
``ValueError`` naming it, rather than ignored: a model that loads computes what transformers
computes.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: ``model_type`` values of config.json this package can load.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: RoPE types supported (``None`` means plain RoPE, the same as ``"default"``).
ROPE_TYPES = (None, "default", "linear", "llama3", "yarn")

#: Hugging Face architecture class of each family (``architectures`` in config.json).
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: Values transformers' config classes give keys that a config.json leaves out.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "max_position_embeddings": 2048, "head_dim": None},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "head_dim": None},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "head_dim": None},
    "qwen3": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "head_dim": 128},
}

#: Why some well-known architectures are refused (model_type -> what radixkv lacks).
_UNSUPPORTED_ARCHITECTURES = {
    "gemma": "embeddings scaled by sqrt(hidden_size), (1 + weight) RMSNorm and a GELU MLP",
    "gemma2": "logit soft-capping, sliding-window layers and (1 + weight) RMSNorm",
    "gemma3": "sliding-window layers, q/k norms and (1 + weight) RMSNorm",
    "phi3": "fused qkv_proj/gate_up_proj weights, partial rotary and longrope scaling",
    "mixtral": "a mixture-of-experts MLP",
    "qwen2_moe": "a mixture-of-experts MLP",
    "qwen3_moe": "a mixture-of-experts MLP",
}

#: Parameters each supported RoPE type accepts (besides ``rope_type``), and which are required.
_ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
_ROPE_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": _ROPE_KEYS["llama3"],
    "yarn": ("factor", "original_max_position_embeddings"),
}
#: Every RoPE parameter except these is a positive number.
_ROPE_INT_KEYS = ("original_max_position_embeddings",)
_ROPE_BOOL_KEYS = ("truncate",)


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU).

    The defaults are the small built-in model used by tests and the demo. ``family`` is the
    Hugging Face ``model_type`` the model is saved as, and fixes which projections may carry a
    bias (left as ``None``, each option takes its family's value):

    - ``llama``: one ``attention_bias`` for q/k/v/o, so ``qkv_bias`` and ``o_bias`` are equal
      (``o_bias`` follows ``qkv_bias``); ``mlp_bias`` optional.
    - ``mistral``: no biases.
    - ``qwen2``: biases on q/k/v (``qkv_bias`` True), none on o_proj or the MLP.
    - ``qwen3``: like ``llama`` without ``mlp_bias``, plus RMSNorm over each head of q and k
      (``qk_norm`` True) before RoPE.

    ``rope_scaling`` is ``None`` (plain RoPE) or a dict with ``rope_type`` ``linear``, ``llama3``
    or ``yarn`` and that type's parameters, as in transformers; it is stored normalised (``type``
    read as ``rope_type``, ``"default"`` as ``None``). Any other combination raises ValueError.

    transformers' names are accepted too (:data:`HF_NAMES`): ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads`` (``None``: as many as the query heads) and
    ``model_type`` construct the same config as ``num_layers``, ``num_heads``, ``num_kv_heads``
    and ``family`` (giving both names of one setting with different values is a ``ValueError``),
    and read back as properties, so code written for a transformers config reads this one.
    The other fields (``vocab_size``, ``hidden_size``, ``head_dim``, ``rope_theta``, ...) have
    transformers' names already.
    """

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = None
    family: str = "llama"
    qk_norm: bool | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            _check_positive(name, getattr(self, name))
        _check_positive("num_heads", self.num_heads)
        _check_positive("num_kv_heads", self.num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                    f"({self.num_heads}) unless head_dim is given"
                )
            head_dim = self.hidden_size // self.num_heads
        _check_positive("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)):
            raise ValueError(f"rope_theta must be a number, got {self.rope_theta!r}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        scaling = normalize_rope_scaling(self.rope_scaling, "rope_scaling")
        flags = _resolve_family_flags(
            self.family, self.qkv_bias, self.o_bias, self.mlp_bias, self.qk_norm
        )
        # Everything is checked: only now fill in the derived values (a frozen dataclass).
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "rope_scaling", scaling)
        for name, value in flags.items():
            object.__setattr__(self, name, value)

    @property
    def num_hidden_layers(self) -> int:
        """transformers' name of :attr:`num_layers`."""
        return self.num_layers

    @property
    def num_attention_heads(self) -> int:
        """transformers' name of :attr:`num_heads`."""
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        """transformers' name of :attr:`num_kv_heads`."""
        return self.num_kv_heads

    @property
    def model_type(self) -> str:
        """transformers' name of :attr:`family`."""
        return self.family

    @property
    def rope_type(self) -> str:
        """``"default"``, ``"linear"``, ``"llama3"`` or ``"yarn"``."""
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (validated again).

        Options derived from the family are derived again when what they follow changes:
        changing ``family`` re-derives the bias and q/k-norm options not given in ``changes``,
        and changing ``qkv_bias`` re-derives ``o_bias`` unless it is given.
        """
        if "family" in changes and changes["family"] != self.family:
            for name in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm"):
                changes.setdefault(name, None)
        if "qkv_bias" in changes:
            changes.setdefault("o_bias", None)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` dict of a Llama, Mistral, Qwen2 or Qwen3
        checkpoint, in the transformers 4.x or 5.x form.

        Keys left out take the values transformers' config classes give them. Raises
        ``ValueError`` naming the key for any architecture or setting radixkv does not implement
        (rather than ignoring it and computing something else).
        """
        if not isinstance(hf, Mapping):
            raise ValueError(f"config.json must hold an object, got {type(hf).__name__}")
        family = hf.get("model_type")
        if family not in FAMILIES:
            why = _UNSUPPORTED_ARCHITECTURES.get(str(family))
            detail = f" ({family} uses {why})" if why else ""
            raise ValueError(
                f"config.json model_type {family!r} is not supported by radixkv's built-in "
                f"model{detail}; model_type must be one of {FAMILIES}"
            )
        defaults = _HF_DEFAULTS[family]
        if hf.get("quantization_config") is not None:
            raise ValueError(
                "config.json quantization_config is set: quantized checkpoints are not supported"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act must be 'silu' (SwiGLU), got {act!r}")
        _check_no_sliding_window(hf, family)
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if key not in hf:
                raise ValueError(f"config.json has no {key!r}")
        if "num_attention_heads" not in hf:
            raise ValueError("config.json has no 'num_attention_heads'")
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
        head_dim = hf.get("head_dim", defaults["head_dim"])
        if head_dim is None:
            head_dim = defaults["head_dim"]
        rope_theta, rope_scaling = _rope_from_hf(hf, family)

        bias = bool(hf.get("attention_bias", False))
        flags: dict[str, Any] = {}
        if family in ("llama", "qwen3"):
            flags = {"qkv_bias": bias, "o_bias": bias}
        if family == "llama":
            flags["mlp_bias"] = bool(hf.get("mlp_bias", False))
        try:
            return cls(
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=heads if kv_heads is None else kv_heads,
                head_dim=head_dim,
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                family=family,
                **flags,
            )
        except ValueError as e:
            raise ValueError(f"config.json: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict describing this model.

        RoPE is written in both transformers forms (5.x ``rope_parameters``; 4.x ``rope_theta``
        and ``rope_scaling``), which agree, so that either major version reads it right.
        """
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        out: dict[str, Any] = {
            "model_type": self.family,
            "architectures": [_ARCHITECTURES[self.family]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
            | (scaling or {}),
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
        }
        if self.family in ("llama", "qwen3"):
            out["attention_bias"] = self.qkv_bias
        if self.family == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.family == "mistral":
            out["sliding_window"] = None
        if self.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
            out["sliding_window"] = None
            out["layer_types"] = ["full_attention"] * self.num_layers
        return out


#: transformers' names (config.json keys, ``LlamaConfig`` arguments) of ModelConfig's fields
#: that radixkv names otherwise; ``ModelConfig(...)`` takes either.
HF_NAMES = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "model_type": "family",
}

_dataclass_init = ModelConfig.__init__


def _init(self: ModelConfig, *args: Any, **kwargs: Any) -> None:
    """The dataclass's ``__init__``, with transformers' names (:data:`HF_NAMES`) read as
    radixkv's."""
    for hf_name, name in HF_NAMES.items():
        if hf_name not in kwargs:
            continue
        value = kwargs.pop(hf_name)
        if value is None:
            if hf_name != "num_key_value_heads":
                continue  # the signature's default: not given
            # transformers' None: one KV head per query head
            value = kwargs.get("num_heads", kwargs.get("num_attention_heads", _NUM_HEADS))
        if name in kwargs and kwargs[name] != value:
            raise ValueError(
                f"{hf_name}={value!r} and {name}={kwargs[name]!r} name the same setting: give one"
            )
        kwargs[name] = value
    _dataclass_init(self, *args, **kwargs)


_NUM_HEADS = ModelConfig.num_heads  # the class attribute: the field's default
_init.__doc__ = _dataclass_init.__doc__
_sig = inspect.signature(_dataclass_init)
_init.__signature__ = _sig.replace(  # type: ignore[attr-defined]
    parameters=[
        *_sig.parameters.values(),
        *(
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
            for n, kind in zip(HF_NAMES, ("int", "int", "int | None", "str"))
        ),
    ]
)
ModelConfig.__init__ = _init  # type: ignore[method-assign]


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _resolve_family_flags(
    family: str,
    qkv_bias: bool | None,
    o_bias: bool | None,
    mlp_bias: bool | None,
    qk_norm: bool | None,
) -> dict[str, bool]:
    """The bias and q/k-norm options of ``family`` (``None`` = the family's value); raises
    ValueError for a combination its Hugging Face architecture cannot express."""
    given = {"qkv_bias": qkv_bias, "o_bias": o_bias, "mlp_bias": mlp_bias, "qk_norm": qk_norm}
    for name, value in given.items():
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool or None, got {value!r}")
    if family in ("llama", "qwen3"):
        qkv = bool(qkv_bias)
        fixed = {"qkv_bias": qkv, "o_bias": qkv, "mlp_bias": False, "qk_norm": family == "qwen3"}
        if family == "llama":
            fixed["mlp_bias"] = bool(mlp_bias)
        if o_bias is not None and o_bias != qkv:
            raise ValueError(
                f"family {family!r} has one attention_bias for the q/k/v and o projections: "
                f"qkv_bias ({qkv}) and o_bias ({o_bias}) must be equal (family 'qwen2' has "
                "biases on q/k/v only)"
            )
    elif family == "mistral":
        fixed = {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False}
    else:  # qwen2
        fixed = {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False}
    for name, value in given.items():
        if value is not None and value != fixed[name]:
            raise ValueError(
                f"{name}={value} is not possible for family {family!r}, whose checkpoints always "
                f"have {name}={fixed[name]}"
            )
    return fixed


def normalize_rope_scaling(scaling: Mapping[str, Any] | None, where: str) -> dict[str, Any] | None:
    """``scaling`` checked and normalised: ``None`` for plain RoPE, else a new dict with
    ``rope_type`` first and that type's parameters (``None``-valued optional ones dropped).

    ``where`` names the source in error messages (``"rope_scaling"``, or the config.json key).
    Raises ValueError for an unsupported type, an unknown, missing or bad parameter, or a
    ``partial_rotary_factor`` other than 1.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"{where} must be a dict or None, got {scaling!r}")
    params = dict(scaling)
    kind = params.pop("rope_type", None)
    legacy = params.pop("type", None)
    if kind is None:
        kind = legacy
    elif legacy is not None and legacy != kind:
        raise ValueError(f"{where} has rope_type {kind!r} but type {legacy!r}")
    kind = "default" if kind is None else kind
    if kind not in _ROPE_KEYS:
        raise ValueError(
            f"{where} type {kind!r} is not supported: radixkv implements RoPE types "
            f"{tuple(_ROPE_KEYS)} (rope_scaling type must be one of {ROPE_TYPES})"
        )
    partial = params.pop("partial_rotary_factor", None)
    if partial is not None and partial != 1:
        raise ValueError(
            f"{where} partial_rotary_factor={partial!r} is not supported: radixkv rotates the "
            "whole head"
        )
    allowed = _ROPE_KEYS[kind]
    unknown = sorted(k for k in params if k not in allowed)
    if unknown:
        raise ValueError(
            f"{where} key(s) {unknown} are not supported for RoPE type {kind!r} "
            f"(it takes {list(allowed)})"
        )
    missing = [k for k in _ROPE_REQUIRED[kind] if params.get(k) is None]
    if missing:
        raise ValueError(f"{where} of type {kind!r} lacks {missing}")
    out: dict[str, Any] = {}
    for key in allowed:
        value = params.get(key)
        if value is None:
            continue
        if key in _ROPE_BOOL_KEYS:
            if not isinstance(value, bool):
                raise ValueError(f"{where} {key} must be a bool, got {value!r}")
        elif key in _ROPE_INT_KEYS:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            _check_positive(f"{where} {key}", value)
        else:
            bad = isinstance(value, bool) or not isinstance(value, (int, float))
            if bad or not math.isfinite(value) or value < 0:
                raise ValueError(f"{where} {key} must be a non-negative number, got {value!r}")
            value = float(value)
        out[key] = value
    if kind == "default":
        return None
    if out["factor"] <= 0:
        raise ValueError(f"{where} factor must be positive, got {out['factor']}")
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ValueError(
            f"{where} high_freq_factor ({out['high_freq_factor']}) must exceed "
            f"low_freq_factor ({out['low_freq_factor']})"
        )
    return {"rope_type": kind, **out}


def _rope_from_hf(hf: Mapping[str, Any], family: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of a config.json in either transformers form.

    5.x holds everything in ``rope_parameters``; 4.x has a top-level ``rope_theta`` and an
    optional ``rope_scaling``. A config holding both must have them agree (a conflict is
    refused, not resolved silently). Like transformers,
    ``original_max_position_embeddings`` of llama3 and yarn falls back to (and a top-level one
    overrides) the rope dict's, and a yarn ``factor`` of null means max / original positions.
    """
    top_theta = hf.get("rope_theta")
    top_partial = hf.get("partial_rotary_factor")
    max_positions = hf.get(
        "max_position_embeddings", _HF_DEFAULTS[family]["max_position_embeddings"]
    )
    readings: list[tuple[str, float, dict[str, Any] | None]] = []
    for key in ("rope_parameters", "rope_scaling"):
        raw = hf.get(key)
        if raw is None:
            continue
        if not isinstance(raw, Mapping):
            raise ValueError(f"config.json {key} must be an object or null, got {raw!r}")
        nested = sorted(k for k, v in raw.items() if isinstance(v, Mapping))
        if nested:
            raise ValueError(
                f"config.json {key} holds per-layer-type RoPE settings {nested}: layers of "
                "different attention types are not supported"
            )
        params = dict(raw)
        theta = params.pop("rope_theta", None)
        if theta is not None and top_theta is not None and theta != top_theta:
            raise ValueError(
                f"config.json {key} rope_theta ({theta}) and the top-level rope_theta "
                f"({top_theta}) disagree"
            )
        theta = top_theta if theta is None else theta
        if top_partial is not None:
            params.setdefault("partial_rotary_factor", top_partial)
        kind = params.get("rope_type", params.get("type"))
        if kind in ("llama3", "yarn"):
            if hf.get("original_max_position_embeddings") is not None:
                params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
            elif params.get("original_max_position_embeddings") is None:
                params["original_max_position_embeddings"] = max_positions
        if kind == "yarn" and params.get("factor") is None:
            params["factor"] = max_positions / params["original_max_position_embeddings"]
        scaling = normalize_rope_scaling(params, f"config.json {key}")
        readings.append((key, _theta(theta, key), scaling))
    if not readings:
        if top_partial is not None:
            normalize_rope_scaling({"partial_rotary_factor": top_partial}, "config.json")
        return _theta(top_theta, "rope_theta"), None
    if len(readings) == 2 and readings[0][1:] != readings[1][1:]:
        (k0, t0, s0), (k1, t1, s1) = readings
        raise ValueError(
            f"config.json {k0} (rope_theta {t0}, scaling {s0}) and {k1} (rope_theta {t1}, "
            f"scaling {s1}) disagree"
        )
    return readings[0][1], readings[0][2]


def _theta(value: Any, where: str) -> float:
    """A config.json ``rope_theta`` as a float (transformers' default 10000 when absent)."""
    if value is None:
        return 10000.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json {where} rope_theta must be a number, got {value!r}")
    return float(value)


def _check_no_sliding_window(hf: Mapping[str, Any], family: str) -> None:
    """Raises ValueError if the config makes any layer attend through a sliding window."""
    if family == "mistral":
        window = hf.get("sliding_window", 4096)  # MistralConfig's default when absent
        if window is not None:
            raise ValueError(
                f"config.json sliding_window={window} is not supported: mistral then attends "
                "to the last sliding_window tokens only, radixkv to the whole context "
                "(sliding_window must be null)"
            )
    if family in ("qwen2", "qwen3"):
        if hf.get("use_sliding_window", False):
            raise ValueError(
                "config.json use_sliding_window=true is not supported: radixkv attends to the "
                "whole context in every layer"
            )
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            other = sorted({t for t in layer_types if t != "full_attention"})
            if other:
                raise ValueError(
                    f"config.json layer_types holds {other}: only 'full_attention' layers are "
                    "supported"
                )
