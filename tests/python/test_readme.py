"""The README's torch-loop example runs and prints what the README says it prints."""

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs_and_reuses_the_system_prompt():
    text = README.read_text()
    section = text.split("## Drop it into a torch loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines == [
        "turn 0: 508 tokens, 0 cached",
        "turn 1: 508 tokens, 500 cached",
        "turn 2: 508 tokens, 500 cached",
    ]


def test_readme_transformers_example_runs_and_reuses_the_prefix():
    pytest.importorskip("transformers")
    text = README.read_text()
    section = text.split("## With transformers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    assert out.getvalue().splitlines() == [
        "engine turn 0: 508 tokens, 0 cached",
        "engine turn 1: 520 tokens, 511 cached",
        "generate turn 0: 508 tokens, 0 cached",
        "generate turn 1: 508 tokens, 500 cached",
    ]
