"""Every launch of the Triton backend, compiled ahead of time for sm_80, sm_90 and sm_100 on a
machine without a GPU (``aot.py``: Triton compiles for a named target; cuobjdump reads the
cubin), checked for what a GPU run would suffer from without failing: local-memory spills,
shared memory past the target's limit, half-type K/V loads that are not async copies, an sm_90
prefill without wgmma, a decode launch of one split that still launches the merge kernel, a
mixed step whose decode rows do not run on the split kernel.

The quick case (run by ``make test-triton``) compiles Llama-3-8B's head dim in bf16 and fp32 on
the three targets; the slow ones every dtype, head dims 16 to 256, with and without window,
softcap and sinks, groups of 1 and 16, and the 99 KB targets sm_86/89/120. Compiled kernels are
cached by Triton under ``target/triton-aot``, so a rerun of unchanged kernels takes seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

AOT = Path(__file__).resolve().parent / "aot.py"
ROOT = AOT.parents[2]


def compile_all(*args: str) -> list[dict]:
    """The records of ``aot.py --json ARGS``, run in a process of its own without
    ``TRITON_INTERPRET`` (the kernels compiled, not interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "python"), *filter(None, [env.get("PYTHONPATH")])]
    )
    run = subprocess.run(
        [sys.executable, str(AOT), "--json", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]


def check(records: list[dict]) -> None:
    assert records, "nothing was compiled"
    problems = []
    for r in records:
        where = (
            f"sm_{r['arch']} {r['dtype']} head dim {r['head_dim']} group {r['group']}"
            f"{' +window/softcap/sinks' if r['flags'] else ''} {r['launch']}: {r['kernel']} "
            f"({r['warps']} warps, {r['stages']} stages, block_n {r['block_n']}, rows {r['rows']})"
        )
        for note in r["missing"]:
            print(f"{where}: {note}")  # said, and what can be checked is
        if r["spill_bytes"]:
            problems.append(f"{where}: {r['spill_bytes']} bytes of local memory (spills)")
        if r["shared"] > r["shared_limit"]:
            problems.append(f"{where}: {r['shared']} bytes of shared memory > {r['shared_limit']}")
        half = r["dtype"] != "float32"
        if half and r["kernel"] in ("_decode_split", "_prefill") and not r["async_copies"]:
            problems.append(f"{where}: K/V not loaded by async copies")
        big = r["rows"] is not None and r["rows"] >= 64
        if half and r["arch"] == 90 and r["kernel"] == "_prefill" and big and not r["wgmma"]:
            problems.append(f"{where}: no wgmma in an sm_90 prefill tile of {r['rows']} rows")
    # One split writes the output itself; several are merged by a second kernel.
    by_launch: dict[tuple, list[str]] = {}
    for r in records:
        key = (r["arch"], r["dtype"], r["head_dim"], r["group"], r["flags"], r["launch"])
        by_launch.setdefault(key, []).append(r["kernel"])
    for key, kernels in by_launch.items():
        if key[-1] == "decode, 1 split" and kernels != ["_decode_split"]:
            problems.append(f"{key}: launched {kernels}, not the split kernel alone")
        if key[-1] == "decode, 2 splits" and kernels != ["_decode_split", "_decode_merge"]:
            problems.append(f"{key}: launched {kernels}, not split then merge")
        # A mixed step: its prefill, then its decode rows on the split kernel.
        if key[-1] == "mixed, 1 split" and kernels != ["_prefill", "_decode_split"]:
            problems.append(f"{key}: launched {kernels}, not prefill then the split kernel")
        if key[-1] == "mixed, 2 splits" and kernels != [
            "_prefill",
            "_decode_split",
            "_decode_merge",
        ]:
            problems.append(f"{key}: launched {kernels}, not prefill, split, merge")
    assert not problems, "\n".join(problems)


def test_llama_head_dim_compiles_clean_for_sm80_sm90_sm100():
    check(
        compile_all(
            "--archs", "80,90,100", "--dtypes", "bfloat16,float32", "--head-dims", "128",
            "--groups", "4", "--flags", "none",
        )
    )  # fmt: skip


@pytest.mark.slow
def test_every_config_compiles_clean_for_sm80_sm90_sm100():
    check(
        compile_all(
            "--archs", "80,90,100", "--dtypes", "float16,bfloat16,float32",
            "--head-dims", "16,32,64,128,256", "--groups", "4", "--flags", "none,all",
        )
    )  # fmt: skip
    check(
        compile_all(
            "--archs", "80,90,100", "--dtypes", "float16,bfloat16,float32",
            "--head-dims", "64,128,256", "--groups", "1,16", "--flags", "none",
        )
    )  # fmt: skip


@pytest.mark.slow
def test_99_kb_gpus_fit_their_shared_memory():
    """sm_86/89 take the sm_80 entries and sm_120 the sm_100 ones, with 99 KB of shared
    memory a block instead of 163/227: every launch fits (and spills nothing) there too."""
    check(
        compile_all(
            "--archs", "86,89,120", "--dtypes", "float16,bfloat16,float32",
            "--head-dims", "64,128,256", "--groups", "4", "--flags", "none",
        )
    )  # fmt: skip
