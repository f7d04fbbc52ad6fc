"""Building blocks of a Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, and the dense
causal attention that the reference forward uses."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back (as Llama and Qwen2 do)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalises ``x`` over its last dimension."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_parameters(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32 ``[head_dim // 2]``) of rotary embeddings and the factor
    that scales their ``cos``/``sin``, for plain RoPE (``scaling`` None) or a ``scaling`` of
    type ``linear``, ``llama3`` or ``yarn`` (parameters as in transformers' RoPE utilities).

    Plain RoPE turns pair ``i`` by ``theta ** (-2i / head_dim)`` per position; ``linear``
    divides every frequency by ``factor``; ``llama3`` divides the low frequencies only, blending
    smoothly between two wavelength limits; ``yarn`` blends interpolated and original
    frequencies over a ramp of dimensions and scales ``cos``/``sin`` by an attention factor.
    """
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv, 1.0
    assert scaling is not None
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band
        # between the two wavelength limits interpolated smoothly.
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        slowed = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * slowed / factor + smooth * slowed
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, slowed), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, factor, scaling)
    raise ValueError(f"rope_scaling type must be linear, llama3 or yarn, got {kind!r}")


def _yarn(
    head_dim: int, theta: float, factor: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: pairs rotating fewer than
    ``beta_slow`` times over the original context are interpolated (divided by ``factor``),
    those rotating more than ``beta_fast`` times kept, a linear ramp between; ``cos``/``sin``
    are scaled by ``attention_factor`` (by default ``0.1 ln(factor) + 1``)."""
    old_len = float(scaling["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        # The dimension whose pair turns `rotations` times over `old_len` positions.
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings (float32 ``[head_dim // 2]``), see
    :func:`rope_parameters`."""
    return rope_parameters(head_dim, theta, scaling)[0]


class Rotary(nn.Module):
    """Rotary position embeddings in the half-split layout of Hugging Face Llama checkpoints.

    The frequencies stay float32 whatever the model's dtype (``model.to(bfloat16)`` would round
    a registered buffer and shift every angle), so they are kept outside the module's buffers.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        inv, self.attention_factor = rope_parameters(head_dim, theta, scaling)
        self._inv_freq = {"cpu": inv}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``cos`` and ``sin`` of shape ``[T, 1, head_dim]`` for absolute ``positions [T]``."""
        key = str(positions.device)
        inv = self._inv_freq.get(key)
        if inv is None:
            inv = self._inv_freq[key] = self._inv_freq["cpu"].to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x [T, H, D]``: pairs ``(i, i + D/2)`` turn by the position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        #: Tensor parallelism: gate/up hold a slice of the intermediate features and down the
        #: matching input columns, so the output is a partial sum, all-reduced over this group
        #: (see :meth:`radixkv.models.CausalLM.shard`). ``None``: not sharded.
        self.tp_group: object | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the gated MLP."""
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.tp_group is not None:
            all_reduce(out, self.tp_group)
        return out


def all_reduce(x: torch.Tensor, group: object) -> None:
    """Sums ``x`` in place over the ranks of ``group`` (a ``torch.distributed`` process group;
    ``True`` stands for the default group)."""
    import torch.distributed as dist

    dist.all_reduce(x, group=None if group is True else group)  # type: ignore[arg-type]


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Reference attention of one whole sequence, no cache: ``q [N, Hq, D]``, ``k``/``v``
    ``[N, Hkv, D]`` -> ``[N, Hq, D]``. Written out (no SDPA) so that tests compare two
    independent computations; softmax in float32.
    """
    n, hq, d = q.shape
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
