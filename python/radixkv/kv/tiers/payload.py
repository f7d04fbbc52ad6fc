"""A page's payload: every layer's K and V of one pool page as bytes, and back into a pool.

The disk tier writes it after each slot's header (:mod:`.page`), the shared tier after each
value's; both make it and scatter it with these functions, so the two agree byte for byte::

    payload = K[0] V[0] K[1] V[1] ... K[L-1] V[L-1]     each [page_size, num_kv_heads, head_dim]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: The layout of a page's payload, recorded in the fingerprint pages are checked against.
PAGE_LAYOUT = "layer-major: K[l] then V[l], each [page_size, num_kv_heads, head_dim]"


def page_payload(kv: Any, k: list[torch.Tensor], v: list[torch.Tensor], page: int) -> np.ndarray:
    """Every layer's K and V of ``page`` of the pools ``k``/``v`` of ``kv`` (a ``KVCache``), as
    one fresh uint8 array laid out as :data:`PAGE_LAYOUT` says."""
    p = kv.page_size
    a, b = page * p, (page + 1) * p
    parts = [t for layer in range(kv.num_layers) for t in (k[layer][a:b], v[layer][a:b])]
    out = torch.stack(parts)
    if out.device.type != "cpu":
        out = out.cpu()
    return out.contiguous().view(torch.uint8).numpy().reshape(-1).copy()


def page_payloads(
    kv: Any, k: list[torch.Tensor], v: list[torch.Tensor], pages: Sequence[int]
) -> np.ndarray:
    """Every layer's K and V of each of ``pages`` of the pools ``k``/``v`` of ``kv``, as one
    fresh uint8 array ``[len(pages), page bytes]`` whose row ``i`` is
    ``page_payload(kv, k, v, pages[i])``: gathered on the pools' device (one ``index_select``
    per layer and K/V) and copied to the host once, not once per page."""
    p, n = kv.page_size, len(pages)
    if n == 0:
        return np.zeros((0, 0), np.uint8)
    idx = torch.as_tensor(list(pages), dtype=torch.long, device=k[0].device)
    shape = (-1, p, kv.num_kv_heads, kv.head_dim)
    parts = [
        t.view(shape).index_select(0, idx)
        for layer in range(kv.num_layers)
        for t in (k[layer], v[layer])
    ]
    out = torch.stack(parts, dim=1)  # [pages, 2 * layers, page, heads, dim]
    if out.device.type != "cpu":
        out = out.cpu()
    return out.contiguous().view(torch.uint8).numpy().reshape(n, -1)


def scatter_payload(
    kv: Any, payload: np.ndarray, k: list[torch.Tensor], v: list[torch.Tensor], page: int
) -> None:
    """Writes ``payload`` (as :func:`page_payload` made it) into ``page`` of the pools
    ``k``/``v`` of ``kv`` (a ``KVCache``)."""
    p = kv.page_size
    arr = torch.from_numpy(np.require(payload, requirements=["C", "W"]))
    pages = arr.view(kv.dtype).view(kv.num_layers, 2, p, kv.num_kv_heads, kv.head_dim)
    a, b = page * p, (page + 1) * p
    for layer in range(kv.num_layers):
        k[layer][a:b].copy_(pages[layer, 0])
        v[layer][a:b].copy_(pages[layer, 1])
