"""Attention backends of :class:`~radixkv.kv.step.Step`: how a group of requests attends to its
pages, one file per backend.

A step splits its requests into a *decode* group (one new token each) and a *prefill* group (the
rest); each group runs through one backend, chosen by ``KVCache(attention=...)``; a step whose
two groups get the same backend runs as one group (a mixed step in one launch where the backend
takes both kinds):

- ``"sdpa"`` (:mod:`.sdpa_backend`): gathers the group's K/V from the pool into a padded copy
  and calls ``scaled_dot_product_attention`` (cuDNN excluded on CUDA). On decode the query
  heads of each KV group are folded into rows (``[B, Hkv, G, D]``), which beats SDPA's
  ``enable_gqa`` on CPU. The reference.
- ``"triton"`` (:mod:`.triton_backend`, kernels in :mod:`.triton_kernels`): split-KV paged
  decode (a mixed step's decode rows too, beside its prefill launch) and a paged prefill
  kernel, reading the pool in place through the page table. CUDA; on the CPU under Triton's
  interpreter only (``TRITON_INTERPRET=1``), which is how the tests run it without a GPU.
- ``"flex"`` (:mod:`.flex_backend`): compiled ``flex_attention`` reading the pool in place
  (decode groups; prefill goes through ``"sdpa"``, faster there on CPU). The block mask is the
  page table itself (one KV block per page). On CUDA it needs pages of at least 16 slots.
- ``"varlen"`` (:mod:`.varlen_backend`): ``torch.nn.attention.varlen.varlen_attn`` with
  ``block_table`` (CUDA, torch >= 2.15).
- ``"flashinfer"`` (:mod:`.flashinfer_backend`): FlashInfer's paged wrappers, when the package
  is installed (CUDA only).
- ``"auto"``: per device, dtype and group kind, the choice of :mod:`.choice`, in one place,
  made once per pool when the ``KVCache`` is made.

Each backend keeps the contract of :class:`~.base.Backend` (``name``, ``supports``, ``prepare``,
``attend``); :data:`BACKENDS` names them.

Every backend takes the sliding windows, softcaps and sinks of Gemma 2/3, gpt-oss, Mistral and
Qwen2 layers it ``supports``; a layer whose extras a group's backend does not take runs that step
through SDPA. Layers whose KV lives in the window pool (``KVCache(window_layers=...)``) attend
over their window pages (a few pages a request) through the Triton kernels where the step's
backend is Triton, through SDPA otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixkv.kv.backends.base import Backend
from radixkv.kv.backends.choice import (
    NAMES,
    auto_choice,
    auto_reason,
    available,
    check_name,
    check_pool,
    triton_problem,
)
from radixkv.kv.backends.flashinfer_backend import FlashInferBackend
from radixkv.kv.backends.flex_backend import MAX_FLEX_COMPILES, FlexBackend, _flex_keys
from radixkv.kv.backends.group import Group, Step, batch_bucket, slot_matrix
from radixkv.kv.backends.sdpa_backend import (
    _FLASH_CPU,
    SdpaBackend,
    _cached_prefill,
    sdpa,
    sdpa_context,
)
from radixkv.kv.backends.triton_backend import TritonBackend
from radixkv.kv.backends.varlen_backend import VarlenBackend

#: Every backend by its name in ``KVCache(attention=...)`` (all of ``NAMES`` but ``"auto"``, a
#: choice among them), each made with the pool it serves: ``KVCache.backend(name)`` makes one
#: per pool on first use.
BACKENDS: dict[str, Callable[[Any], Backend]] = {
    cls.name: cls
    for cls in (SdpaBackend, TritonBackend, FlexBackend, VarlenBackend, FlashInferBackend)
}

__all__ = [
    "BACKENDS",
    "MAX_FLEX_COMPILES",
    "NAMES",
    "_FLASH_CPU",
    "Backend",
    "FlashInferBackend",
    "FlexBackend",
    "Group",
    "SdpaBackend",
    "Step",
    "TritonBackend",
    "VarlenBackend",
    "_cached_prefill",
    "_flex_keys",
    "auto_choice",
    "auto_reason",
    "available",
    "batch_bucket",
    "check_name",
    "check_pool",
    "sdpa",
    "sdpa_context",
    "slot_matrix",
    "triton_problem",
]
