"""`ModelConfig`: the shape of a Llama-style decoder, and its reading from a Hugging Face
``config.json`` (families ``llama`` and ``qwen2``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: ``model_type`` values of config.json this package can load.
FAMILIES = ("llama", "qwen2")
#: ``rope_scaling`` types supported (``None`` means plain RoPE).
ROPE_TYPES = (None, "default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU).

    The defaults are the small built-in model used by tests and the demo. ``qkv_bias`` is True
    for Qwen2 (biases on the q/k/v projections, none on o_proj); ``o_bias`` and ``mlp_bias`` are
    Llama's optional ``attention_bias``/``mlp_bias``.
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
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    family: str = "llama"

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
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                    f"({self.num_heads}) unless head_dim is given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _check_positive("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        rope_type = _rope_type(self.rope_scaling)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type must be one of {ROPE_TYPES}, got {rope_type!r}")

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads a Hugging Face ``config.json`` dict of a Llama or Qwen2 checkpoint."""
        family = hf.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"config.json model_type must be one of {FAMILIES}, got {family!r}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act must be 'silu' (SwiGLU), got {act!r}")
        if family == "qwen2" and hf.get("use_sliding_window", False):
            raise ValueError("config.json use_sliding_window=true is not supported")
        heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim"),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rope_scaling=hf.get("rope_scaling"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family == "llama" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            family=family,
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` dict describing this model."""
        out: dict[str, Any] = {
            "model_type": self.family,
            "architectures": ["LlamaForCausalLM" if self.family == "llama" else "Qwen2ForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
        }
        if self.family == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        return out


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _rope_type(scaling: dict[str, Any] | None) -> str | None:
    if scaling is None:
        return None
    return scaling.get("rope_type", scaling.get("type"))
