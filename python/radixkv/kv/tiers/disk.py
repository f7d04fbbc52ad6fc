"""`DiskTier`: a ``KVCache``'s side of the cache's disk tier (``disk_pages > 0``).

The index (``RadixCache``/``BlockCache`` with ``disk_pages``) decides which page goes to which
disk slot and logs the copies; this object performs them between the ``KVCache``'s pools and a
:class:`radixkv.kv.tiers.disk_pool.DiskPool` (one preallocated file under ``disk_dir``), reads
pages back for a prompt before it is admitted (:meth:`DiskTier.prefetch`), and saves the tier's
index so that the next process finds the pages again (:meth:`DiskTier.save`, reopened by the next
``KVCache(..., disk_dir=...)``).

A page on disk is every layer's K and V of its ``page_size`` tokens, in this order::

    payload = K[0] V[0] K[1] V[1] ... K[L-1] V[L-1]     each [page_size, num_kv_heads, head_dim]

Copies, as the index logs them (``cache.drain_copies(keys=True)``; see SEMANTICS.md, "Disk
tier")::

    spill(h, s):    disk slot s <- host page h      (the host tier dropped h; written in the
    persist(d, s):  disk slot s <- device page d     background, after a synchronous copy out)
    prefetch:       host page h <- disk slot s      (checked against the page's key and
                                                     checksum first: a bad page is recomputed)

Nothing read from disk is served unless it names the page it is asked for and its checksum
holds: a page torn by a crash, overwritten since the last save or damaged on disk is dropped
from the tier (``disk_bad_pages``) and its tokens are computed again.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import radixkv
from radixkv.kv.tiers.disk_pool import DiskPool

#: The layout of a page's bytes on disk, recorded in the directory's fingerprint.
PAGE_LAYOUT = "layer-major: K[l] then V[l], each [page_size, num_kv_heads, head_dim]"
#: Bumped whenever what a disk page holds, or how the index keys it, changes.
FORMAT_VERSION = 1


class DiskTier:
    """The disk pool of a ``KVCache`` and the copies between it and the pools.

    ``fingerprint``: what the KV depends on besides the pool's layout (the model's config, a
    digest of its weights; :func:`radixkv.kv.tiers.disk.model_fingerprint` computes one for a
    torch model). It is stored with the directory together with the layout (page size, layers,
    heads, head dim, dtype, format version); a directory written under another fingerprint is
    refused (``on_mismatch="error"``, :class:`radixkv.kv.tiers.DiskMismatchError` naming what
    differs) or started empty (``"reset"``).
    """

    def __init__(
        self,
        kv: Any,  # the KVCache (not imported: kv_cache imports this module)
        path: str | os.PathLike[str],
        fingerprint: Mapping[str, object] | None = None,
        on_mismatch: str = "error",
    ) -> None:
        if fingerprint is not None and not isinstance(fingerprint, Mapping):
            raise TypeError(
                f"fingerprint must be a mapping (e.g. model_fingerprint(model)), got "
                f"{type(fingerprint).__name__}"
            )
        self.kv = kv
        self.page_bytes = type(kv).bytes_per_page(
            kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.page_size
        )
        full = layout_fingerprint(kv, fingerprint)
        self.pool = DiskPool(path, kv.cache.disk_pages, self.page_bytes, full, on_mismatch)
        keys, slots = self.pool.entries
        if len(slots):
            try:
                kv.cache.disk_restore(keys, slots)
            except ValueError as e:
                self.pool.close()
                raise ValueError(
                    f"the cache's disk tier cannot take the {len(slots)} pages saved in "
                    f"{os.fspath(path)!r}: {e} (give KVCache a new cache)"
                ) from None
        #: Pages this process restored from the directory at open.
        self.restored_pages = len(slots)
        #: The error that stopped writes to the disk (None while it works).
        self.failed: BaseException | None = None

    # ---- pages <-> bytes ------------------------------------------------------------------

    def _page_bytes(self, k: list[torch.Tensor], v: list[torch.Tensor], page: int) -> np.ndarray:
        """Every layer's K and V of ``page`` of the pools ``k``/``v``, as one fresh uint8 array."""
        return page_payload(self.kv, k, v, page)

    def _scatter(self, payload: np.ndarray, host_page: int) -> None:
        """Writes ``payload`` (as :meth:`_page_bytes` made it) into host page ``host_page``."""
        scatter_payload(self.kv, payload, self.kv.host_k, self.kv.host_v, host_page)

    # ---- the index's copies ------------------------------------------------------------

    def write(self, rows: np.ndarray, keys: bytes) -> None:
        """Performs disk copies (rows ``(kind, src, dst)`` of kind ``COPY_SPILL`` or
        ``COPY_PERSIST``, with their 32-byte ``keys`` in order): each page is copied out of its
        pool now (a later copy may overwrite that page) and written in the background."""
        if len(keys) != 32 * len(rows):
            raise ValueError(
                f"keys must be 32 bytes for each of the {len(rows)} disk copies, got {len(keys)}"
            )
        kv = self.kv
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)  # offloads queued on the side stream land first
        for i, (kind, src, dst) in enumerate(np.asarray(rows).tolist()):
            if kind == radixkv.COPY_SPILL:
                payload = self._page_bytes(kv.host_k, kv.host_v, src)
            elif kind == radixkv.COPY_PERSIST:
                payload = self._page_bytes(kv.k, kv.v, src)
            else:
                raise ValueError(f"disk copy row {i} has kind {kind}, not a disk copy")
            if self.failed is not None:
                continue  # the disk failed: the page is lost (a later read of it fails too)
            try:
                self.pool.write(dst, keys[32 * i : 32 * i + 32], payload)
            except (OSError, RuntimeError) as e:
                # A full or failing disk must not stop the forward passes: the pages it should
                # have taken are lost, and reading them back fails its check, so nothing wrong
                # is ever served.
                self.failed = e
                warnings.warn(
                    f"writing the disk tier failed ({e}); its pages from now on are lost",
                    RuntimeWarning,
                    stacklevel=2,
                )

    # ---- reading back, saving ------------------------------------------------------------

    def prefetch(self, tokens: Sequence[int] | np.ndarray, namespace: Any = None) -> int:
        """Reads back from disk the pages of ``tokens`` past what the device and host tiers
        hold, into host pages, so that admitting ``tokens`` next finds them as host hits.
        Returns how many tokens came back (0 when the disk holds none of them). A page that
        reads torn or corrupted ends the run there and leaves the tier; its tokens are
        computed again."""
        cache = self.kv.cache
        fetch = cache.disk_prefetch(tokens, namespace)
        if fetch is None:
            return 0
        fid, _, slots, keys, host = fetch
        good, bad = 0, False
        try:
            # Spills logged so far (some made room for this prefetch) land before their slots
            # are read: the pool performs queued writes before any read.
            self.kv.apply_copies()
            payloads = self.pool.read(slots, keys)
            for payload, h in zip(payloads, host.tolist()):
                if payload is None:
                    bad = True
                    break
                self._scatter(payload, h)
                good += 1
        finally:
            entered = cache.disk_confirm(fid, good, bad)
        return entered * self.kv.page_size

    def save(self) -> int:
        """Writes every page the cache holds that the disk lacks, waits for every write, then
        replaces the directory's index atomically; returns how many pages it wrote. After it,
        a new process opening the directory finds every page the cache held."""
        n = self.kv.cache.disk_persist()
        self.kv.apply_copies()
        keys, slots = self.kv.cache.disk_entries()
        self.pool.save(keys, slots)
        return n

    def close(self) -> None:
        """Waits for the queued writes and closes the pool (saving nothing)."""
        self.pool.close()


