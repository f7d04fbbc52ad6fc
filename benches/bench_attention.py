"""Paged attention backends against SDPA on contiguous KV, run on request, not by pytest.

For each case (decode, and prefill over a cached prefix) at 8 requests x 2,048 keys and 32 x
4,096, in fp32 and bf16, every backend available here runs one layer's ``Step.attention`` (pool
write, metadata prepared once per step as in serving, attention) over pages scattered through
the pool. Each figure is a ratio to ``scaled_dot_product_attention`` on the same K/V held in
one contiguous ``[B, Hkv, L, D]`` tensor, measured in the same run (lower is better; the
baseline ms is printed). 8 query / 2 KV heads, head dim 64; flex is compiled (warmed up) before
timing. Targets: decode <= 1.3x on CPU fp32 and <= 1.1x on a GPU; prefill over a prefix <= 1.1x.
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

HQ, HKV, D = 8, 2, 64


def timeit(fn, repeat: int, device: str) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after one warm-up."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(max(repeat, 3)):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case(batch, length, q_len, dtype, device, names, repeat, page_size):
    """One row: the baseline seconds and each backend's ratio to it."""
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
        if kv.attention in ("flex", "auto"):
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

    t_base = timeit(base, repeat, device)
    ratios = {}
    for name, kv in kvs.items():

        def run(kv=kv, name=name):
            # What serving pays per step and layer: planning is per step, shared by layers.
            steps[name].attention(0, q, k, k)

        ratios[name] = (timeit(run, repeat, device) / t_base, steps[name].backends)
    for r in reqs:
        cache.finish(r)
    return t_base, ratios


QUICK = {"shapes": "2x256", "repeat": 1, "dtypes": "float32"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="8x2048,32x4096", help="BATCHxKEYS, comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefill", type=int, default=128, help="new tokens per request (prefill)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--backends", default=None, help="comma-separated (default: all available)")
    p.add_argument("--quick", action="store_true", help="a smoke run; its figures say nothing")
    args = p.parse_args()
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = args.backends.split(",") if args.backends else backends.available(device)
    names = ["sdpa", *[n for n in names if n != "sdpa"]]
    print(
        f"attention backends vs SDPA on contiguous KV (ratio, lower is better); torch "
        f"{torch.__version__}, {device.type}, {torch.get_num_threads()} threads, "
        f"{HQ}/{HKV} heads, head dim {D}, page size {args.page_size}"
    )
    print(f"{'case':<24} {'dtype':<9} {'sdpa ms':>8} " + " ".join(f"{n:>11}" for n in names))
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for shape in args.shapes.split(","):
            batch, length = (int(x) for x in shape.split("x"))
            for kind, q_len in (("decode", 1), ("prefill+prefix", args.prefill)):
                q_len = min(q_len, length // 2)
                t_base, ratios = case(
                    batch, length, q_len, dtype, args.device, names, args.repeat, args.page_size
                )
                cells = []
                for n in names:
                    ratio, ran = ratios[n]
                    cells.append(f"{ratio:>10.2f}{' ' if ran == [n] else '*'}")
                print(
                    f"{kind + ' ' + shape:<24} {dtype_name:<9} {t_base * 1e3:>8.2f} "
                    + " ".join(cells)
                )
    print("*: served by another backend for this kind (flex: prefill via sdpa; auto: its choice)")


if __name__ == "__main__":
    main()
