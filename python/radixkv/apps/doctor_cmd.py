"""``radixkv doctor REQUESTS.jsonl``: why a prompt log misses the prefix cache (see
:mod:`radixkv.doctor`). Exits 1 when it finds a cache-breaking prompt, 0 when the log is clean."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``radixkv doctor``."""
    p.description = (
        "Reads chat requests (one OpenAI-format request per line: messages, tools, optional "
        "session), finds where each request stops sharing a prefix with the previous one of its "
        "session and why (volatile values, tool order, edited system prompt, rewritten history), "
        "and prints the hit rate as logged and after the fixes. Exit status 1 when it finds "
        "something, 0 when clean."
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
    """Runs ``radixkv doctor`` with parsed ``args``; returns 1 when it found something."""
    from radixkv.doctor import diagnose, read_requests, tokenizer_renderer

    try:
        requests = read_requests(args.requests)
    except (OSError, ValueError) as e:
        raise SystemExit(f"radixkv doctor: {e}") from None
    if not requests:
        raise SystemExit(f"radixkv doctor: no requests in {args.requests}")
    render = tokenizer_renderer(args.tokenizer) if args.tokenizer else None
    report = diagnose(requests, render)
    if report.findings:
        print(report.table())
        print()
    else:
        print("no cache-breaking prompts found")
    print(report.summary())
    return 1 if report.findings else 0
