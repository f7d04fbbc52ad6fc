"""The command line: ``python -m radixkv demo --quick`` end to end, and the lazy import."""

from __future__ import annotations

import os
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
        [sys.executable, "-m", "radixkv", "demo", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # tiny model: see tiny_model.py
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "demo_ttft.png").read_bytes()[:8] == PNG
    assert "outputs identical with and without caching: yes" in proc.stdout
    rows = table_rows(proc.stdout)
    assert set(rows) == {"turn 1", "turn 2", "turn 3", "sub 1", "sub 2"}
    prompt, cached, computed = (int(x) for x in rows["turn 3"][:3])
    assert cached > 0 and cached + computed == prompt
    assert "100%" in proc.stderr  # the progress bar ran to the end


def test_demo_block_cache_in_process(tmp_path, capsys):
    assert cli.main(["demo", "--quick", "--cache", "block", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cache: block, page size 16" in out and "identical with and without caching: yes" in out
    assert (tmp_path / "demo_ttft.png").read_bytes()[:8] == PNG
    assert int(table_rows(out)["turn 3"][1]) > 0  # the block cache hits too (cached tokens)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_demo_through_the_scheduler(tmp_path, capsys, policy):
    assert cli.main(["demo", "--quick", "--policy", policy, "--out", str(tmp_path)]) == 0
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
