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

Every field of every line is checked, and a line the reader cannot use raises
:class:`TraceError` naming the line, the field and the bad value:

- a line is a JSON object (not ``5``, ``null`` or a list);
- ``timestamp`` is a finite number ``>= 0`` (bools are not numbers; ``NaN`` and ``Infinity``
  are refused), required in a Mooncake line;
- ``hash_ids`` is a non-empty list of integers in ``[0, 2**32 / 512)`` (an id's 512 tokens must
  fit uint32); ``input_length``, required with it, an integer in ``[1, 512 * len(hash_ids)]``;
- ``tokens`` is a non-empty list of integers in ``[0, 2**32)``: floats (even ``2.0``), bools and
  nested lists are not token ids; ``text`` is a non-empty string;
- ``output_length`` (optional, default 0) is an integer in ``[0, 2**32)``;
- ``namespace`` (optional, in either format) is a string or ``null``.

Either format may be gzipped (``.jsonl.gz``): detected by the ``.gz`` suffix or by gzip's magic
bytes, so a renamed file reads too.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from radixkv._jsonl import load as load_json
from radixkv._jsonl import show

MOONCAKE_BLOCK = 512
#: A trace shipped in the package (the first 1,000 requests of Mooncake's conversation trace; see
#: ``radixkv/data/README.md``): what ``radixkv replay`` replays when given no trace.
SAMPLE_TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_sample.jsonl.gz"
#: Where the whole Mooncake trace lives (the source repository has a gzipped copy).
MOONCAKE_TRACE_URL = (
    "https://github.com/kvcache-ai/Mooncake/blob/main/FAST25-release/traces/"
    "conversation_trace.jsonl"
)
GZIP_MAGIC = b"\x1f\x8b"
#: Token ids, output lengths: below 2**32 (uint32).
U32 = 2**32
#: Mooncake hash ids: below 2**32 / 512, so that ``id * 512 + 511`` fits uint32.
HASH_ID_BOUND = U32 // MOONCAKE_BLOCK


class TraceError(ValueError):
    """A trace line the reader cannot use; the message names the line, the field and the
    bad value (``line 7: 'output_length' must be ..., got -2``)."""


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
    if ids.size and (ids.min() < 0 or ids.max() >= HASH_ID_BOUND):
        raise ValueError(f"hash_ids must be in [0, {HASH_ID_BOUND}), got {ids.min()}..{ids.max()}")
    if input_length < 0:
        raise ValueError(f"input_length must be >= 0, got {input_length}")
    if input_length > ids.size * MOONCAKE_BLOCK:
        raise ValueError(
            f"input_length {input_length} exceeds {ids.size} blocks of {MOONCAKE_BLOCK} tokens"
        )
    blocks = ids[:, None] * MOONCAKE_BLOCK + np.arange(MOONCAKE_BLOCK, dtype=np.int64)[None, :]
    return blocks.reshape(-1)[:input_length].astype(np.uint32)


# ---- checking one line ------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    """Whether ``value`` is a JSON integer (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a finite JSON number (bools,
    ``NaN``, ``Infinity`` and ints too large for a float are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _load(line: str, where: str) -> dict[str, Any]:
    """The JSON object on ``line``; a :class:`TraceError` for anything else."""
    obj = load_json(line, where, TraceError, "the reader")
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: must be a JSON object, got {show(obj)}")
    return obj


def _timestamp(obj: dict[str, Any], where: str, unit: str, required: bool) -> float:
    """``obj["timestamp"]`` (in ``unit``) as a float; 0 when it may be and is absent."""
    if "timestamp" not in obj:
        if required:
            raise TraceError(f"{where}: 'timestamp' is missing: a Mooncake line needs one ({unit})")
        return 0.0
    value = obj["timestamp"]
    f = _finite(value)
    if f is None or f < 0:
        raise TraceError(
            f"{where}: 'timestamp' must be a finite number >= 0 ({unit}), got {show(value)}"
        )
    return f


def _output_length(obj: dict[str, Any], where: str) -> int:
    """``obj["output_length"]``: an integer in ``[0, 2**32)``, 0 when absent."""
    value = obj.get("output_length", 0)
    if not _is_int(value) or not 0 <= value < U32:
        raise TraceError(
            f"{where}: 'output_length' must be a non-negative integer below 2**32, got "
            f"{show(value)}"
        )
    return value


