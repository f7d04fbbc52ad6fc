"""``radixkv serve``'s command-line mistakes, run as a subprocess: each is one line,
``radixkv: error: serve: ...`` or ``radixkv: error: ...``, exit status 2, said before the model
is loaded (the runs below make transformers unimportable: a check made after loading would
fail on that instead), and never after a line that claims the server is listening."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")

from radixkv.apps import cli
from test_cli_errors import assert_user_error, radixkv

#: The check that the model was not loaded first: radixkv.hf cannot be imported.
NO_MODEL = "transformers"


def serve_error(*argv: str, needles: tuple[str, ...]) -> None:
    proc = radixkv("serve", *argv, without=NO_MODEL)
    assert_user_error(proc, *needles)
    assert "http://" not in proc.stderr + proc.stdout


def test_a_port_out_of_range():
    serve_error("--port", "99999", needles=("serve: argument --port", "0-65535", "99999"))


def test_a_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        serve_error("--port", str(port), needles=(f"127.0.0.1:{port}", "in use", "--port"))


def test_a_model_path_that_does_not_exist(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    serve_error("--model", missing, needles=(f"--model {missing!r}", "does not exist"))


def test_cuda_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present here")
    serve_error("--device", "cuda", needles=("--device cuda", "no CUDA device"))
    serve_error("--device", "tpu:9", needles=("--device 'tpu:9'", "not a torch device"))


def test_max_model_len_past_the_models_context():
    from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path

    if smollm2_path() is None:
        pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}")
    proc = radixkv("serve", "--port", "0", "--max-model-len", "1000000")  # loads the model
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # after transformers' loading bar
    assert last.startswith("radixkv: error: --max-model-len 1000000"), last
    assert "context length (8192 tokens" in last and "http://" not in proc.stderr


def test_threads_default_never_oversubscribes(monkeypatch):
    from radixkv.apps.serve import cmd as serve_cmd

    monkeypatch.setattr(serve_cmd.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert serve_cmd.default_threads({}) == 1  # two CPUs: one for torch, one for HTTP
    monkeypatch.setattr(serve_cmd.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert serve_cmd.default_threads({}) == 15
    assert serve_cmd.default_threads({"OMP_NUM_THREADS": "3"}) == 3
    monkeypatch.setattr(serve_cmd.os, "sched_getaffinity", lambda pid: {0})
    assert serve_cmd.default_threads({"OMP_NUM_THREADS": ""}) == 1


def test_threads_reach_torch_and_the_startup_line():
    import serve_process
    from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path
    from serve_process import free_port

    if smollm2_path() is None:
        pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}")
    proc = serve_process.start(free_port(), "--num-pages", "64", "--threads", "1", threads=2)
    rc, err = serve_process.stop(proc)
    assert rc == 0, err
    (line,) = [x for x in err.splitlines() if x.startswith("radixkv serve: SmolLM2")]
    assert "1 CPU threads" in line, err
    assert_user_error(radixkv("serve", "--threads", "-1"), "--threads", "-1")


def test_a_chat_template_that_is_no_file_nor_jinja(tmp_path):
    missing = str(tmp_path / "nope.jinja")
    serve_error("--chat-template", missing, needles=(f"--chat-template {missing!r}", "file"))
    serve_error("--chat-template", "{% for m in messages %}", needles=("--chat-template", "Jinja"))
    latin1 = tmp_path / "latin1.jinja"  # not UTF-8: said in one line, not a traceback
    latin1.write_bytes("{{ 'café' }}".encode("latin-1"))
    serve_error("--chat-template", str(latin1), needles=(str(latin1), "utf-8"))


def test_serve_imports_no_other_subcommand():
    # `radixkv serve` parses with serve's own module alone: the other subcommands' modules
    # (and what they import) are not loaded on its start; --help still lists every command.
    others = ",".join(m for name, (m, _) in cli.COMMANDS.items() if name != "serve")
    serve_error("--port", "99999", needles=("serve: argument --port",))
    proc = radixkv("serve", "--port", "99999", without=others)
    assert_user_error(proc, "serve: argument --port", "99999")
    listed = radixkv("--help")
    assert listed.returncode == 0 and all(name in listed.stdout for name in cli.COMMANDS)


def test_a_bad_speculative_config():
    flag = "serve: argument --speculative-config"
    serve_error("--speculative-config", "{method: ngram}", needles=(flag, "not valid JSON"))
    serve_error(
        "--speculative-config",
        '{"method": "eagle", "num_speculative_tokens": 4}',
        needles=(flag, "method", "'eagle'"),
    )
    serve_error(
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 0}',
        needles=(flag, "num_speculative_tokens", ">= 1", "0"),
    )
