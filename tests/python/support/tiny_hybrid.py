"""Tiny random hybrid models of the 8 families radixkv recognises (float32, seeded, unit-scale
logits so greedy argmax margins are wide): what the hybrid tests build their models from.
Needs transformers 5.x (the hybrid families' classes); callers skip before importing on 4.x.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import transformers

VOCAB = 97
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    # No special tokens: generate() must neither stop early nor pad.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

#: family -> (config class, model class, config fields). Key and value head sizes differ where a
#: family has both, so a state's shape pins which is which.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
        ),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            num_hidden_layers=4,
            head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
    ),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(num_hidden_layers=4, full_attn_idxs=[1, 3])),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "attention"],
            mamba_n_heads=4,
            mamba_d_state=8,
            mamba_d_head=16,
            mamba_chunk_size=8,
            num_local_experts=4,
            shared_intermediate_size=32,
        ),
    ),
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
            head_dim=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=2,
            chunk_size=8,
        ),
    ),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            num_hidden_layers=3,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_ssm=64,
            mamba_d_state=8,
            mamba_chunk_size=8,
        ),
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(
            num_hidden_layers=4,
            attn_layer_indices=[1, 3],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=8,
        ),
    ),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=2,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=8,
        ),
    ),
}


def _unit_scale(model: Any, seed: int = 0) -> Any:
    """Redraws the model's linear weights N(0, 1/fan_in) and its embeddings N(0, 1) (its
    SSM-specific vectors, convolutions and norms keep transformers' init), so that logits have
    unit scale and greedy argmax margins are wide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model.eval()


def build(
    family: str, dtype: torch.dtype = torch.float32, device: str = "cpu", **overrides: Any
) -> Any:
    """The tiny ``family`` model (``overrides``: config fields to change, such as a larger
    ``hidden_size`` for a benchmark)."""
    config_cls, model_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **fields, **overrides})
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config).to(dtype)
    return model.eval() if device == "meta" else _unit_scale(model)


_shared: dict[str, Any] = {}


def shared(family: str) -> Any:
    """The float32 CPU tiny ``family`` model, built once per process for the tests that share
    it (each leaves it as it found it: hooks removed, weights untouched)."""
    if family not in _shared:
        _shared[family] = build(family)
    return _shared[family]
