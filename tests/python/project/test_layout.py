"""The package layout: no import cycle between radixkv's modules, and each layer imports only the
layers below it (core <- kv <- models <- engine <- hf <- apps).

Every ``import`` statement counts: at module level, inside functions and under
``TYPE_CHECKING`` alike. Importing ``a.b.c`` also runs the packages ``a`` and ``a.b``; those are
edges too, except for a package that contains the importing module (it is already running).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3] / "python"

#: Subpackages from the bottom up; a module may import its own layer and those before it.
LAYERS = [
    "radixkv._radixkv",
    "radixkv",
    "radixkv.kv",
    "radixkv.models",
    "radixkv.engine",
    "radixkv.hf",
    "radixkv.apps",
]


def modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the package."""
    out = {}
    for path in sorted((ROOT / "radixkv").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The radixkv modules that importing ``name`` runs directly."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                base = f"{anchor}.{base}" if base else anchor
            targets.add(base)
            # ``from pkg import sub`` runs the submodule ``pkg.sub``.
            targets.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    edges = set()
    for target in targets:
        if target != "radixkv" and not target.startswith("radixkv."):
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            inside = name == mod or name.startswith(mod + ".")
            if mod in known and not inside:
                edges.add(mod)
    return edges


@functools.cache
def graph() -> dict[str, set[str]]:
    """Module -> the radixkv modules importing it runs directly, parsed once a session (every
    parametrized case reads it; none changes it)."""
    mods = modules()
    known = set(mods) | {"radixkv._radixkv"}
    return {name: imports(name, path, known) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``g`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(g):
        if node not in state and (found := visit(node)):
            return found
    return None


#: Modules whose layer is not their folder's: ``python -m radixkv`` runs the command line.
PLACED = {"radixkv.__main__": "radixkv.apps"}


def layer(module: str) -> int:
    module = PLACED.get(module, module)
    within = [i for i, top in enumerate(LAYERS) if module == top or module.startswith(top + ".")]
    return max(within, key=lambda i: len(LAYERS[i]))  # the innermost layer holding it


def test_the_graph_sees_the_package():
    g = graph()
    assert {"radixkv.engine.engine", "radixkv.kv.step", "radixkv.apps.cli"} <= set(g)
    assert "radixkv.engine.batcher" in g["radixkv.engine.engine"]
    assert "radixkv.kv" in g["radixkv.engine.engine"]  # the package that kv.kv_cache runs in


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("module", sorted(modules()))
def test_each_layer_imports_only_the_layers_below(module):
    up = sorted(t for t in graph()[module] if layer(t) > layer(module))
    assert not up, f"{module} (layer {LAYERS[layer(module)]}) imports {up} from a layer above"
