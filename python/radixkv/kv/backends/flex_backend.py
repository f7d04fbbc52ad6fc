"""The flex backend: compiled ``flex_attention`` over the pool in place (decode groups)."""

from __future__ import annotations

from typing import Any

import torch

from radixkv.kv.backends.group import Group, Step, batch_bucket

#: Most flex compiles per process (batch buckets x pools x dtypes); past it ``flex`` raises
#: instead of letting torch fall back to its uncompiled path (~200x slower) without a word.
MAX_FLEX_COMPILES = 32
#: Fewest query rows of a block in CUDA's flex decoding kernel (its smallest tile).
FLEX_CUDA_MIN_ROWS = 16


_compiled_flex: Any = None
_flex_keys: set[tuple[Any, ...]] = set()


def _flex_fn() -> Any:
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # Room for every bucket we allow ourselves (MAX_FLEX_COMPILES), so torch never reaches
        # its own limit, where it would silently run flex uncompiled.
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, MAX_FLEX_COMPILES + 8)
        cfg.accumulated_recompile_limit = max(
            cfg.accumulated_recompile_limit, MAX_FLEX_COMPILES + 8
        )
        _compiled_flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled_flex


class _Holder:
    """The step tensors the mask function reads: replaced before every call, the function kept
    (a mask function made anew each step would recompile)."""

    p2l: torch.Tensor
    seq: torch.Tensor
    page_size: int = 1
    #: ``[1]`` int32: the sliding window in keys (``NO_WINDOW``: none); ``[1]`` float32: the
    #: softcap of ``_softcap_mod``.
    window: torch.Tensor
    softcap: torch.Tensor


_HOLDER = _Holder()
#: ``_HOLDER.window`` without a sliding window: more keys than any pool holds.
NO_WINDOW = 2**30


def _mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Key ``kv_idx`` (a pool slot) is visible to request ``b`` when its page is one of ``b``'s
    and its position ``j`` is below ``b``'s length ``n`` and inside the window of the query at
    ``n - 1`` (``n - 1 - window < j``)."""
    p = _HOLDER.page_size
    lp = _HOLDER.p2l[b, kv_idx // p]
    pos = lp * p + kv_idx % p
    n = _HOLDER.seq[b]
    return (lp >= 0) & (pos < n) & (pos >= n - _HOLDER.window[0])


def _softcap_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """Gemma 2's logit softcapping of a scaled score: ``softcap * tanh(score / softcap)``."""
    c = _HOLDER.softcap[0]
    return torch.tanh(score / c) * c


