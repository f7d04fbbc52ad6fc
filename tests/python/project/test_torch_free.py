"""A torch-free install (``pip install radixkv``, no extra), simulated in a subprocess where
``import torch`` fails: the core works, every torch-layer name says in one line which extra to
install, and ``help(radixkv)``, ``dir(radixkv)`` and ``from radixkv import *`` work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Runs ARGV[1] (Python code) with torch made unimportable first, as on a torch-free install.
PRELUDE = "import sys\nsys.modules['torch'] = None  # `import torch` raises ModuleNotFoundError\n"

#: The torch layer's names, as attributes of radixkv and as modules.
NAMES = ["KVCache", "Step", "Engine", "Session", "StreamEvent", "models"]
MODULES = ["radixkv.kv", "radixkv.models", "radixkv.engine"]

INSTALL = "pip install 'radixkv[torch]'"


def without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=120
    )


def test_torch_names_say_which_extra_to_install():
    code = f"""
import importlib, json
import radixkv
out = {{}}
for name in {NAMES!r}:
    try:
        getattr(radixkv, name)
        out[name] = None
    except ModuleNotFoundError as e:
        out[name] = [str(e), e.name]
for mod in {MODULES!r}:
    try:
        importlib.import_module(mod)
        out[mod] = None
    except ModuleNotFoundError as e:
        out[mod] = [str(e), e.name]
print(json.dumps(out))
"""
    proc = without_torch(code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for name in NAMES + MODULES:
        what = name if name.startswith("radixkv.") else f"radixkv.{name}"
        assert got[name] is not None, f"{what} imported without torch"
        message, missing = got[name]
        assert missing == "torch"  # still a ModuleNotFoundError for torch, as before
        assert message == f"{what} needs torch, which is not installed: {INSTALL}", message
        assert "\n" not in message


def test_help_dir_and_star_import_work_without_torch():
    code = """
import io, json, pydoc
import radixkv
buf = io.StringIO()
pydoc.doc(radixkv, output=buf)
ns = {}
exec("from radixkv import *", ns)
print(json.dumps({"help": buf.getvalue(), "dir": dir(radixkv), "all": radixkv.__all__,
                  "star": sorted(k for k in ns if not k.startswith("__"))}))
"""
    proc = without_torch(code)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert "RadixCache" in got["help"] and "block_hashes" in got["help"]
    assert "RadixCache" in got["star"] and "Scheduler" in got["star"]
    for name in NAMES:
        assert name not in got["all"] and name not in got["star"] and name not in got["dir"]
    assert sorted(got["all"]) == got["star"]


def test_the_torch_names_are_listed_where_torch_is_installed():
    pytest.importorskip("torch")
    import radixkv

    for name in NAMES:
        assert name in radixkv.__all__ and name in dir(radixkv)


def test_demo_without_torch_is_one_line_naming_the_extra(tmp_path):
    code = f"""
from radixkv.apps.cli import main
sys.exit(main(["demo", "--quick", "--random", "--out", {str(tmp_path)!r}]))
"""
    proc = without_torch(code)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"radixkv: error: demo needs torch, which is not installed: {INSTALL}"]
    assert proc.stdout == ""
