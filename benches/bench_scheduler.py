"""Scheduler benchmarks: hit rate per policy, cost of one schedule call, waits with and without
the starvation bound. Every figure is printed beside a baseline measured in the same run.

    .venv/bin/python benches/bench_scheduler.py [--quick] [--mooncake-requests N]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import radixkv
from common import MOONCAKE, mooncake_records
from radixkv.apps.common.trace import TraceRequest, mooncake_tokens
from radixkv.apps.replay.simulate import ReplayConfig, infinite_bound, replay


def seq(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.uint32)


def alternating(
    policy: str, groups: int = 2, per_group: int = 32, prefix: int = 4096, tail: int = 64
):
    """X/Y/X/Y arrivals, all queued at once; the pool holds one prefix (plus a batch's tails).
    One request is served per schedule call and finishes before the next call."""
    pool = prefix + 4 * tail
    cache = radixkv.RadixCache(pool, 1)
    sched = radixkv.Scheduler(cache, policy, max_wait=0)
    prefixes = [seq(g * 1_000_000, prefix) for g in range(groups)]
    for i in range(per_group):
        for g in range(groups):
            sched.add(
                np.concatenate([prefixes[g], seq(10_000_000 + (i * groups + g) * tail, tail)])
            )
    while len(sched):
        for _, req in sched.schedule(1 << 30, 1):
            cache.commit(req, req.num_tokens)
            cache.finish(req)
    s = cache.stats
    total = groups * per_group * (prefix + tail)
    best = groups * (per_group - 1) * prefix  # each prefix computed once, every tail computed
    return s.hit_tokens / total, best / total


def schedule_cost(policy: str, waiting: int, prompt: int = 2048, reps: int = 20) -> float:
    """Median seconds of one schedule call admitting one request out of `waiting`, each a
    shared 1,024-token system prompt (cached) plus a unique tail, `prompt` tokens in all."""
    system = seq(0, 1024)
    cache = radixkv.RadixCache(4 * waiting * prompt // 16 + 65536, 16)
    warm = cache.admit(np.concatenate([system, seq(5_000_000, 16)]))
    cache.commit(warm, warm.num_tokens)
    cache.finish(warm)
    sched = radixkv.Scheduler(cache, policy, max_wait=0)
    rng = np.random.default_rng(0)
    tails = rng.integers(1 << 20, 1 << 31, size=(waiting + reps, prompt - 1024), dtype=np.uint32)
    for i in range(waiting):
        sched.add(np.concatenate([system, tails[i]]))
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        got = sched.schedule(1 << 30, 1)
        times.append(time.perf_counter() - t0)
        for _, req in got:
            cache.abort(req)
        sched.add(np.concatenate([system, tails[waiting + r]]))
    return float(np.median(times))


def naive_lpm_cost(waiting: int, prompt: int = 2048, reps: int = 5) -> float:
    """The same ranking done the plain way: match_prefix on every waiting prompt, then sort."""
    system = seq(0, 1024)
    cache = radixkv.RadixCache(65536, 16)
    warm = cache.admit(np.concatenate([system, seq(5_000_000, 16)]))
    cache.commit(warm, warm.num_tokens)
    cache.finish(warm)
    rng = np.random.default_rng(0)
    prompts = [
        np.concatenate([system, rng.integers(1 << 20, 1 << 31, prompt - 1024, dtype=np.uint32)])
        for _ in range(waiting)
    ]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        order = sorted(range(waiting), key=lambda i: -cache.match_prefix(prompts[i]))
        times.append(time.perf_counter() - t0)
        assert len(order) == waiting
    return float(np.median(times))


def starvation(max_wait: int, calls: int = 2000):
    """Warm requests arrive at 2 per call and cold ones every 10th call; 2 are served per call.
    Returns p99 and max wait (in calls) over all requests, counting those still waiting."""
    hot = seq(0, 2048)
    cache = radixkv.RadixCache(1 << 20, 16)
    sched = radixkv.Scheduler(cache, "lpm", max_wait=max_wait)
    arrived: dict[int, int] = {}
    waits = []
    for call in range(calls):
        for j in range(2):
            arrived[sched.add(np.concatenate([hot, seq(100_000 + call * 10 + j, 16)]))] = call
        if call % 10 == 0:
            arrived[sched.add(seq(50_000_000 + call * 4096, 512))] = call
        for sid, req in sched.schedule(1 << 30, 2):
            waits.append(call - arrived.pop(sid))
            cache.commit(req, req.num_tokens)
            cache.finish(req)
    waits += [calls - a for a in arrived.values()]
    return float(np.percentile(waits, 99)), max(waits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--mooncake-requests", type=int, default=3000)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    print("== alternating X/Y prefixes, pool holds one prefix ==")
    fcfs, best = alternating("fcfs")
    print(f"{'policy':<11} {'hit rate':>9} {'of best':>8} {'vs fcfs':>8}")
    for pol in ("fcfs", "lpm", "dfs-weight"):
        h, _ = alternating(pol)
        if pol == "fcfs":
            verdict = "   (baseline)"
        else:
            verdict = f"   {'PASS' if h >= 0.95 * best else 'FAIL'} (target >= 95% of best)"
        ratio = h / fcfs if fcfs else float("inf")
        print(f"{pol:<11} {h:>9.2%} {h / best:>8.2%} {ratio:>7.1f}x{verdict}")
    print(f"best possible: {best:.2%}")

    print("\n== one schedule call (admit 1), waiting requests of 2,048 tokens ==")
    sizes = (128, 1024) if args.quick else (128, 1024, 8192)
    print(
        f"{'waiting':>8} {'fcfs':>9} {'lpm':>9} {'dfs-weight':>10} {'naive lpm':>10}"
        f" {'lpm speedup':>11}"
    )
    for n in sizes:
        f, lp, d = (schedule_cost(p, n) for p in ("fcfs", "lpm", "dfs-weight"))
        nv = naive_lpm_cost(n)
        verdict = f"  {'PASS' if lp <= 2e-3 else 'FAIL'} (target <= 2 ms)" if n == 8192 else ""
        print(
            f"{n:>8} {f * 1e3:>7.3f}ms {lp * 1e3:>7.3f}ms {d * 1e3:>8.3f}ms {nv * 1e3:>8.3f}ms "
            f"{nv / lp:>10.1f}x{verdict}"
        )

    print("\n== queue wait under a warm stream (in schedule calls) ==")
    calls = 500 if args.quick else 2000
    p99_off, max_off = starvation(0, calls)
    p99_on, max_on = starvation(64, calls)
    print(f"no bound:        p99 {p99_off:>7.0f}  max {max_off:>6}")
    print(
        f"max_wait=64:     p99 {p99_on:>7.0f}  max {max_on:>6}"
        f"   ({p99_off / max(p99_on, 1):.1f}x lower p99)"
    )

    if not MOONCAKE.exists():
        print(f"\n(no Mooncake trace at {MOONCAKE.name}: skipped)")
        return
    n = 500 if args.quick else args.mooncake_requests
    reqs = [
        TraceRequest(
            r["timestamp"] / 1000,
            mooncake_tokens(r["hash_ids"], r["input_length"]),
            r["output_length"],
        )
        for r in mooncake_records(n)
    ]
    bound = infinite_bound(reqs, 16)
    print(f"\n== Mooncake conversation trace, first {len(reqs)} requests, radix cache, page 16 ==")
    print(f"unbounded-cache bound: {bound:.2%}")
    print(
        f"{'pool tokens':>11} {'fcfs':>8} {'lpm':>8} {'dfs-weight':>10}"
        "   (hit rate; share of bound)"
    )
    for pages in (65_536, 262_144, 1_048_576):
        hs = [
            replay(reqs, ReplayConfig(num_pages=pages, policy=p)).hit_rate
            for p in ("fcfs", "lpm", "dfs-weight")
        ]
        cells = " ".join(f"{h:>7.2%}" for h in hs)
        print(f"{pages * 16 / 1e6:>10.1f}M {cells}   ({', '.join(f'{h / bound:.0%}' for h in hs)})")


if __name__ == "__main__":
    main()
