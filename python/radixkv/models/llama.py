"""`CausalLM`: a Llama-style decoder (Llama, Mistral, Qwen2 and Qwen3 families) whose attention
goes through :meth:`radixkv.Step.attention`, plus a dense reference forward without any cache.

Module and parameter names follow Hugging Face checkpoints (``layers.0.self_attn.q_proj.weight``
is ``model.layers.0.self_attn.q_proj.weight`` there), so loading is a rename of the prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixkv.models.config import ModelConfig
from radixkv.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary, dense_causal_attention

if TYPE_CHECKING:
    import radixkv
    from radixkv.kv.kv_cache import KVCache
    from radixkv.kv.step import Step

#: ``attend(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]`` for one layer.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _head_dim(cfg: ModelConfig) -> int:
    """``cfg.head_dim``, which ModelConfig always fills in (None only before validation)."""
    assert cfg.head_dim is not None
    return cfg.head_dim


class Attention(nn.Module):
    """Grouped-query self-attention: projections (q/k norms where the config has them) and
    RoPE here, the attention itself in ``attend`` (paged with a cache, or dense)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = _head_dim(cfg)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=bool(cfg.qkv_bias))
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bool(cfg.qkv_bias))
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bool(cfg.qkv_bias))
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=bool(cfg.o_bias))
        # Qwen3: RMSNorm over each head of q and k, before RoPE.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        o = attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bool(cfg.mlp_bias))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """One block over the packed tokens ``x [T, hidden]``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """A Llama-style causal language model (RMSNorm, RoPE, GQA, SwiGLU, tied or untied head).

    ``model(step)`` runs one planned step through the paged KV cache and returns the logits of
    each request's last token; ``model.forward_dense(tokens)`` recomputes a whole sequence with
    plain causal attention and no cache, as the reference the cached path must match.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(_head_dim(cfg), cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.scale = 1.0 / math.sqrt(_head_dim(cfg))

    @classmethod
    def random(
        cls,
        cfg: ModelConfig | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> CausalLM:
        """A model with random weights drawn from ``seed`` (the same on every device).

        Linear weights are N(0, 1/fan_in) so activations and logits keep unit scale: attention is
        far from uniform and greedy argmax margins are wide, which keeps cached-vs-dense
        comparisons meaningful. Norm weights and biases are perturbed too, so that loading tests
        notice a missing one.
        """
        cfg = cfg or ModelConfig()
        gen = torch.Generator().manual_seed(seed)
        model = cls(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
                elif name.endswith("bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                elif name == "embed_tokens.weight":
                    p.copy_(torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        return model.to(device=device, dtype=dtype).eval()

    def make_kv_cache(
        self,
        cache: radixkv.RadixCache | radixkv.BlockCache,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
    ) -> KVCache:
        """A :class:`radixkv.KVCache` shaped for this model (its dtype and device by default)."""
        from radixkv.kv.kv_cache import KVCache

        p = self.embed_tokens.weight
        cfg = self.config
        return KVCache(
            cache,
            cfg.num_layers,
            cfg.num_kv_heads,
            _head_dim(cfg),
            dtype=dtype or p.dtype,
            device=device or p.device,
        )

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, attends: Sequence[Attend]):
        x = self.embed_tokens(ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, attend in zip(self.layers, attends):
            x = layer(x, cos, sin, attend)
        return x

    @torch.inference_mode()
    def forward(self, step: Step, all_logits: bool = False) -> torch.Tensor:
        """Float32 logits ``[B, vocab]`` of each request's last planned token, or ``[T, vocab]``
        of every planned token with ``all_logits``. Writes the step's K/V into the pool."""
        attends = [
            (lambda q, k, v, i=i: step.attention(i, q, k, v, self.scale))
            for i in range(len(self.layers))
        ]
        x = self._run(step.input_ids, step.positions, attends)
        return self._logits(x if all_logits else x[step.last_token_index])

    @torch.inference_mode()
    def forward_dense(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Reference: float32 logits ``[N, vocab]`` of every token of one whole sequence, with
        plain causal attention and no cache."""
        device = self.embed_tokens.weight.device
        if not isinstance(tokens, torch.Tensor):
            tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        ids = tokens.to(device=device, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("tokens must hold at least one token, got none")
        vocab = self.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
        positions = torch.arange(ids.numel(), device=device)
        attend = lambda q, k, v: dense_causal_attention(q, k, v, self.scale)  # noqa: E731
        return self._logits(self._run(ids, positions, [attend] * len(self.layers)))
