"""What ships with radixkv and what a pip user meets first: the licence pyproject.toml names, one
version everywhere (``radixkv --version``), a changelog entry for it, and a trace inside the
package that ``radixkv replay`` replays when given none."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import radixkv
from radixkv.apps import cli

ROOT = Path(__file__).resolve().parents[3]


def project_version() -> str:
    """``version`` of pyproject.toml's ``[project]`` table."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^\[project\]\n(?:(?!^\[).*\n)*?version = "([^"]+)"', text, re.M)
    assert match, "pyproject.toml has no [project] version"
    return match.group(1)


def test_license_is_the_apache_2_text_pyproject_names():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = \{ text = "Apache-2.0" \}', pyproject, re.M)
    assert re.search(r'^license = "Apache-2.0"', (ROOT / "Cargo.toml").read_text(), re.M)
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    sections = [
        "1. Definitions.",
        "2. Grant of Copyright License.",
        "3. Grant of Patent License.",
        "4. Redistribution.",
        "5. Submission of Contributions.",
        "6. Trademarks.",
        "7. Disclaimer of Warranty.",
        "8. Limitation of Liability.",
        "9. Accepting Warranty or Additional Liability.",
    ]
    assert [s for s in sections if s in text] == sections
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 150


def test_one_version_everywhere(capsys):
    version = project_version()
    assert radixkv.__version__ == version
    cargo = re.search(r'^version = "([^"]+)"', (ROOT / "Cargo.toml").read_text(), re.M)
    assert cargo and cargo.group(1) == version
    try:
        assert importlib.metadata.version("radixkv") == version  # the installed build
    except importlib.metadata.PackageNotFoundError:
        pass
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"radixkv {version}"


def test_changelog_has_an_entry_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(project_version())}\b", text, re.M), "no entry"
    assert text.startswith("# Changelog\n")


def test_a_sample_trace_ships_in_the_package_and_replays(capsys, tmp_path):
    from radixkv.apps.common.trace import SAMPLE_TRACE, read_trace

    package = Path(radixkv.__file__).resolve().parent
    assert SAMPLE_TRACE.is_file() and package in SAMPLE_TRACE.parents
    assert (SAMPLE_TRACE.parent / "README.md").is_file()  # its origin and licence
    requests = list(read_trace(SAMPLE_TRACE))
    assert len(requests) == 1000 and sum(len(r.tokens) for r in requests) > 10**7
    # `radixkv replay` with no trace replays it.
    argv = ["replay", "--limit", "100", "--policy", "lpm", "--no-chart"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "the sample shipped with radixkv" in out and "100 requests" in out and "lpm" in out
    # A trace that does not exist says where to get one.
    assert cli.main(["replay", str(tmp_path / "nope.jsonl"), "--no-chart"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "without TRACE replays the sample" in err
    assert "github.com/kvcache-ai/Mooncake" in err
