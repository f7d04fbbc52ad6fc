"""``radixkv doctor REQUESTS.jsonl``: why a prompt log misses the prefix cache (see
:mod:`radixkv.doctor`).

Exit status: 0 when the log is clean, 1 when it finds a cache-breaking prompt (a result, not an
error), 2 for a user error (a missing, unreadable, malformed or empty requests file, a
``--tokenizer`` that cannot be used), printed by :func:`radixkv.apps.cli.main` as one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from radixkv.apps.common.args import UsageError
from radixkv.apps.common.trace import emptiness, input_problem


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``radixkv doctor``."""
    p.description = (
        "Reads chat requests (one OpenAI-format request per line: messages, tools, optional "
        "session), finds where each request stops sharing a prefix with the previous one of its "
        "session and why (volatile values, tool order, edited system prompt, rewritten history), "
        "and prints the hit rate as logged and after the fixes. Exit status: 0 when the log is "
        "clean, 1 when it finds something (a result, not an error), 2 for a user error (a "
        "missing, unreadable or empty requests file, an unusable --tokenizer)."
    )
    p.add_argument("requests", help="JSONL file of chat requests")
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="local Hugging Face tokenizer with a chat template (needs transformers); "
        "default: work on the rendered bytes",
    )


def run(args: argparse.Namespace) -> int:
    """Runs ``radixkv doctor`` with parsed ``args``; returns 1 when it found something, 0 when
    the log is clean; raises :class:`UsageError` for an input it cannot use."""
    from radixkv.doctor import diagnose, read_requests

    path = args.requests
    problem = input_problem(path)
    if problem is not None:
        raise UsageError(f"doctor: requests file {path!r} {problem}")
    try:
        requests = read_requests(path)
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"doctor: cannot read requests file {path!r}: {e}") from None
    except ValueError as e:  # a malformed line, named with its field by read_requests
        raise UsageError(f"doctor: {e}") from None
    if not requests:
        raise UsageError(f"doctor: no requests in {path}: {emptiness(path)}")
    render = _renderer(args.tokenizer) if args.tokenizer else None
    report = diagnose(requests, render)
    if report.findings:
        print(report.table())
        print()
    else:
        print("no cache-breaking prompts found")
    print(report.summary())
    return 1 if report.findings else 0


def _renderer(path: str) -> Callable[[Any, list | None], Any]:
    """The renderer of the tokenizer at ``path``; a :class:`UsageError` for a directory that
    is missing or holds no usable tokenizer (or one without a chat template: named with the
    first request it cannot render), or when transformers is not installed."""
    from radixkv.doctor import tokenizer_renderer

    if not Path(path).is_dir():
        what = "is not a directory" if Path(path).exists() else "does not exist"
        raise UsageError(f"doctor: --tokenizer {path!r} {what}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError(
            "doctor: --tokenizer needs the transformers package (pip install transformers); "
            "without --tokenizer the doctor works on the rendered bytes"
        ) from None
    try:
        render = tokenizer_renderer(path)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"doctor: --tokenizer {path!r} cannot be loaded: {_first(e)}") from None

    def checked(req: Any, tools: list | None) -> Any:
        try:
            return render(req, tools)
        except (ValueError, KeyError, TypeError) as e:  # no chat template, say
            raise UsageError(
                f"doctor: --tokenizer {path!r} cannot render line {req.line}: {_first(e)}"
            ) from None

    return checked


def _first(e: BaseException) -> str:
    """The first line of ``e``'s message (its type when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
