"""Paged attention backends against SDPA on contiguous KV, run on request, not by pytest.

For each case (decode, and prefill over a cached prefix) at 8 requests x 2,048 keys and 32 x
4,096, in fp32 and bf16, every backend available here runs one layer's ``Step.attention`` (pool
write, metadata prepared once per step as in serving, attention) over pages scattered through
the pool. Each figure is a ratio to ``scaled_dot_product_attention`` on the same K/V held in
one contiguous ``[B, Hkv, L, D]`` tensor, measured in the same run (lower is better; the
baseline ms is printed). On CUDA each time is the median of ``--repeat`` rounds of ``--calls``
calls back to back between two CUDA events (a kernel's time, not one launch's host latency);
on the CPU, of ``--repeat`` calls on the host clock. 8 query / 2 KV heads, head dim 64 by
default (``--heads 32/8/128`` for Llama-3-8B's); flex and Triton are compiled (warmed up)
before timing. Each row also gives the rate of the first of triton / the fastest backend:
decode in GB/s of K/V read, prefill over a prefix in TFLOPS (4 * heads * head dim per
query-key pair it sees). Targets: decode <= 1.3x on CPU fp32 and <= 1.1x on a GPU; prefill
over a prefix <= 1.1x; on an H200 in bf16 the Triton kernels at >= 2.5 TB/s decoding 32
requests x 544 keys and >= 250 TFLOPS on prefill over a cached prefix (Llama-3-8B heads).
Triton runs on CUDA (on the CPU only under ``TRITON_INTERPRET=1``, where its figures say
nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import radixkv
from radixkv.kv import backends

HEADS = (8, 2, 64)  # query heads, KV heads, head dim; --heads sets them


def timeit(fn, repeat: int, device: str, calls: int = 1) -> float:
    """Median seconds of one call of ``fn``. On CUDA: ``repeat`` rounds of ``calls`` calls
    back to back between two CUDA events (the host never waits inside a round, so a round is the
    device's time, not the launch latency of one call), after one warm-up call; elsewhere,
    ``repeat`` calls each timed on the host clock."""
    if device.startswith("cuda"):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(max(repeat, 3)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        return statistics.median(times)
    fn()
    times = []
    for _ in range(max(repeat, 3)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def work(batch, length, q_len, dtype):
    """(bytes of K/V a step reads, flops it does) for one layer: every key once for decode;
    each new token's query against the keys up to it for prefill."""
    hq, hkv, d = HEADS
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * length * hkv * d * elem
    pairs = batch * sum(length - q_len + i + 1 for i in range(q_len))
    return kv_bytes, 4 * pairs * hq * d


def case(batch, length, q_len, dtype, device, names, repeat, page_size, calls=1):
    """One row: the baseline seconds and each backend's (seconds, ratio, groups ran)."""
    HQ, HKV, D = HEADS
    rng = np.random.default_rng(0)
    pages_per = -(-length // page_size)
    cache = radixkv.BlockCache(2 * batch * pages_per + 8, page_size=page_size)
    # Scatter the pages: admit and finish filler requests between the real ones.
    fillers = [cache.admit(rng.integers(0, 1 << 16, length)) for _ in range(batch)]
    reqs = [cache.admit(rng.integers(0, 1 << 16, length - q_len)) for _ in range(batch)]
    for r in fillers:
        cache.finish(r)
    kvs = {
        name: radixkv.KVCache(cache, 1, HKV, D, dtype=dtype, device=device, attention=name)
        for name in names
    }
    g = torch.Generator().manual_seed(0)
    for kv in kvs.values():
        kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g).to(device, dtype))
        kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g).to(device, dtype))
        if kv.attention in ("flex", "triton", "auto"):
            kv.warmup(num_heads=HQ, batch_sizes=[batch])
    first = next(iter(kvs.values()))
    # Everything but the new tokens is cached: commit the prefixes.
    step = first.plan(reqs)
    first.commit(step)
    for r in reqs:
        cache.extend(r, rng.integers(0, 1 << 16, q_len))
    t = batch * q_len
    q = torch.randn(t, HQ, D, generator=g).to(device, dtype)
    k = torch.randn(t, HKV, D, generator=g).to(device, dtype)
    steps = {name: kv.plan(reqs) for name, kv in kvs.items()}
    slots = steps[names[0]].kv_slots
    kc = first.k[0][slots].transpose(1, 2).contiguous()
    vc = first.v[0][slots].transpose(1, 2).contiguous()
    qc = q.view(batch, q_len, HQ, D).transpose(1, 2)
    causal = q_len > 1
    mask = None
    if causal:
        pos = torch.arange(length - q_len, length, device=device)
        mask = torch.arange(length, device=device)[None, :] <= pos[:, None]

    def base():
        F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)

    t_base = timeit(base, repeat, device, calls)
    ratios = {}
    for name, kv in kvs.items():

        def run(kv=kv, name=name):
            # What serving pays per step and layer: planning is per step, shared by layers.
            steps[name].attention(0, q, k, k)

        sec = timeit(run, repeat, device, calls)
        ratios[name] = (sec, sec / t_base, steps[name].backends)
    for r in reqs:
        cache.finish(r)
    return t_base, ratios