def layout_fingerprint(kv: Any, fingerprint: Mapping[str, object] | None) -> dict[str, object]:
    """What a page of ``kv`` (a ``KVCache``) is valid for: ``fingerprint`` (the model's) with
    the pool's layout (format version, page size, layers, KV heads, head dim, dtype, page
    layout). The disk tier stores it with its directory; the shared tier keys pages by it."""
    return {
        "format": FORMAT_VERSION,
        "page_size": kv.page_size,
        "num_layers": kv.num_layers,
        "num_kv_heads": kv.num_kv_heads,
        "head_dim": kv.head_dim,
        "dtype": str(kv.dtype).removeprefix("torch."),
        "layout": PAGE_LAYOUT,
        "model": dict(fingerprint or {}),
    }


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


#: Config fields that do not change what a model computes for a prompt, so not part of its
#: fingerprint (nor is any field whose name starts with ``_``: transformers' bookkeeping, such
#: as ``_name_or_path``): where the checkpoint was loaded from and by which transformers, the
#: attention kernel, output switches, labels, token ids and generation defaults (sampling is
#: the engine's), initialization, the parameters' dtype (the weights digest holds it; the KV
#: dtype is recorded apart). Every other field is kept: one the list does not know counts, so
#: that a field that changes the math is never left out.
NOT_IN_FINGERPRINT = frozenset(
    {
        "name_or_path",
        "transformers_version",
        "attn_implementation",
        "architectures",
        "torch_dtype",
        "dtype",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        "id2label",
        "label2id",
        "problem_type",
        "finetuning_task",
        "task_specific_params",
        "tokenizer_class",
        "prefix",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "unk_token_id",
        "initializer_range",
        "decoder_start_token_id",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "chunk_size_feed_forward",
        "tf_legacy_loss",
        "use_bfloat16",
    }
)


def model_fingerprint(model: torch.nn.Module) -> dict[str, object]:
    """What a model's KV depends on, for a disk tier's directory: its class, the fields of its
    config that change the math (``config.to_dict()`` or the attributes of a plain config,
    less :data:`NOT_IN_FINGERPRINT`: the same model loaded from another path or by another
    transformers has the same fingerprint) and a blake3 digest of every parameter and buffer
    (names, shapes, dtypes and bytes; ~0.3 s for 135M float32 parameters on one CPU core).
    Two models with equal fingerprints compute the same KV."""
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        cfg = config.to_dict()
    elif config is not None:
        cfg = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    else:
        cfg = {}
    cfg = {
        k: v
        for k, v in cfg.items()
        if not k.startswith("_") and k not in NOT_IN_FINGERPRINT and _jsonable(v)
    }
    digest = b"\0" * 32
    tensors = list(model.state_dict().items())
    for name, t in tensors:
        head = f"{name}|{tuple(t.shape)}|{t.dtype}".encode()
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        digest = radixkv._radixkv._page_checksum(digest + head, data)
    return {"class": type(model).__name__, "config": cfg, "weights": digest.hex()}


def _jsonable(v: object) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_jsonable(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _jsonable(x) for k, x in v.items())
    return False
