"""`Step`: one planned forward pass, and attention over cached prefixes through SDPA.

Request ``b`` of a step computes its tokens ``num_computed..num_tokens``; they sit in the packed
batch at rows ``q_start[b]..q_start[b+1]`` and attend to keys ``0..=pos`` of their own request:

```text
  keys of b:     [ cached / computed earlier ........ | new tokens ]   kv_len[b] = num_tokens
                 0                             num_computed
  query at pos:  sees keys 0..=pos                   (bottom-right aligned causal mask)
```

SDPA takes a dense batch, so queries are padded to ``[B, Hq, max_q_len, D]`` and keys gathered
from the pool to ``[B, Hkv, max_kv_len, D]``. A padded query row repeats its request's last
query (so no row is fully masked) and is dropped from the output. The mask depends only on
positions and lengths, so it is built once per step and shared by every layer. Decode steps
need no ``[T, L]`` mask: a ``[B, 1, 1, L]`` padding mask, or none when all lengths are equal;
a lone fresh prefill uses SDPA's own ``is_causal``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    import radixkv

_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
#: SDPA broadcasts KV heads over query groups itself from torch 2.5 on.
_SDPA_GQA = _VERSION >= (2, 5)


class Pool(Protocol):
    """What a step needs of its :class:`~radixkv.KVCache`: the pools and their shape."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def gather_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch tensors of ``rows`` slot rows each for the gathered K and V."""
        ...


