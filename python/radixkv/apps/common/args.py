"""What every subcommand shares: the user-error type, argument types that check ranges, and
progress bars and charts that degrade when their optional packages are missing.

A :class:`UsageError` (a bad option, a missing file, an input the command cannot use) is
printed by :func:`radixkv.apps.cli.main` as one line, ``radixkv: error: ...``, with exit
status 2, like argparse's own errors; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class UsageError(Exception):
    """A mistake in the command line or in the files it names (exit status 2)."""


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an int ``>= lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {value}")
        return value

    parse.__name__ = f"int >= {lo}"
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite float ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def add_cache_options(p: argparse.ArgumentParser) -> None:
    """``--cache radix|block`` and ``--page-size`` (default: 1 for radix, 16 for block); read
    the page size back with :func:`page_size_of`."""
    p.add_argument(
        "--cache",
        choices=("radix", "block"),
        default="radix",
        help="index: radix tree (default) or chained block hashes",
    )
    p.add_argument(
        "--page-size",
        type=positive_int,
        default=None,
        help="tokens per page (default: 1 for radix, 16 for block)",
    )


def page_size_of(args: argparse.Namespace) -> int:
    """The page size ``args`` asks for: ``--page-size``, else the index's default."""
    return args.page_size if args.page_size is not None else (1 if args.cache == "radix" else 16)


class _NoBar:
    """A progress bar that shows nothing (tqdm is not installed, or none was asked for)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(**kwargs: Any) -> Any:
    """A ``tqdm`` bar on stderr with ``kwargs``, or one that shows nothing when stderr is not a
    terminal (a log file, a pipe, CI: a bar there is hundreds of ``\\r`` frames) or when tqdm
    (an optional dependency) is not installed."""
    if not _is_terminal(sys.stderr):
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(file=sys.stderr, **kwargs)


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (False for anything without ``isatty``)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def output_dir(path: str, command: str, option: str = "--out") -> Path:
    """The folder ``path`` for what ``command`` writes (``option`` names it), made now if it is
    missing, so that a folder that cannot be written is a :class:`UsageError` before the work
    starts rather than a traceback after it."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{command}: {option} {path!r} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = e.strerror or str(e)
        raise UsageError(f"{command}: {option} {path!r} cannot be created: {why}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"{command}: {option} {path!r} is not writable")
    return out


#: One column of a printed table: (name, unit, width); a negative width aligns it left.
Column = tuple[str, str, int]


def table_header(columns: list[Column]) -> list[str]:
    """The three header lines of a table: the column names, each column's unit under its name
    (``tokens``, ``pages``, ``s``, ...; empty for a label column), and a rule."""

    def line(cells: list[str]) -> str:
        return " ".join(
            f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, (_, _, w) in zip(cells, columns)
        ).rstrip()

    names = line([name for name, _, _ in columns])
    units = line([unit for _, unit, _ in columns])
    return [names, units, "-" * len(names)]


def have_matplotlib() -> bool:
    """Whether the optional matplotlib (charts) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


#: The note printed instead of a chart when matplotlib is missing.
NO_CHART = "chart: skipped (matplotlib is not installed; pip install matplotlib)"
