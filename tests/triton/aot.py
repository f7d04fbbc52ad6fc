"""The Triton backend's launches compiled ahead of time for real GPUs, on a machine without one,
and what each compiled kernel uses: registers, local memory (spills), shared memory, async
copies, wgmma.

    PYTHONPATH=python python tests/triton/aot.py [--archs 80,90,100]
        [--dtypes float16,bfloat16,float32] [--head-dims 64,128,256] [--groups 4]
        [--flags none,all] [--launches decode,prefill,mixed] [--json]
    PYTHONPATH=python python tests/triton/aot.py --sweep [--archs ...]   # candidate tiles

How: the launch functions of ``triton_kernels`` run as the backend calls them, over CPU tensors
of the launch's shapes, while Triton's active driver is a stand-in that names the target GPU and
a ``jit_cache_hook`` takes each compile request in place of compiling and launching. A request
holds what a launch on that GPU would compile: the signature with the divisibility
specializations of the real arguments, the constexprs, warps and stages. Each is then compiled
by ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))``; the cubin is read
with ``cuobjdump --dump-resource-usage`` (registers, stack frame: local memory, where spills go)
and ``cuobjdump -sass`` (LDGSTS/UTMALDG: async copies; HGMMA/UTCHMMA: warpgroup MMA) from
Triton's own ``backends/nvidia/bin``; where a tool is missing, the PTX is read instead
(``cp.async``, ``wgmma``) and the registers are not known (said so in ``missing``).

The kernels must be compiled, not interpreted: run without ``TRITON_INTERPRET`` (``test_aot.py``
starts a process of its own). Compiled kernels are cached by Triton under
``$TRITON_CACHE_DIR`` (default here: ``target/triton-aot`` of the repository).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Shared memory a block may use (opt-in), per architecture: CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability" (163 KB on 8.0; 99 KB on 8.6, 8.9 and
#: 12.0; 227 KB on 9.0 and 10.0). A target launches the table entries of its family
#: (``triton_kernels.family``: 8.9 those of 8.6).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024,
                100: 227 * 1024, 120: 99 * 1024}  # fmt: skip


def _tool(name: str) -> str | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else shutil.which(name)


class _Target:
    """A stand-in for Triton's GPU driver that names a target and launches nothing (the
    compile hook below refuses every compile, so nothing reaches a launch)."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)
        self.arch = arch

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return self.arch  # one binder cache per target

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


def capture(arch: int, launch: Callable[[], None]) -> list[tuple[Any, dict[str, Any]]]:
    """The compile requests ``launch()`` makes on a GPU of ``arch``: (kernel, request)."""
    from triton import knobs
    from triton.runtime import driver

    got: list[tuple[Any, dict[str, Any]]] = []

    def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
        got.append((fn.jit_function, compile))
        return True  # not compiled, not launched

    driver.set_active(_Target(arch))  # type: ignore[arg-type]
    knobs.runtime.jit_cache_hook = hook
    try:
        launch()
    finally:
        knobs.runtime.jit_cache_hook = None
        try:
            driver.reset_active()
        except RuntimeError:  # no GPU driver on this machine: the stand-in stays, unused
            pass
    return got


