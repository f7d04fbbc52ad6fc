"""`radixkv serve --cache-dir`: an agent's context outlives the server process. The server saves
its disk tier on SIGTERM; one started again on the directory (its checkpoint moved to another
path) serves the next turn from it (the real model, the real command, the `openai` client), with
the text a cold server gives; a directory written for another dtype is refused with a clear
message."""

from __future__ import annotations

import os
import subprocess

import serve_process

openai = serve_process.needs_real_server()
from serve_process import free_port  # noqa: E402

SYSTEM = (
    "You are a careful assistant for a build system. Answer in one short sentence. "
    "Tools: read_file(path) returns a file; run(cmd) runs a shell command; search(q) greps the "
    "repository. Prefer reading before running."
)


def options(cache_dir, *extra: str) -> list[str]:
    """The server's options: a small pool, page 16, a host tier and the disk tier in
    ``cache_dir``."""
    pool = ["--num-pages", "512", "--page-size", "16", "--host-pages", "256"]
    return [*pool, "--cache-dir", str(cache_dir), *extra]


def chat(port: int, messages: list[dict]) -> tuple[str, int, int]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0
    )
    details = r.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    return r.choices[0].message.content, r.usage.prompt_tokens, cached or 0


def stop(proc: subprocess.Popen) -> str:
    rc, err = serve_process.stop(proc)
    assert rc == 0, f"radixkv serve exited {rc} after SIGTERM: {err}"
    return err


def linked_checkpoint(where) -> str:
    """The converted SmolLM2 checkpoint, as a directory ``where`` of links to its files (a copy
    at another path, without copying 500 MB)."""
    from radixkv.hf._load import _converted, smollm2_path

    source = _converted(smollm2_path())
    where.mkdir(parents=True)
    for f in source.iterdir():
        (where / f.name).symlink_to(f)
    return str(where)


def test_a_restarted_server_serves_the_next_turn_from_disk(tmp_path):
    """The restarted server loads the first one's checkpoint moved to another path (a moved
    checkpoint, another model cache or $HOME): the same weights compute the same KV, so it finds
    the pages the first one saved. (One test for both, so that the servers start three times,
    not five: a start is most of ten seconds here.)"""
    first = linked_checkpoint(tmp_path / "models" / "smollm2")
    named = ("--served-model-name", "smollm2")  # the name chat() asks for, wherever it lives
    turn1 = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which tool shows me the Makefile?"},
    ]
    port = free_port()
    proc = serve_process.start(port, *options(tmp_path / "cache", "--model", first, *named))
    try:
        reply, _, _ = chat(port, turn1)
        err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "saved the disk tier" in err, err
    moved = tmp_path / "moved" / "smollm2-instruct"
    moved.parent.mkdir()
    os.rename(first, moved)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And which one runs the tests?"},
    ]
    answers, errs = {}, {}
    for name, extra in (
        ("restarted", options(tmp_path / "cache", "--model", str(moved), *named)),
        ("cold", options(tmp_path / "cold")),
    ):
        port = free_port()
        proc = serve_process.start(port, *extra)
        try:
            answers[name] = chat(port, turn2)
            errs[name] = stop(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
    text, prompt_tokens, cached = answers["restarted"]
    cold_text, _, cold_cached = answers["cold"]
    assert cold_cached == 0
    assert "restored" in errs["restarted"], errs["restarted"]
    # The whole first turn (system prompt, question, reply) came back from disk, but for the
    # last partial page and what the chat template adds after it.
    assert cached >= prompt_tokens - 40, (cached, prompt_tokens)
    assert text == cold_text


def test_a_directory_of_another_dtype_is_refused(tmp_path):
    port = free_port()
    proc = serve_process.start(port, *options(tmp_path / "cache"))
    try:
        chat(port, [{"role": "user", "content": "Say hi."}])
        stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    rc, err = serve_process.exit_of(
        free_port(), *options(tmp_path / "cache", "--dtype", "bfloat16"), timeout=180
    )
    assert rc != 0
    assert "dtype" in err and "float32" in err and "bfloat16" in err, err
    assert "Traceback" not in err, err


def test_a_second_server_on_the_directory_is_refused_naming_the_first(tmp_path):
    """The second server is refused before it loads its model: its ``--model`` is a directory
    that holds no checkpoint, which it would fail to load (another error) had it tried."""
    port = free_port()
    proc = serve_process.start(port, *options(tmp_path / "cache"))
    try:
        chat(port, [{"role": "user", "content": "Say hi."}])
        (tmp_path / "no-model").mkdir()
        second = ["--model", str(tmp_path / "no-model"), *options(tmp_path / "cache")]
        rc, err = serve_process.exit_of(free_port(), *second, timeout=180)
        assert rc == 2, err
        assert f"in use by process {proc.pid} on " in err and "Traceback" not in err, err
        # The first one goes on serving, and saves its tier whole.
        chat(port, [{"role": "user", "content": "Say hi again."}])
        assert "saved the disk tier" in stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
