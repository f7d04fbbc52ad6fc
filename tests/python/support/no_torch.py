"""A pytest plugin for a Python without torch (``make test-oldest``): ``pytest -p no_torch``.

Whatever imports torch there, a test module at import or a test as it runs, is skipped with the
reason "needs torch" instead of failing; everything else runs as usual. It only acts when torch
is not installed (its finder is consulted after every real one), so it changes nothing where
torch is present. A module that fails for any other reason still fails.
"""

from __future__ import annotations

import importlib.abc
import sys

import pytest


def _importer() -> str:
    """The module whose code asked for torch: the first frame outside this file, importlib and
    pytest (``pytest.importorskip``)."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename == __file__
        or frame.f_code.co_filename.startswith("<frozen")
        or str(frame.f_globals.get("__name__", "")).startswith(("importlib", "_pytest"))
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return str(frame.f_globals.get("__name__") or frame.f_code.co_filename.rsplit("/", 1)[-1])


class _NeedsTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        # Only torch itself: torch probes optional submodules of its own, which must stay
        # ImportErrors (and without torch no submodule is ever looked for).
        if name == "torch":
            reason = f"needs torch ({_importer()} imports {name}; not installed here)"
            pytest.skip(reason, allow_module_level=True)
        return None


def pytest_configure(config: pytest.Config) -> None:
    sys.meta_path.append(_NeedsTorch())
