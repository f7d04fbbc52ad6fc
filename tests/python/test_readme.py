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


def test_readme_serve_example_runs_against_a_real_server():
    """The "Serve it" client code, against radixkv serve on the real model (on a free port)."""
    for mod in ("torch", "transformers", "fastapi", "uvicorn", "openai"):
        pytest.importorskip(mod)
    from test_serve import Server, smollm2_unavailable

    if smollm2_unavailable():
        pytest.skip(smollm2_unavailable())
    import radixkv.hf

    server = Server(*radixkv.hf.load("smollm2"))
    try:
        section = README.read_text().split("## Serve it", 1)[1]
        code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        assert "http://127.0.0.1:8000/v1" in code
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), {})
    finally:
        server.close()
    assert out.getvalue().splitlines() == ["turn 0: cached False", "turn 1: cached True"]
