"""``radixkv demo --model DIR`` on local transformers checkpoints, and radixkv.hf as an
optional extra: ``import radixkv`` never imports transformers, and ``import radixkv.hf``
without it says how to install it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixkv.apps import cli


def table_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] in ("turn", "sub"):
            rows[f"{parts[0]} {parts[1]}"] = parts[2:]
    return rows


@pytest.mark.parametrize(("arch", "form"), [("llama-llama3", "4.x"), ("qwen3", "5.x")])
def test_demo_on_a_transformers_checkpoint(tmp_path, capsys, arch, form):
    hf_models = pytest.importorskip("hf_models")
    hf_models.save_model(hf_models.build_model(arch, seed=2), tmp_path / "ckpt", form)
    args = ["demo", "--quick", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path)]
    assert cli.main([*args, "--cache", "block"]) == 0
    out = capsys.readouterr().out
    assert "2 layers, hidden 64, 4 q / 2 kv heads, vocab 256 (transformers)" in out
    assert "outputs identical with and without caching: yes" in out
    rows = table_rows(out)
    assert set(rows) == {"turn 1", "turn 2", "turn 3", "sub 1", "sub 2"}
    prompt, cached, computed = (int(x) for x in rows["turn 3"][:3])
    assert cached > 0 and cached + computed == prompt


def test_demo_refuses_a_missing_or_unsupported_model_in_one_line(tmp_path, capsys):
    hf_models = pytest.importorskip("hf_models")
    base = ["demo", "--quick", "--out", str(tmp_path)]
    assert cli.main([*base, "--model", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip().endswith("does not exist")
    # RoPE that transformers recomputes from each forward's length: refused.
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    bad = hf_models.build_model("llama", seed=1, rope_parameters=dynamic)
    hf_models.save_model(bad, tmp_path / "dynamic")
    assert cli.main([*base, "--model", str(tmp_path / "dynamic")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("radixkv: error: demo: --model") and "rope_type='dynamic'" in err
    assert cli.main([*base, "--model", str(tmp_path), "--checkpoint", str(tmp_path)]) == 2
    assert "not both" in capsys.readouterr().err


_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformers":
            raise ImportError("No module named 'transformers'")
sys.meta_path.insert(0, Block())
"""


def test_import_radixkv_never_imports_transformers():
    code = "import sys, radixkv; radixkv.RadixCache(4); assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_radixkv_hf_without_transformers_names_the_extra():
    code = _BLOCK + (
        "import radixkv\n"
        "try:\n    import radixkv.hf\nexcept ImportError as e:\n    print(e)\n"
        "else:\n    raise SystemExit('imported')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pip install radixkv[hf]" in proc.stdout
