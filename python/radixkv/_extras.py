"""Optional dependencies: which extra installs each, and the one-line error that says so.

``import radixkv`` needs only numpy. The torch layer (``radixkv.kv``, ``radixkv.models``,
``radixkv.engine`` and the names they export) needs the ``torch`` extra; ``radixkv.metrics`` and
``radixkv.events`` need theirs. A name whose package is missing raises a
``ModuleNotFoundError`` (an ``ImportError``, ``name`` set to the missing package) whose message
is one line: what needs it, and the ``pip install`` that fixes it.

This module imports nothing optional.
"""

from __future__ import annotations

import importlib.machinery
import sys

#: The torch layer's extra (``pip install 'radixkv[torch]'``).
TORCH_EXTRA = "torch"


def install_line(extra: str) -> str:
    """``pip install 'radixkv[EXTRA]'``."""
    return f"pip install 'radixkv[{extra}]'"


def missing(what: str, package: str, extra: str) -> ModuleNotFoundError:
    """The error for ``what`` (a radixkv name) when ``package`` is not installed."""
    return ModuleNotFoundError(
        f"{what} needs {package}, which is not installed: {install_line(extra)}", name=package
    )


def require_torch(what: str) -> None:
    """Imports torch; when it is not installed, a :func:`missing` error naming ``what`` and the
    ``torch`` extra. An ``ImportError`` from inside an installed torch (a broken install, a
    missing system library) is raised as it is: reinstalling radixkv would not fix it."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise missing(what, "torch", TORCH_EXTRA) from None


def available(*packages: str) -> bool:
    """Whether every top-level package in ``packages`` is installed: imported already, or found
    on ``sys.path`` (looked up, not imported). A package set to ``None`` in ``sys.modules`` counts
    as missing. Only the path is searched, not the import hooks of ``sys.meta_path``, so that
    asking is free of side effects (``import radixkv`` asks about torch)."""
    for package in packages:
        if package in sys.modules:
            if sys.modules[package] is None:
                return False
            continue
        if importlib.machinery.PathFinder.find_spec(package) is None:
            return False
    return True
