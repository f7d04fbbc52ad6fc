"""What a page's KV depends on: the model (:func:`model_fingerprint`) and the pool's layout
(:func:`layout_fingerprint`). The disk tier stores the fingerprint with its directory and refuses
(or resets) a directory written under another; the shared tier keys and checks its pages by it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

import radixkv
from radixkv.kv.tiers.payload import PAGE_LAYOUT

#: Bumped whenever what a page holds, or how the index keys it, changes.
FORMAT_VERSION = 1


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