def target_line(kind: str, shape: str, q_len: int, bytes_per_s: float, flops: float) -> str:
    """The H200 goal of a Triton row (decode at 32 x 544: 2.5 TB/s; prefill over a cached
    prefix: 250 TFLOPS), or its rate where no goal is set."""
    if q_len == 1:
        got = f"{bytes_per_s / 1e9:.0f} GB/s"
        if shape != "32x544":
            return f"triton {kind} {shape}: {got}"
        ok = "holds" if bytes_per_s >= 2.5e12 else "short"
        return f"target: triton decode 32x544 >= 2500 GB/s: {got} ({ok})"
    ok = "holds" if flops >= 250e12 else "short"
    return f"target: triton {kind} {shape} >= 250 TFLOPS: {flops / 1e12:.1f} ({ok})"


QUICK = {"shapes": "2x256", "repeat": 1, "dtypes": "float32"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="8x2048,32x4096", help="BATCHxKEYS, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefill", type=int, default=128, help="new tokens per request (prefill)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5, help="rounds timed (the median is kept)")
    p.add_argument(
        "--calls", type=int, default=20, help="back-to-back calls a round, on CUDA (CUDA events)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--backends", default=None, help="comma-separated (default: all available)")
    p.add_argument("--heads", default="8/2/64", help="query heads/KV heads/head dim")
    p.add_argument("--quick", action="store_true", help="a smoke run; its figures say nothing")
    args = p.parse_args()
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args()
    torch.set_num_threads(args.threads)
    global HEADS
    HEADS = tuple(int(x) for x in args.heads.split("/"))
    if len(HEADS) != 3 or HEADS[0] % HEADS[1]:
        p.error(f"--heads takes HQ/HKV/D with HQ a multiple of HKV, got {args.heads!r}")
    HQ, HKV, D = HEADS
    device = torch.device(args.device)
    names = args.backends.split(",") if args.backends else backends.available(device)
    names = ["sdpa", *[n for n in names if n != "sdpa"]]
    print(
        f"attention backends vs SDPA on contiguous KV (ratio, lower is better); torch "
        f"{torch.__version__}, {device.type}, {torch.get_num_threads()} threads, "
        f"{HQ}/{HKV} heads, head dim {D}, page size {args.page_size}"
    )
    print(
        f"{'case':<24} {'dtype':<9} {'sdpa ms':>8} "
        + " ".join(f"{n:>11}" for n in names)
        + f"  {'rate':>24}"
    )
    targets: list[str] = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for shape in args.shapes.split(","):
            batch, length = (int(x) for x in shape.split("x"))
            for kind, q_len in (("decode", 1), ("prefill+prefix", args.prefill)):
                q_len = min(q_len, length // 2)
                t_base, ratios = case(
                    batch, length, q_len, dtype, args.device, names, args.repeat,
                    args.page_size, args.calls,
                )  # fmt: skip
                cells = []
                for n in names:
                    _, ratio, ran = ratios[n]
                    cells.append(f"{ratio:>10.2f}{' ' if ran == [n] else '*'}")
                rated = "triton" if "triton" in names else min(names, key=lambda n: ratios[n][0])
                kv_bytes, flops = work(batch, length, q_len, dtype)
                sec = ratios[rated][0]
                rate = (
                    f"{kv_bytes / sec / 1e9:.0f} GB/s"
                    if q_len == 1
                    else f"{flops / sec / 1e12:.2f} TFLOPS"
                )
                if rated == "triton" and device.type == "cuda" and dtype_name == "bfloat16":
                    targets.append(target_line(kind, shape, q_len, kv_bytes / sec, flops / sec))
                print(
                    f"{kind + ' ' + shape:<24} {dtype_name:<9} {t_base * 1e3:>8.2f} "
                    + " ".join(cells)
                    + f"  {rated + ' ' + rate:>24}"
                )
    print("*: served by another backend for this kind (flex: prefill via sdpa; auto: its choice)")
    for line in targets:
        print(line)


if __name__ == "__main__":
    main()