class Step:
    """One forward pass planned by :meth:`KVCache.plan`. Tensors are on ``kv.device``.

    Attributes: ``input_ids``, ``positions``, ``write_slots`` (LongTensor ``[T]``),
    ``last_token_index`` and ``kv_len`` (``[B]``), ``kv_slots`` (``[B, max_kv_len]``, padded with
    slot 0), ``requests``, ``q_len_list`` and ``kv_len_list`` (Python ints), ``num_tokens`` (T),
    ``max_q_len``, ``max_kv_len``.

    Safety rule: a step is valid until :meth:`KVCache.commit` or until any of its requests is
    extended, finished or aborted; plan a new one after that.
    """

    def __init__(self, kv: Pool, requests: list[radixkv.Request], plan: dict[str, Any]) -> None:
        self.kv = kv
        self.requests = requests
        q_start: np.ndarray = plan["q_start"]
        kv_len: np.ndarray = plan["kv_len"]
        q_len = np.diff(q_start)
        b = len(requests)
        self.num_tokens = int(q_start[-1])
        self.max_q_len = int(plan["max_q_len"])
        self.max_kv_len = int(plan["max_kv_len"])
        self.q_len_list: list[int] = q_len.tolist()
        self.kv_len_list: list[int] = kv_len.tolist()
        self.is_decode = self.max_q_len == 1
        # A lone request with nothing cached is a plain causal prefill over its own new keys.
        self.is_fresh_prefill = b == 1 and self.q_len_list[0] == self.kv_len_list[0]
        self._pad = b > 1 and not self.is_decode

        parts = [
            plan["input_ids"],
            plan["positions"],
            plan["write_slots"],
            plan["last_token_index"],
            kv_len,
            plan["kv_slots"].reshape(-1),
        ]
        if self._pad:
            # Packed row of query i of request b; past q_len[b], the request's last row again.
            i = np.arange(self.max_q_len)
            last = q_len[:, None] - 1
            parts.append((q_start[:-1, None] + np.minimum(i[None, :], last)).reshape(-1))
            parts.append(np.flatnonzero(i[None, :] <= last))
        # One host-to-device copy for every index array of the step.
        flat = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))
        flat = flat.to(kv.device)
        t = self.num_tokens
        sizes = [t, t, t, b, b, b * self.max_kv_len]
        if self._pad:
            sizes += [b * self.max_q_len, t]
        views = torch.split(flat, sizes)
        self.input_ids, self.positions, self.write_slots = views[0], views[1], views[2]
        self.last_token_index, self.kv_len = views[3], views[4]
        self.kv_slots = views[5].view(b, self.max_kv_len)
        self._q_index = views[6].view(b, self.max_q_len) if self._pad else None
        self._unpad_index = views[7] if self._pad else None
        self.attn_mask = self._build_mask()

    def _build_mask(self) -> torch.Tensor | None:
        """Additive ``[B, 1, Q, L]`` mask in the pool dtype (0 = attend, -inf = not), or None
        where no mask is needed. Built from positions and lengths once per step: handing SDPA
        a float mask spares it converting a boolean one again in every layer."""
        if self.is_fresh_prefill:
            return None  # is_causal=True
        keys = torch.arange(self.max_kv_len, device=self.kv.device)
        if self.is_decode:
            # The one query of each request is its last token: it sees all of its keys.
            if len(set(self.kv_len_list)) == 1:
                return None
            allowed = (keys < self.kv_len[:, None]).view(len(self.requests), 1, 1, -1)
        else:
            q_pos = self.positions[self._q_index] if self._pad else self.positions.view(1, -1)
            allowed = (keys <= q_pos[:, :, None]).unsqueeze(1)
        bias = torch.zeros(allowed.shape, dtype=self.kv.dtype, device=self.kv.device)
        return bias.masked_fill_(~allowed, float("-inf"))

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Writes ``k``/``v`` (``[T, Hkv, D]``) into the pool at the new tokens' slots, then
        attends each query of ``q`` (``[T, Hq, D]``) to its request's keys up to its own
        position. Returns ``[T, Hq, D]`` in ``q``'s dtype.

        ``layer`` must be an int in ``[0, num_layers)``; ``q``, ``k`` and ``v`` floating-point
        torch tensors (``TypeError`` otherwise, raised before anything is written).
        """
        kv = self.kv
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer must be an int, got {type(layer).__name__} {layer!r}")
        if not 0 <= layer < kv.num_layers:
            raise ValueError(f"layer must be in [0, {kv.num_layers}), got {layer}")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if not x.is_floating_point():
                raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        t, hkv, d = self.num_tokens, kv.num_kv_heads, kv.head_dim
        if q.dim() != 3 or q.shape[0] != t or q.shape[2] != d or q.shape[1] % hkv != 0:
            raise ValueError(
                f"q must be [T={t}, Hq, D={d}] with Hq a multiple of {hkv}, got {tuple(q.shape)}"
            )
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != (t, hkv, d):
                raise ValueError(f"{name} must be [{t}, {hkv}, {d}], got {tuple(x.shape)}")
        pool_k, pool_v = kv.k[layer], kv.v[layer]
        k, v = k.to(pool_k.dtype), v.to(pool_v.dtype)
        pool_k.index_copy_(0, self.write_slots, k)
        pool_v.index_copy_(0, self.write_slots, v)
        out_dtype = q.dtype
        q = q.to(pool_k.dtype)
        b, hq = len(self.requests), q.shape[1]

        if self.is_fresh_prefill:
            # The keys are exactly the new tokens: no gather, top-left causal is right here.
            qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            o = _sdpa(qh, kh, vh, None, True, scale)
            return o[0].transpose(0, 1).to(out_dtype)
        keys, values = self._gather(pool_k, pool_v)  # [B, Hkv, L, D] views
        if self.is_decode:
            qb = q.view(b, 1, hq, d)  # T == B: one query per request
        elif self._pad:
            qb = q.index_select(0, self._q_index.view(-1)).view(b, self.max_q_len, hq, d)
        else:
            qb = q.unsqueeze(0)
        o = _sdpa(qb.transpose(1, 2), keys, values, self.attn_mask, False, scale)
        o = o.transpose(1, 2)  # [B, Q, Hq, D]
        if self._pad:
            o = o.reshape(b * self.max_q_len, hq, d).index_select(0, self._unpad_index)
        else:
            o = o.reshape(t, hq, d)
        return o.to(out_dtype)

    def _gather(self, pool_k: torch.Tensor, pool_v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every request's K and V as ``[B, Hkv, L, D]`` views of token-major copies, gathered
        with one ``index_select`` each (whole slot rows; far faster than advanced indexing)
        into buffers reused across layers. A head-major gather, which hands SDPA contiguous
        heads, measured no better overall on CPU (faster at Hkv=2, D=64; slower at 8, 128)."""
        kv = self.kv
        hkv, d = kv.num_kv_heads, kv.head_dim
        b, length = self.kv_slots.shape
        buf_k, buf_v = kv.gather_buffers(b * length)
        flat = self.kv_slots.view(-1)
        keys = torch.index_select(pool_k, 0, flat, out=buf_k).view(b, length, hkv, d)
        values = torch.index_select(pool_v, 0, flat, out=buf_v).view(b, length, hkv, d)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def __repr__(self) -> str:
        return (
            f"Step(requests={len(self.requests)}, tokens={self.num_tokens}, "
            f"max_q_len={self.max_q_len}, max_kv_len={self.max_kv_len})"
        )


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """SDPA over head-major ``[B, H, S, D]`` inputs, KV heads shared by query groups."""
    group = q.shape[1] // k.shape[1]
    if group > 1 and not _SDPA_GQA:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    kwargs = {"enable_gqa": True} if group > 1 and _SDPA_GQA else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **kwargs
    )
