"""Request traces: the Mooncake JSONL format and radixkv's own.

Mooncake (FAST '25) conversation trace, one JSON object per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``timestamp`` in milliseconds; ``hash_ids`` names each 512-token block of the prompt, equal ids
meaning equal content after equal prefixes. Each id expands to 512 deterministic token ids
(``id * 512 + j``), the last block cut to ``input_length``.

radixkv's own format, one JSON object per line::

    {"timestamp": 0.5, "tokens": [1, 2, 3], "output_length": 16, "namespace": "tenant-a"}
    {"timestamp": 0.7, "text": "You are ...", "output_length": 16}

``timestamp`` in seconds (optional: consecutive requests arrive together); ``tokens`` or
``text`` (tokenized to its utf-8 bytes when no tokenizer is given); ``output_length`` and
``namespace`` optional.

Either format may be gzipped (``.jsonl.gz``): detected by the ``.gz`` suffix or by gzip's magic
bytes, so a renamed file reads too.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

MOONCAKE_BLOCK = 512
GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival time in seconds, prompt token ids, output length."""

    arrival: float
    tokens: np.ndarray
    output_length: int
    namespace: str | None = None


def mooncake_tokens(hash_ids: list[int], input_length: int) -> np.ndarray:
    """Expands Mooncake block hash ids into ``input_length`` deterministic uint32 token ids."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32 // MOONCAKE_BLOCK):
        raise ValueError(
            f"hash_ids must be in [0, {2**32 // MOONCAKE_BLOCK}), got {ids.min()}..{ids.max()}"
        )
    if input_length > ids.size * MOONCAKE_BLOCK:
        raise ValueError(
            f"input_length {input_length} exceeds {ids.size} blocks of {MOONCAKE_BLOCK} tokens"
        )
    blocks = ids[:, None] * MOONCAKE_BLOCK + np.arange(MOONCAKE_BLOCK, dtype=np.int64)[None, :]
    return blocks.reshape(-1)[:input_length].astype(np.uint32)


def _parse(line: str, lineno: int, tokenizer: Callable[[str], list[int]] | None) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line {lineno}: not JSON ({e.msg})") from None
    if "hash_ids" in obj:
        tokens = mooncake_tokens(obj["hash_ids"], int(obj["input_length"]))
        return TraceRequest(obj["timestamp"] / 1000.0, tokens, int(obj.get("output_length", 0)))
    if "tokens" in obj:
        tokens = np.asarray(obj["tokens"], dtype=np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
            raise ValueError(f"line {lineno}: token ids must be in [0, 2**32)")
        tokens = tokens.astype(np.uint32)
    elif "text" in obj:
        ids = tokenizer(obj["text"]) if tokenizer else list(obj["text"].encode("utf-8"))
        tokens = np.asarray(ids, dtype=np.uint32)
    else:
        raise ValueError(f"line {lineno}: needs 'hash_ids', 'tokens' or 'text'")
    if tokens.size == 0:
        raise ValueError(f"line {lineno}: empty prompt")
    return TraceRequest(
        float(obj.get("timestamp", 0.0)),
        tokens,
        int(obj.get("output_length", 0)),
        obj.get("namespace"),
    )


def is_gzip(path: str | Path) -> bool:
    """Whether ``path`` is gzip-compressed: a ``.gz`` suffix, or gzip's magic bytes."""
    if Path(path).suffix == ".gz":
        return True
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC


def open_text(path: str | Path) -> TextIO:
    """``path`` opened for reading utf-8 text, decompressed on the fly when gzipped."""
    if is_gzip(path):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_trace(
    path: str | Path,
    limit: int | None = None,
    tokenizer: Callable[[str], list[int]] | None = None,
) -> Iterator[TraceRequest]:
    """Yields the requests of a JSONL trace, plain or gzipped (either format, detected per
    line)."""
    with open_text(path) as f:
        n = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            yield _parse(line, lineno, tokenizer)
            n += 1
