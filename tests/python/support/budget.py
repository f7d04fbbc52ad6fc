"""How much the fuzz, property and state-machine tests draw. ``make test`` runs a short,
derandomized slice of each (the same examples every run: every path they drive stays covered, in
bounded time); ``make test-long`` (``RADIXKV_TEST_LONG=1``) runs the full budget with fresh
random examples each run."""

from __future__ import annotations

import os

#: Whether this run is ``make test-long``'s: the full budgets, random examples.
LONG = os.environ.get("RADIXKV_TEST_LONG", "") not in ("", "0")


def examples(long: int, short: int) -> int:
    """``long`` under ``make test-long``, else ``short``."""
    return long if LONG else short


def derandomize() -> bool:
    """Hypothesis's ``derandomize``: the short slice draws the same examples every run; the long
    run draws new ones."""
    return not LONG