def _read_cubin(cubin: bytes) -> tuple[dict[str, int] | None, str | None]:
    """(resource usage, SASS) of a cubin, each None where cuobjdump is missing."""
    tool = _tool("cuobjdump")
    if tool is None:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [tool, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = next(x for x in usage.splitlines() if "REG:" in x)
    fields = dict(x.split(":", 1) for x in line.split() if ":" in x)
    return {k: int(v) for k, v in fields.items() if v.isdigit()}, sass


def build(arch: int, jit_fn: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Compiles one request for ``arch`` and reads what the kernel uses."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(jit_fn, request["signature"], request["constants"], request["configs"][0])
    options = {"num_warps": request["num_warps"], "num_stages": request["num_stages"]}
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    usage, sass = _read_cubin(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    names = jit_fn.arg_names
    consts = {names[k[0]]: v for k, v in request["constants"].items() if len(k) == 1}
    out: dict[str, Any] = {
        "kernel": jit_fn.__name__,
        "arch": arch,
        "warps": request["num_warps"],
        "stages": request["num_stages"],
        "block_n": consts.get("BLOCK_N"),
        "rows": consts.get("BLOCK_H") or consts.get("BLOCK_Q", 0) * consts.get("GP", 0) or None,
        "shared": int(kernel.metadata.shared),
        "shared_limit": SHARED_LIMIT[arch],
        "missing": [],
    }
    if usage is None:
        out["missing"].append("cuobjdump: registers and local memory unknown, PTX read")
        out["regs"] = out["spill_bytes"] = None
        out["async_copies"] = "cp.async" in ptx
        out["wgmma"] = "wgmma" in ptx
    else:
        out["regs"] = usage["REG"]
        out["spill_bytes"] = usage["STACK"] + usage["LOCAL"]
        out["spill_stores"] = sum(1 for x in (sass or "").splitlines() if " STL" in x)
        out["async_copies"] = any(op in (sass or "") for op in ("LDGSTS", "UTMALDG"))
        out["wgmma"] = any(op in (sass or "") for op in ("HGMMA", "UTCHMMA", "UTCQMMA"))
    return out


def launches(
    arch: int, dtype_name: str, head_dim: int, group: int, flags: bool, tiles: Any = None
) -> list[tuple[str, Callable[[], None]]]:
    """The launches the backend makes over a pool of ``dtype_name`` and ``head_dim`` with
    ``group`` query heads per KV head, each named: decode at one split (no merge) and at
    several (split and merge), prefill with its large and its small tile, a mixed step (the
    prefill's large tile, then its decode rows picked by index at one split and at several);
    ``flags``: window, softcap and sinks all on. ``tiles``: (decode, prefill) tiles to launch
    in place of the table's."""
    import torch

    from radixkv.kv.backends import triton_kernels as tk

    dtype = getattr(torch, dtype_name)
    arch = tk.family(arch)  # the entries of the table the GPU compiled for launches
    hkv, p, b = 2, 16, 2
    hq = hkv * group
    dec_cfg, pre_cfg = tiles if tiles is not None else (None, None)
    q = torch.zeros(b, hq, head_dim, dtype=dtype)
    pool = torch.zeros(64 * p, hkv, head_dim, dtype=dtype)
    table = torch.zeros(b, 8, dtype=torch.int32)
    lens = torch.ones(b, dtype=torch.int32)
    extra: dict[str, Any] = {}
    if flags:
        extra = dict(window=100, softcap=30.0, sinks=torch.zeros(hq, dtype=torch.float32))
    qo = torch.tensor([0, b], dtype=torch.int32)
    tile = (torch.zeros(1, dtype=torch.int32),) * 2
    rows = (pre_cfg or tk.prefill_config(arch, dtype, head_dim)).block_m

    def decode(splits: int) -> None:
        tk.paged_decode(
            q, pool, pool, table, lens, 0.1, p, splits=splits, config=dec_cfg, arch=arch, **extra
        )

    def prefill(max_q: int) -> None:
        block_q = tk.prefill_block_q(group, max_q, rows)
        tk.paged_prefill(
            q, pool, pool, table[:1], lens[:1], qo, tile, block_q, 0.1, p, config=pre_cfg,
            arch=arch, **extra,
        )  # fmt: skip

    def mixed(splits: int) -> None:
        block_q = tk.prefill_block_q(group, 4096, rows)
        qo_mixed = torch.tensor([0, 1, 2], dtype=torch.int32)
        decode_rows = (torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32))
        tk.paged_mixed(
            q, pool, pool, table, lens, qo_mixed, tile, block_q, decode_rows, 0.1, p,
            splits=splits, configs=(dec_cfg, pre_cfg), arch=arch, **extra,
        )  # fmt: skip

    return [
        ("decode, 1 split", lambda: decode(1)),
        ("decode, 2 splits", lambda: decode(2)),
        ("prefill, large tile", lambda: prefill(4096)),
        ("prefill, small tile", lambda: prefill(1)),
        ("mixed, 1 split", lambda: mixed(1)),
        ("mixed, 2 splits", lambda: mixed(2)),
    ]


def check(
    archs: list[int],
    dtypes: list[str],
    head_dims: list[int],
    groups: list[int],
    flag_sets: list[bool],
    only: tuple[str, ...] = (),
) -> Iterator[dict[str, Any]]:
    """Every launch of the table's configs (those whose name starts with one of ``only``, when
    given), compiled and read."""
    for arch in archs:
        for dt in dtypes:
            for d in head_dims:
                for g in groups:
                    for flags in flag_sets:
                        for label, launch in launches(arch, dt, d, g, flags):
                            if only and not label.startswith(only):
                                continue
                            for fn, req in capture(arch, launch):
                                r = build(arch, fn, req)
                                r.update(launch=label, dtype=dt, head_dim=d, group=g, flags=flags)
                                yield r


def sweep(
    archs: list[int], dtypes: list[str], head_dims: list[int], cand: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """Candidate tiles (``cand``: block_n, warps, stages, rows lists, and which kernels), each
    compiled and read: the data the table was chosen from (the largest tiles with no spills,
    within shared memory)."""
    from radixkv.kv.backends.triton_kernels import Tiles

    grid = itertools.product(
        archs, dtypes, head_dims, cand["block_n"], cand["warps"], cand["stages"], cand["rows"]
    )
    for arch, dt, d, n, warps, stages, m in grid:
        tiles = (Tiles(n, warps, stages), Tiles(n, warps, stages, m))
        requests = [  # a mixed step's launches are the same tiles (checked by check())
            x
            for label, run in launches(arch, dt, d, 4, False, tiles)
            if not label.startswith("mixed")
            for x in capture(arch, run)
        ]
        for fn, req in requests:
            name = fn.__name__
            if name == "_decode_merge":
                continue
            once = m == cand["rows"][0]
            if name == "_decode_split" and ("decode" not in cand["kernels"] or not once):
                continue  # decode tiles do not depend on rows: once
            if name == "_prefill" and ("prefill" not in cand["kernels"] or _rows(fn, req) != m):
                continue  # the small tile of this launch: swept at rows 16
            try:
                r = build(arch, fn, req)
            except Exception as e:  # out of shared memory, say
                r = {"kernel": name, "error": str(e).splitlines()[0][:120]}
            r.update(arch=arch, dtype=dt, head_dim=d, block_n=n, warps=warps, stages=stages)
            yield r


def _rows(fn: Any, req: dict[str, Any]) -> int:
    names = fn.arg_names
    c = {names[k[0]]: v for k, v in req["constants"].items() if len(k) == 1}
    return int(c["BLOCK_Q"] * c["GP"])


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--archs", default="80,90,100")
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--groups", default="4", help="query heads per KV head")
    ap.add_argument("--flags", default="none,all", help="none: plain; all: window+softcap+sinks")
    ap.add_argument("--launches", default="", help="only launches named so: decode,prefill,mixed")
    ap.add_argument("--sweep", action="store_true", help="candidate tiles, not the table's")
    ap.add_argument("--json", action="store_true", help="one JSON object a line")
    ap.add_argument("--block-n", default="16,32,64,128", help="--sweep: keys a loop step")
    ap.add_argument("--warps", default="4,8", help="--sweep: warps")
    ap.add_argument("--stages", default="1,2,3", help="--sweep: pipeline stages")
    ap.add_argument("--rows", default="16,32,64,128", help="--sweep: prefill tile rows")
    ap.add_argument("--kernels", default="decode,prefill", help="--sweep: which kernels")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / "target" / "triton-aot"))
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    archs, dims = _ints(args.archs), _ints(args.head_dims)
    dtypes = args.dtypes.split(",")
    if args.sweep:
        cand: dict[str, Any] = {
            k: _ints(getattr(args, k)) for k in ("block_n", "warps", "stages", "rows")
        }
        cand["kernels"] = args.kernels.split(",")
        rows = sweep(archs, dtypes, dims, cand)
    else:
        flag_sets = [{"none": False, "all": True}[f] for f in args.flags.split(",")]
        only = tuple(x for x in args.launches.split(",") if x)
        rows = check(archs, dtypes, dims, _ints(args.groups), flag_sets, only)
    for r in rows:
        if args.json:
            print(json.dumps(r), flush=True)
            continue
        if "error" in r:
            print(
                f"sm_{r['arch']} {r['dtype']:<8} D={r['head_dim']:<3} {r['kernel']:<13} "
                f"N={r['block_n']} w={r['warps']} s={r['stages']}: {r['error']}",
                flush=True,
            )
            continue
        print(
            f"sm_{r['arch']} {r['dtype']:<8} D={r['head_dim']:<3} {r.get('launch', ''):<19} "
            f"{r['kernel']:<13} rows={r['rows']} N={r['block_n']} w={r['warps']} s={r['stages']} "
            f"{'flags ' if r.get('flags') else ''}regs={r['regs']} spill={r['spill_bytes']} "
            f"shared={r['shared']} async={int(r['async_copies'])} wgmma={int(r['wgmma'])}"
            + (f" ({'; '.join(r['missing'])})" if r["missing"] else ""),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
