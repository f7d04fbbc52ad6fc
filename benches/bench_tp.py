"""tp: what tensor-parallel lockstep costs per step, 2 gloo processes on CPU.

    .venv/bin/python benches/bench_tp.py [--quick]

Rank 0 drives a workload (shared system prompt, arrivals between steps, greedy decoding) on an
engine over its shard of a small model; rank 1 follows. Printed per step, beside the step time
of the same run: the broadcast of rank 0's calls (a count, plus a payload on the steps that
carry calls) and the per-step check (one all-gather of four int64, with the cache's state digest
every ``digest_every`` steps). Baseline in the same run: one process stepping the whole model
through the same workload. Also the cost of ``state_digest()`` alone on a full pool of each
cache kind. Nothing is asserted; figures vary with the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np
import torch

import radixkv
from common import table
from radixkv.models import CausalLM, ModelConfig


def config(quick: bool) -> ModelConfig:
    if quick:
        return ModelConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
        )
    return ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
    )


def drive(eng: radixkv.Engine, quick: bool) -> None:
    """Arrivals every few steps, then run to the end."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, eng.vocab_size, 64)
    waves = 2 if quick else 6
    for _ in range(waves):
        for _ in range(4):
            tail = rng.integers(0, eng.vocab_size, int(rng.integers(8, 48)))
            eng.submit(np.concatenate([system, tail]), max_new_tokens=8 if quick else 24)
        for _ in range(4):
            eng.step()
    eng.run()


def make(model: CausalLM, **kw) -> radixkv.Engine:
    kv = model.make_kv_cache(radixkv.RadixCache(512, page_size=4))
    return radixkv.Engine(model, kv, token_budget=256, max_batch=16, **kw)


def worker(rank: int, port: int, out: str, quick: bool) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    model = CausalLM.random(config(quick), seed=0).shard(rank, 2)
    eng = make(model, group=torch.distributed.group.WORLD, digest_every=16)
    t = time.perf_counter()
    if rank == 0:
        drive(eng, quick)
        eng.close()
    else:
        eng.follow()
    wall = time.perf_counter() - t
    lock = eng.lockstep
    assert lock is not None
    report = {
        "steps": eng.stats.steps,
        "lockstep_steps": lock.steps,
        "wall": wall,
        "send": lock.send_s,
        "check": lock.check_s,
        "payloads": lock.payloads,
        "outputs": [eng.result(i).output for i in sorted(eng.sequences)],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()  # both reports are written
    # No teardown: gloo's process group, destroyed while the other rank exits, sometimes aborts
    # the process from a background thread. The reports are on disk; the OS closes the sockets.
    os._exit(0)


def single(quick: bool) -> tuple[float, int, list]:
    torch.set_num_threads(1)
    eng = make(CausalLM.random(config(quick), seed=0))
    t = time.perf_counter()
    drive(eng, quick)
    wall = time.perf_counter() - t
    return wall, eng.stats.steps, [eng.result(i).output for i in sorted(eng.sequences)]


def digest_cost(num_pages: int) -> list[list[str]]:
    """``state_digest()`` on a pool full of cached pages, and ``stats`` as the baseline."""
    rows = []
    for name, cache, p in (
        ("radix p=16", radixkv.RadixCache(num_pages, page_size=16), 16),
        ("block p=16", radixkv.BlockCache(num_pages, page_size=16), 16),
    ):
        rng = np.random.default_rng(1)
        per = 64 * p
        for _ in range(num_pages * p // per):
            tokens = rng.integers(0, 1 << 20, per + 1).astype(np.uint32)
            r = cache.admit(tokens)
            cache.commit(r, per)
            cache.finish(r)
        reps = 20
        t = time.perf_counter()
        for _ in range(reps):
            cache.state_digest()
        dig = (time.perf_counter() - t) / reps
        t = time.perf_counter()
        for _ in range(reps):
            _ = cache.stats
        base = (time.perf_counter() - t) / reps
        cached = num_pages - cache.stats.free_pages
        rows.append(
            [
                name,
                f"{cached:,}",
                f"{dig * 1e3:.3f} ms",
                f"{base * 1e6:.1f} us",
                f"{dig / base:.0f}x",
            ]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds: a tiny model")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(worker, args=(port, out, args.quick), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    wall1, steps1, outputs1 = single(args.quick)
    same = ranks[0]["outputs"] == ranks[1]["outputs"] == outputs1
    print(f"== tensor-parallel lockstep, 2 gloo ranks on CPU ({'quick' if args.quick else 'full'})")
    print(f"outputs equal on both ranks and to one process: {same}")
    rows = [["one process, whole model", f"{steps1}", f"{wall1 / steps1 * 1e3:.2f} ms", "", "", ""]]
    for r, rep in enumerate(ranks):
        n = rep["lockstep_steps"]
        step = rep["wall"] / n
        send = rep["send"] / n
        check = rep["check"] / n
        rows.append(
            [
                f"rank {r}, half the heads",
                f"{n}",
                f"{step * 1e3:.2f} ms",
                f"{send * 1e6:.0f} us" if r == 0 else "(receives)",
                f"{check * 1e6:.0f} us",
                f"{(send + check) / step:.1%}",
            ]
        )
    table(["engine", "steps", "step", "broadcast", "check", "share of step"], rows)
    print(f"steps whose broadcast carried calls: {ranks[0]['payloads']} of {ranks[0]['steps']}")
    print()
    num_pages = 4096 if args.quick else 65536
    print(f"== state_digest() on a full pool of {num_pages:,} pages (baseline: cache.stats)")
    table(["cache", "cached pages", "digest", "stats", "ratio"], digest_cost(num_pages))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