class FlexBackend:
    """Decode through compiled ``flex_attention`` over the pool in place, GQA folded.

    Query ``[Bb, Hkv, G, D]`` (``Bb`` the batch bucket) against the whole pool viewed as
    ``[1, Hkv, S, D]``; one KV block per page, so a request's block list is its page table: full
    pages need no mask, the last (partial) page is masked by position. The mask function also
    excludes every page not in the request's table (``p2l``: page -> logical page, -1 when not
    the request's), so the mask is right even where block sparsity is not applied.

    A sliding window narrows each request's block list to the pages its query reads (the first
    one masked where the window starts inside it), so a window layer reads ``window + P`` keys
    however long the context; softcapping is a score modification and sinks rescale the output
    by the log-sum-exp flex returns (``o * sigmoid(lse - sink)``, CUDA only), so every layer of
    Gemma 2, Gemma 3, Mistral and Cohere2 (and of gpt-oss on CUDA) decodes through flex.
    """

    name = "flex"
    static_decode = False
    window_pool = False

    def supports(
        self, window: int | None, softcap: float | None, sinks: torch.Tensor | None
    ) -> bool:
        """Whether :meth:`attend` takes these (flex serves decode groups only): a window and a
        softcap everywhere, sinks on CUDA (they need the log-sum-exp, which compiled flex on
        the CPU does not return)."""
        return sinks is None or self.kv.device.type == "cuda"

    def __init__(self, kv: Any) -> None:
        self.kv = kv
        #: Batch buckets this pool has compiled.
        self.compiled: set[int] = set()

    def ensure(self, bucket: int, heads: int, variant: tuple[bool, bool] = (False, False)) -> None:
        """Counts the compile that ``bucket`` with ``heads`` query heads needs (one per distinct
        shape, dtype and device in the process, and ``variant``: softcap, sinks); raises past
        ``MAX_FLEX_COMPILES``."""
        kv = self.kv
        key = (
            bucket,
            heads,
            variant,
            kv.num_kv_heads,
            kv.head_dim,
            kv.page_size,
            kv.num_slots,
            kv.dtype,
            str(kv.device),
        )
        if key not in _flex_keys:
            if len(_flex_keys) >= MAX_FLEX_COMPILES:
                raise RuntimeError(
                    f"flex attention would compile variant {len(_flex_keys) + 1} (batch bucket "
                    f"{bucket}), past MAX_FLEX_COMPILES={MAX_FLEX_COMPILES}; use "
                    "attention='sdpa' or 'auto' for this pool"
                )
            _flex_keys.add(key)
        self.compiled.add(bucket)

    def prepare(self, step: Step, g: Group) -> None:
        kv = self.kv
        dev, p, num_pages = kv.device, kv.page_size, kv.num_pages
        b = len(g.req)
        bb = batch_bucket(b)
        seq = torch.zeros(bb, dtype=torch.int32, device=dev)
        seq[:b] = g.seq_lens
        bt = g.block_table.long()
        n_pages = (g.seq_lens + (p - 1)) // p  # [b]
        # Page -> logical page of each request (-1: not its page); padding goes to a spare
        # column past the pool.
        cols = torch.arange(bt.shape[1], device=dev)
        valid = cols[None, :] < n_pages[:, None]
        target = torch.where(valid, bt, num_pages)
        p2l = torch.full((bb, num_pages + 1), -1, dtype=torch.int32, device=dev)
        p2l[:b].scatter_(1, target, cols.to(torch.int32).expand(b, -1).contiguous())
        g.state = {"p2l": p2l, "seq": seq, "bucket": bb, "masks": {}}

    def _kv_blocks(self, g: Group, window: int | None) -> tuple[torch.Tensor, ...]:
        """Each request's block lists: the full pages its query reads (no mask), then the
        partial ones (masked): the page the window starts inside, and the last page."""
        kv = self.kv
        dev, p, num_pages = kv.device, kv.page_size, kv.num_pages
        b, bb = len(g.req), g.state["bucket"]
        bt = g.block_table.long()
        seq = g.seq_lens.long()
        n_full = seq // p
        start = (seq - window).clamp(min=0) if window else torch.zeros_like(seq)
        lo = start // p  # the first page the query reads
        first_full = lo + (start % p != 0).long()
        cols = torch.arange(bt.shape[1], device=dev)
        last_col = bt.shape[1] - 1
        full_num = torch.zeros(bb, 1, 1, dtype=torch.int32, device=dev)
        full_num[:b, 0, 0] = (n_full - first_full).clamp(min=0).to(torch.int32)
        full_idx = torch.zeros(bb, 1, 1, num_pages, dtype=torch.int32, device=dev)
        shifted = (first_full[:, None] + cols[None, :]).clamp(max=last_col)
        full_idx[:b, 0, 0, : bt.shape[1]] = bt.gather(1, shifted).to(torch.int32)
        has_lo = (start % p != 0) & (lo < n_full)
        has_last = seq % p != 0
        lo_page = bt.gather(1, lo.clamp(max=last_col)[:, None])[:, 0]
        last_page = bt.gather(1, n_full.clamp(max=last_col)[:, None])[:, 0]
        part_num = torch.zeros(bb, 1, 1, dtype=torch.int32, device=dev)
        part_num[:b, 0, 0] = (has_lo.long() + has_last.long()).to(torch.int32)
        part_idx = torch.zeros(bb, 1, 1, num_pages, dtype=torch.int32, device=dev)
        part_idx[:b, 0, 0, 0] = torch.where(has_lo, lo_page, last_page).to(torch.int32)
        part_idx[:b, 0, 0, 1 % num_pages] = last_page.to(torch.int32)
        return part_num, part_idx, full_num, full_idx

    def _block_mask(self, g: Group, rows: int, window: int | None = None) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        masks = g.state["masks"]
        key = (rows, window)
        if key not in masks:
            part_num, part_idx, full_num, full_idx = self._kv_blocks(g, window)
            masks[key] = BlockMask.from_kv_blocks(
                part_num,
                part_idx,
                full_num,
                full_idx,
                BLOCK_SIZE=(rows, self.kv.page_size),
                mask_mod=_mask_mod,
                seq_lengths=(rows, self.kv.num_slots),
            )
        return masks[key]

    def attend(
        self,
        step: Step,
        g: Group,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        scale: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv = self.kv
        b, hq, d = q.shape
        hkv = kv.num_kv_heads
        group = hq // hkv
        bb = g.state["bucket"]
        qb = q.view(b, hkv, group, d)
        # CUDA's flex decoding kernel takes query blocks of at least 16 rows: a KV head's
        # query heads padded with zero rows (their outputs dropped).
        rows = group if kv.device.type != "cuda" else max(group, FLEX_CUDA_MIN_ROWS)
        if rows != group:
            qb = torch.cat([qb, qb.new_zeros(b, hkv, rows - group, d)], dim=2)
        if bb != b:
            qb = torch.cat([qb, qb.new_zeros(bb - b, hkv, rows, d)])
        keys = kv.k[layer].permute(1, 0, 2).unsqueeze(0)
        values = kv.v[layer].permute(1, 0, 2).unsqueeze(0)
        self.ensure(bb, hq, (softcap is not None, sinks is not None))
        mask = self._block_mask(g, rows, window)
        # This step's tensors, for the mask function (its holder outlives steps).
        _HOLDER.p2l, _HOLDER.seq, _HOLDER.page_size = g.state["p2l"], g.state["seq"], kv.page_size
        _HOLDER.window = torch.tensor([window or NO_WINDOW], dtype=torch.int32, device=kv.device)
        extra: dict[str, Any] = {}
        if softcap is not None:
            _HOLDER.softcap = torch.tensor([softcap], dtype=torch.float32, device=kv.device)
            extra["score_mod"] = _softcap_mod
        if sinks is None:
            o = _flex_fn()(qb, keys, values, block_mask=mask, scale=scale, **extra)
            return o[:b, :, :group].reshape(b, hq, d)
        o, lse = _flex_fn()(
            qb, keys, values, block_mask=mask, scale=scale, return_lse=True, **extra
        )
        o, lse = o[:b, :, :group], lse[:b, :, :group]
        # A sink logit s per head joins the softmax: o' = o * e^lse / (e^lse + e^s).
        keep = torch.sigmoid(lse.float() - sinks.float().view(1, hkv, group))
        return (o.float() * keep[..., None]).to(q.dtype).reshape(b, hq, d)
