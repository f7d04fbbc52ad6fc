"""The tests' own layout: test modules in folders (none loose in tests/python), helpers in
tests/python/support (on pytest's ``pythonpath``, so no test edits ``sys.path``), and every test
file's name unique across tests/, because pytest imports each as a top-level module named after
its file: two ``test_x.py`` in one run are an import error, or the second one's tests silently
replaced by the first's where one module imports the other by name."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TESTS = ROOT / "tests"
PYTHON = TESTS / "python"


def pytest_modules() -> list[Path]:
    """Every pytest module under tests/ (the Rust integration tests are *.rs)."""
    return sorted(TESTS.rglob("test_*.py"))


def test_test_file_names_are_unique():
    by_name = collections.defaultdict(list)
    for path in pytest_modules():
        by_name[path.name].append(str(path.relative_to(TESTS)))
    assert len(by_name) > 80, "the walk found the tests"
    twins = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not twins, f"test files of the same name: {twins}"


def test_python_tests_live_in_folders_and_helpers_in_support():
    loose = sorted(p.name for p in PYTHON.glob("*.py") if p.name != "conftest.py")
    assert not loose, f"in tests/python itself (a folder or support/ holds them): {loose}"
    in_support = sorted(p.name for p in (PYTHON / "support").rglob("test_*.py"))
    assert not in_support, f"test modules among the helpers of tests/python/support: {in_support}"


def test_no_test_edits_sys_path():
    edits = [
        f"{path.relative_to(TESTS)}:{n}"
        for path in sorted(TESTS.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bsys\.path\.(insert|append|extend)\b|\bsys\.path\s*=", line)
    ]
    assert not edits, f"sys.path edited (tests/python/support is on pytest's pythonpath): {edits}"


def test_support_is_on_pytests_pythonpath():
    tomllib = pytest.importorskip("tomllib", reason="tomllib comes with Python 3.11")
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "tests/python/support" in ini["pythonpath"]
    assert "robust: " in " ".join(ini["markers"])  # the marker is registered (--strict-markers)