def _unicode(text: str, where: str, field: str) -> None:
    """A :class:`TraceError` when ``text`` (the string in ``field``) is not valid unicode
    (JSON lets ``"\\ud800"`` through: a lone surrogate, which has no utf-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("utf-8", "backslashreplace").decode()
        raise TraceError(
            f"{where}: {field!r} is not valid unicode (lone surrogate {bad} at {e.start})"
        ) from None


def _namespace(obj: dict[str, Any], where: str) -> str | None:
    """``obj["namespace"]``: a string, or None when absent or null."""
    value = obj.get("namespace")
    if value is not None and not isinstance(value, str):
        raise TraceError(f"{where}: 'namespace' must be a string or null, got {show(value)}")
    if value is not None:
        _unicode(value, where, "namespace")
    return value


def _bound(bound: int) -> str:
    """``bound`` as a reader knows it: ``2**32`` rather than 4294967296."""
    names = {U32: "2**32", HASH_ID_BOUND: f"2**32 / {MOONCAKE_BLOCK} = {HASH_ID_BOUND}"}
    return names.get(bound, str(bound))


def _ids(values: Any, field: str, bound: int, what: str, where: str) -> list[int]:
    """``values`` (the value of ``field``): a non-empty list of integers in ``[0, bound)``
    (``what`` names them); a :class:`TraceError` naming the first one that is not."""
    if not isinstance(values, list):
        raise TraceError(f"{where}: {field!r} must be a list of {what}, got {show(values)}")
    if not values:
        raise TraceError(f"{where}: {field!r} is an empty list: an empty prompt")
    if all(type(v) is int for v in values) and min(values) >= 0 and max(values) < bound:
        return values
    i, bad = next((i, v) for i, v in enumerate(values) if not (_is_int(v) and 0 <= v < bound))
    raise TraceError(
        f"{where}: {what} must be integers in [0, {_bound(bound)}): {field!r}[{i}] is {show(bad)}"
    )


def _mooncake(obj: dict[str, Any], where: str) -> TraceRequest:
    """A Mooncake line (it has ``hash_ids``) as a request."""
    ids = _ids(obj["hash_ids"], "hash_ids", HASH_ID_BOUND, "hash ids", where)
    if "input_length" not in obj:
        raise TraceError(f"{where}: 'input_length' is missing: a Mooncake line needs one")
    n = obj["input_length"]
    most = len(ids) * MOONCAKE_BLOCK
    if not _is_int(n) or not 1 <= n <= most:
        raise TraceError(
            f"{where}: 'input_length' must be an integer in [1, {most}] ({MOONCAKE_BLOCK} tokens "
            f"per hash id), got {show(n)}"
        )
    arrival = _timestamp(obj, where, "milliseconds", required=True) / 1000.0
    return TraceRequest(
        arrival, mooncake_tokens(ids, n), _output_length(obj, where), _namespace(obj, where)
    )


def _prompt(
    obj: dict[str, Any], where: str, tokenizer: Callable[[str], list[int]] | None
) -> np.ndarray:
    """The prompt of a radixkv line: its ``tokens``, or its ``text`` tokenized."""
    if "tokens" in obj:
        return np.asarray(_ids(obj["tokens"], "tokens", U32, "token ids", where), dtype=np.uint32)
    if "text" not in obj:
        raise TraceError(
            f"{where}: needs 'hash_ids', 'tokens' or 'text', got keys {show(sorted(obj))}"
        )
    text = obj["text"]
    if not isinstance(text, str):
        raise TraceError(f"{where}: 'text' must be a string, got {show(text)}")
    if not text:
        raise TraceError(f"{where}: 'text' is an empty string: an empty prompt")
    _unicode(text, where, "text")
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
    ids = [int(v) if isinstance(v, np.integer) else v for v in tokenizer(text)]
    if not ids:
        raise TraceError(f"{where}: 'text' tokenizes to no tokens: an empty prompt")
    return np.asarray(_ids(ids, "text", U32, "token ids of the text", where), dtype=np.uint32)


def _parse(line: str, lineno: int, tokenizer: Callable[[str], list[int]] | None) -> TraceRequest:
    """Line ``lineno`` of a trace, either format, as a request; a :class:`TraceError` naming
    the line and the field when it is malformed."""
    where = f"line {lineno}"
    obj = _load(line, where)
    if "hash_ids" in obj:
        return _mooncake(obj, where)
    tokens = _prompt(obj, where, tokenizer)
    return TraceRequest(
        _timestamp(obj, where, "seconds", required=False),
        tokens,
        _output_length(obj, where),
        _namespace(obj, where),
    )


# ---- files ------------------------------------------------------------------------------------


def input_problem(path: str | Path) -> str | None:
    """What keeps the input file at ``path`` from being read (``does not exist``, ``is a
    directory``), or None: anything else that exists is tried, ``/dev/null`` and pipes too."""
    p = Path(path)
    if p.is_dir():
        return "is a directory"
    if not p.exists():
        return "does not exist"
    return None


def emptiness(path: str | Path) -> str:
    """Why a file of no requests has none: empty, or only blank lines."""
    try:
        empty = Path(path).stat().st_size == 0
    except OSError:
        empty = False
    return "the file is empty" if empty else "it holds only blank lines"


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
    line); raises :class:`TraceError` (a ``ValueError``) naming the first malformed line."""
    with open_text(path) as f:
        n = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            yield _parse(line, lineno, tokenizer)
            n += 1
