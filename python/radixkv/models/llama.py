"""`CausalLM`: a Llama-style decoder (Llama, Mistral, Qwen2 and Qwen3 families) whose attention
goes through :meth:`radixkv.Step.attention`, plus a dense reference forward without any cache.

Module and parameter names follow Hugging Face checkpoints (``layers.0.self_attn.q_proj.weight``
is ``model.layers.0.self_attn.q_proj.weight`` there), so loading is a rename of the prefix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixkv.models.config import ModelConfig
from radixkv.models.layers import (
    RMSNorm,
    Rotary,
    SwiGLU,
    all_reduce,
    apply_rotary,
    dense_causal_attention,
)

if TYPE_CHECKING:
    import radixkv
    from radixkv.kv.kv_cache import KVCache
    from radixkv.kv.step import StepLike

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
        #: Tensor parallelism: this module holds a slice of the heads (``num_heads`` and
        #: ``num_kv_heads`` are the slice's) and ``o_proj`` the matching input columns, so its
        #: output is a partial sum, all-reduced over this group. ``None``: not sharded.
        self.tp_group: object | None = None

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
        out = self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
        if self.tp_group is not None:
            all_reduce(out, self.tp_group)
        return out


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
        #: This model's place in a tensor-parallel group (see :meth:`shard`): rank, world size.
        self.tp_rank, self.tp_size = 0, 1

    def shard(self, rank: int, world_size: int, group: object | None = None) -> CausalLM:
        """Rank ``rank``'s shard of this model for tensor parallelism over ``world_size`` ranks
        (Megatron-style): q/k/v and gate/up are column-parallel (this rank keeps heads
        ``[rank * H / w, (rank + 1) * H / w)`` of the query and KV heads, and the matching slice
        of the intermediate features), o and down are row-parallel (the matching input columns;
        their outputs are summed over ``group`` with an all-reduce, their biases added once, by
        rank 0). Embeddings, norms and the head are replicated (shared with this model, not
        copied), so every rank computes the same logits. :meth:`make_kv_cache` of the shard
        sizes its KV heads to the slice.

        ``group``: the ``torch.distributed`` process group of the ranks (default: the default
        group), used at every forward; every rank must run the same forwards. Raises
        ``ValueError`` unless ``0 <= rank < world_size`` and the query heads, KV heads and
        intermediate size all divide by ``world_size``. ``world_size=1`` gives a model equal to
        this one (sharing its weights)."""
        for name, v in (("rank", rank), ("world_size", world_size)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an int, got {v!r}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, "
                f"world_size={world_size}"
            )
        if self.tp_size != 1:
            raise ValueError(f"this model is a shard already (world size {self.tp_size})")
        cfg = self.config
        for name, n in (
            ("num_heads", cfg.num_heads),
            ("num_kv_heads", cfg.num_kv_heads),
            ("intermediate_size", cfg.intermediate_size),
        ):
            if n % world_size:
                raise ValueError(
                    f"{name}={n} must divide by world_size={world_size} for a head-sharded model"
                )
        with torch.device("meta"):
            out = CausalLM(cfg)
        out.embed_tokens, out.norm, out.rotary = self.embed_tokens, self.norm, self.rotary
        out.lm_head = self.lm_head
        out.tp_rank, out.tp_size = rank, world_size
        tp_group = (group if group is not None else True) if world_size > 1 else None
        d = _head_dim(cfg)
        hq, hkv = cfg.num_heads // world_size, cfg.num_kv_heads // world_size
        inter = cfg.intermediate_size // world_size
        q_rows = slice(rank * hq * d, (rank + 1) * hq * d)
        kv_rows = slice(rank * hkv * d, (rank + 1) * hkv * d)
        mlp_rows = slice(rank * inter, (rank + 1) * inter)
        for src, dst in zip(self.layers, out.layers):
            dst.input_layernorm = src.input_layernorm
            dst.post_attention_layernorm = src.post_attention_layernorm
            a, b = cast(Attention, src.self_attn), cast(Attention, dst.self_attn)
            b.q_norm, b.k_norm = a.q_norm, a.k_norm
            b.q_proj = _columns(a.q_proj, q_rows)
            b.k_proj = _columns(a.k_proj, kv_rows)
            b.v_proj = _columns(a.v_proj, kv_rows)
            b.o_proj = _rows(a.o_proj, q_rows, keep_bias=rank == 0)
            b.num_heads, b.num_kv_heads, b.tp_group = hq, hkv, tp_group
            mlp, part = cast(SwiGLU, src.mlp), cast(SwiGLU, dst.mlp)
            part.gate_proj = _columns(mlp.gate_proj, mlp_rows)
            part.up_proj = _columns(mlp.up_proj, mlp_rows)
            part.down_proj = _rows(mlp.down_proj, mlp_rows, keep_bias=rank == 0)
            part.tp_group = tp_group
        return out.eval()

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

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """``(layers, KV heads, head dim)`` of the KV this model writes and reads (of a shard
        (:meth:`shard`): its slice of the KV heads): what :meth:`make_kv_cache` sizes and
        :class:`radixkv.Engine` checks its ``KVCache`` against."""
        heads = cast(Attention, self.layers[0].self_attn).num_kv_heads
        return self.config.num_layers, heads, _head_dim(self.config)

    def make_kv_cache(
        self,
        cache: radixkv.Cache,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        host_device: str | torch.device | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        on_mismatch: str = "error",
        attention: str = "auto",
    ) -> KVCache:
        """A :class:`radixkv.KVCache` shaped for this model (its dtype and device by default,
        ``attention`` its backend);
        for a shard (:meth:`shard`), for its slice of the KV heads. A cache with a host tier
        (``host_pages > 0``) gets its host pools on ``host_device``, the CPU by default; one
        with a disk tier (``disk_pages > 0``) its disk pool in ``disk_dir``, fingerprinted with
        this model (:func:`radixkv.kv.tiers.fingerprint.model_fingerprint`: config and weights)."""
        from radixkv.kv.kv_cache import KVCache
        from radixkv.kv.tiers.fingerprint import model_fingerprint

        p = self.embed_tokens.weight
        layers, kv_heads, head_dim = self.kv_shape  # of a shard: its slice of the KV heads
        return KVCache(
            cache,
            layers,
            kv_heads,
            head_dim,
            dtype=dtype or p.dtype,
            device=device or p.device,
            host_device=host_device or ("cpu" if cache.host_pages else None),
            disk_dir=disk_dir,
            fingerprint=model_fingerprint(self) if disk_dir is not None else None,
            on_mismatch=on_mismatch,
            attention=attention,
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
    def forward(self, step: StepLike, all_logits: bool = False) -> torch.Tensor:
        """Float32 logits ``[B, vocab]`` of each request's last planned token, or ``[T, vocab]``
        of every planned token with ``all_logits``. Writes the step's K/V into the pool."""
        attends = [
            (lambda q, k, v, i=i: step.attention(i, q, k, v, self.scale))
            for i in range(len(self.layers))
        ]
        x = self._run(step.input_ids, step.positions, attends)
        # A decode step's rows are its requests' last tokens, in order: no gather.
        return self._logits(x if all_logits or step.is_decode else x[step.last_token_index])

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


def _columns(layer: nn.Linear, rows: slice) -> nn.Linear:
    """A column-parallel slice of ``layer``: output features ``rows`` (weight rows and bias)."""
    w = layer.weight.detach()[rows]
    out = nn.Linear(w.shape[1], w.shape[0], bias=layer.bias is not None, device="meta")
    out.weight = nn.Parameter(w.clone(), requires_grad=False)
    if layer.bias is not None:
        out.bias = nn.Parameter(layer.bias.detach()[rows].clone(), requires_grad=False)
    return out


def _rows(layer: nn.Linear, cols: slice, keep_bias: bool) -> nn.Linear:
    """A row-parallel slice of ``layer``: input features ``cols``; the bias kept on one rank
    only (zero elsewhere), so that the all-reduced sum adds it once."""
    w = layer.weight.detach()[:, cols]
    out = nn.Linear(w.shape[1], w.shape[0], bias=layer.bias is not None, device="meta")
    out.weight = nn.Parameter(w.clone(), requires_grad=False)
    if layer.bias is not None:
        b = layer.bias.detach().clone()
        out.bias = nn.Parameter(b if keep_bias else torch.zeros_like(b), requires_grad=False)
    return out
