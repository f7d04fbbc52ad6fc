"""The ``radixkv`` command line: ``radixkv SUBCOMMAND ...`` (also ``python -m radixkv``).

Subcommands live in :data:`COMMANDS`: name -> (module, one-line help). Each module defines
``add_arguments(parser)`` and ``run(args) -> int`` and is imported only when its subcommand runs,
so ``radixkv --help`` needs no torch. Adding a subcommand is one entry here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from radixkv.apps.args import UsageError

#: Subcommand name -> (module defining ``add_arguments`` and ``run``, help line).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("radixkv.apps.demo_cmd", "an agent session with and without the prefix cache"),
    "replay": ("radixkv.apps.replay_cmd", "replay a request trace through a cache, per policy"),
    "doctor": ("radixkv.apps.doctor_cmd", "find why a log of chat requests misses the cache"),
    "serve": ("radixkv.apps.serve_cmd", "an OpenAI-compatible server on the prefix-cached Engine"),
}


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line as a :class:`UsageError` (one line, exit status 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser(commands: dict[str, tuple[str, str]] = COMMANDS) -> argparse.ArgumentParser:
    """The argument parser with one subparser per registered subcommand."""
    parser = _Parser(prog="radixkv", description="A prefix cache for LLM key/value tensors.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_line) in commands.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs the chosen subcommand; returns
    its exit status. A user error (a bad option, a missing or unusable input file) prints one
    line, ``radixkv: error: ...``, on stderr and returns 2."""
    try:
        args = build_parser().parse_args(argv)
        return int(args._run(args) or 0)
    except UsageError as e:
        print(f"radixkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
