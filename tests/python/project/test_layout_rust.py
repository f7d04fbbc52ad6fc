"""The Rust crate's layout: its folders are layers, each using only the folders below it, and
no import cycle between its modules.

A module's private submodules (``mod check;`` rather than ``pub(crate) mod index;``) are parts
of it (its invariant checker, its private tables) and count as the same node; every other
module is a node of its own. Edges are the ``crate::`` and ``super::`` paths a file names
outside its ``#[cfg(test)]`` module (tests drive the caches from any layer). The crate root's
names (``crate::BlockCache``) are a layer of their own, under the PyO3 boundary only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_layout import find_cycle

RUST = Path(__file__).resolve().parents[3] / "rust"

#: Folders from the bottom up; a module may use its own folder and the folders of layers below.
#: Folders of one layer do not use each other.
LAYERS = [
    {"error"},
    {"arena"},
    {"wire"},
    {"cache"},
    {"radix", "block"},
    {"sched", "plan"},
    {""},  # the crate root: the public names, re-exported
    {"python"},  # the PyO3 boundary, over the public names
]

#: The largest a core file may grow (the boundary in python/ is glue, not core).
MAX_LINES = 1000


def modules() -> dict[str, Path]:
    """Module path ("" for the crate root, "cache::index") -> source file."""
    out = {}
    for path in sorted(RUST.rglob("*.rs")):
        parts = list(path.relative_to(RUST).with_suffix("").parts)
        if parts[-1] in ("mod", "lib"):
            parts.pop()
        out["::".join(parts)] = path
    return out


def source(path: Path) -> str:
    """A file's text without its test module and comments."""
    text = path.read_text()
    test = re.search(r"^#\[cfg\(test\)\]\s*\n\s*mod \w+ \{", text, re.M)
    if test:
        text = text[: test.start()]
    return re.sub(r"//.*", "", text)


def private_children(mods: dict[str, Path]) -> dict[str, str]:
    """Module -> the node it belongs to (its parent's, for a private submodule)."""
    owner = {m: m for m in mods}
    for m in sorted(mods, key=lambda m: m.count("::") if m else -1):
        for child in re.findall(r"^mod (\w+);", source(mods[m]), re.M):
            full = f"{m}::{child}" if m else child
            if m and full in mods:  # the crate root's `mod` lines declare the folders
                owner[full] = owner[m]
    return owner


def resolve(path: list[str], mods: dict[str, Path]) -> str:
    """The longest module prefix of a path's segments."""
    for i in range(len(path), 0, -1):
        if "::".join(path[:i]) in mods:
            return "::".join(path[:i])
    return ""


def graph() -> dict[str, set[str]]:
    mods = modules()
    owner = private_children(mods)
    g: dict[str, set[str]] = {owner[m]: set() for m in mods}
    for m, path in mods.items():
        here = m.split("::") if m else []
        # The module whose `super` is `here`'s parent: a mod.rs names its own folder.
        for ref in re.findall(r"\b((?:crate|super)(?:::\w+)+|crate::\{)", source(path)):
            segs = ref.rstrip("{").rstrip(":").split("::")
            if segs[0] == "crate":
                target = resolve(segs[1:], mods) if len(segs) > 1 else ""
            else:
                base = list(here)
                while segs and segs[0] == "super":
                    base = base[:-1]
                    segs = segs[1:]
                target = resolve(base + segs, mods) if base + segs else ""
            a, b = owner[m], owner[target]
            if a != b:
                g[a].add(b)
    return g


def folder(module: str) -> str:
    return module.split("::")[0]


def layer(module: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if folder(module) in names)


def test_the_graph_sees_the_crate():
    g = graph()
    assert {"cache", "cache::index", "radix", "block", "sched", "wire::hash"} <= set(g)
    assert "cache::index" in g["cache"]
    assert "radix::check" not in g, "a private submodule is part of its parent"
    assert "wire::hash" in g["radix"]


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(c or "crate" for c in cycle)


@pytest.mark.parametrize("module", sorted(graph()))
def test_each_folder_uses_only_the_folders_below(module):
    bad = sorted(
        t for t in graph()[module] if folder(t) != folder(module) and layer(t) >= layer(module)
    )
    assert not bad, f"{module or 'crate'} uses {bad} from its own layer or one above"


@pytest.mark.parametrize("path", sorted(p for p in RUST.rglob("*.rs") if "python" not in p.parts))
def test_no_core_file_is_huge(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(RUST)} has {lines} lines (at most {MAX_LINES})"
