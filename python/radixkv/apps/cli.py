"""The ``radixkv`` command line: ``radixkv SUBCOMMAND ...`` (also ``python -m radixkv``).

Subcommands live in :data:`COMMANDS`: name -> (module, one-line help). Each module defines
``add_arguments(parser)`` and ``run(args) -> int``; ``radixkv SUBCOMMAND`` imports that module
alone, ``radixkv --help`` every one (none imports torch at the top). Adding a subcommand is one
entry here.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

import radixkv
from radixkv.apps.common.args import UsageError

#: The program name in usage lines and errors.
PROG = "radixkv"

#: Subcommand name -> (module defining ``add_arguments`` and ``run``, help line).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("radixkv.apps.demo.cmd", "an agent session with and without the prefix cache"),
    "replay": ("radixkv.apps.replay.cmd", "replay a request trace through a cache, per policy"),
    "doctor": ("radixkv.apps.doctor.cmd", "find why a log of chat requests misses the cache"),
    "serve": ("radixkv.apps.serve.cmd", "an OpenAI-compatible server on the prefix-cached Engine"),
}


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line as a :class:`UsageError` (one line, exit status 2) that names
    the subcommand and points to its own ``--help``."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix(PROG).strip()  # "" for the top-level parser
        where = f"{command}: " if command else ""
        raise UsageError(f"{where}{message} (see {self.prog} --help)")


def build_parser(commands: dict[str, tuple[str, str]] = COMMANDS) -> argparse.ArgumentParser:
    """The argument parser with one subparser per registered subcommand, and ``--version``."""
    parser = _Parser(prog=PROG, description="A prefix cache for LLM key/value tensors.")
    parser.add_argument(
        "--version",
        action="version",
        version=f"{PROG} {radixkv.__version__}",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_line) in commands.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs the chosen subcommand; returns
    its exit status. A user error (a bad option, a missing or unusable input file) prints one
    line, ``radixkv: error: COMMAND: ...``, on stderr and returns 2. ``--version`` and
    ``--help`` print and raise ``SystemExit(0)``, as argparse does."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # Only the named subcommand's module is imported (each pulls in its own dependencies:
        # a start of `radixkv serve` need not import the replay and demo code); the whole
        # parser otherwise (no command yet, --help, --version, a misspelt command).
        named = argv[0] if argv and argv[0] in COMMANDS else None
        commands = {named: COMMANDS[named]} if named else COMMANDS
        args, extra = build_parser(commands).parse_known_args(argv)
        if extra:  # said by the subcommand's parser, which knows its options and its --help
            args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args._run(args) or 0)
    except UsageError as e:
        print(f"radixkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
