"""bench_host_load: bringing a cached context back from the host tier against recomputing it,
on one model's KV shape, in one run.

    .venv/bin/python benches/bench_host_load.py [--quick] [--model tiny|llama3-8b|smollm2]
        [--device cpu|cuda] [--dtype bfloat16] [--tokens 2048,8192] [--page-size 16]

For each context length N: the context is computed and published into a device pool that holds
about one context, pushed to the host tier by a second context, then admitted again: its pages
come back from the host (``KVCache.apply_copies``, timed to completion: on CUDA the copies run
on a side stream from pinned host pools). The recompute is the model's forward over the same N
tokens (its prefill). Printed per length: the bytes moved, the load's bandwidth, both times and
their ratio; the target line says whether a load beats the recompute at every length measured.
"""

from __future__ import annotations

import statistics
import sys
import time

try:
    import numpy as np
    import torch

    import radixkv
    from radixkv.kv import KVCache
    from shapes import build, model_parser, parse_model_args, sync
except ImportError as e:
    print(f"bench_host_load: skipped ({e}); pip install radixkv[hf]")
    sys.exit(0)

from common import at_least_one, positive_ints, table


def load_seconds(shape, n: int, page: int, dtype, device: str, repeat: int) -> tuple[float, int]:
    """Median seconds to bring an n-token context back from the host tier, and its bytes."""
    layers, heads, dim = shape
    pages = -(-n // page) + 2
    cache = radixkv.RadixCache(pages, page_size=page, host_pages=4 * pages)
    kv = KVCache(cache, layers, heads, dim, dtype=dtype, device=device, host_device="cpu")
    rng = np.random.default_rng(0)
    ctx = [rng.integers(1, 30000, n, dtype=np.uint32) for _ in range(2)]
    times = []
    for _ in range(repeat):
        for c in (ctx[0], ctx[1]):  # the second pushes the first to the host
            req = cache.admit(c)
            kv.apply_copies()
            cache.commit(req, req.num_tokens)
            cache.finish(req)
        kv.apply_copies()
        sync(device)
        req = cache.admit(ctx[0])  # its pages are queued to come back
        cached = req.num_cached
        assert cached >= n - page, (cached, n)
        t = time.perf_counter()
        kv.apply_copies()
        sync(device)
        times.append(time.perf_counter() - t)
        cache.abort(req)
    per_token = 2 * layers * heads * dim * torch.empty(0, dtype=dtype).element_size()
    return statistics.median(times), per_token * cached


def recompute_seconds(model, n: int, device: str, repeat: int) -> float:
    ids = torch.randint(1, model.config.vocab_size, (1, n), device=device)
    times = []
    with torch.no_grad():
        model(ids[:, :16])
        for _ in range(repeat):
            sync(device)
            t = time.perf_counter()
            model(ids)
            sync(device)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = model_parser(__doc__, model="tiny", device="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", default="2048,8192", help="context lengths, comma-separated")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = parse_model_args(ap, argv, quick=dict(tokens="256", repeat=1))
    tokens = positive_ints(ap, args.tokens, "--tokens")
    at_least_one(ap, args, "page_size", "repeat")
    dtype = args.torch_dtype
    model = build(args.model, args.device, dtype)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
    print(
        f"bench_host_load: {args.model} KV ({shape[0]} layers x {shape[1]} KV heads x {shape[2]}), "
        f"{args.device}, {args.dtype}, pages of {args.page_size} tokens"
    )
    rows, wins = [], []
    for n in tokens:
        load, nbytes = load_seconds(shape, n, args.page_size, dtype, args.device, args.repeat)
        comp = recompute_seconds(model, n, args.device, args.repeat)
        wins.append(comp / load)
        rows.append(
            [
                f"{n:,}",
                f"{nbytes / 2**20:,.1f} MiB",
                f"{nbytes / load / 1e9:,.2f} GB/s",
                f"{load * 1e3:,.2f} ms",
                f"{comp * 1e3:,.2f} ms",
                f"{comp / load:,.1f}x",
            ]
        )
    table(["tokens", "KV bytes", "load bandwidth", "load", "recompute", "recompute / load"], rows)
    worst = min(wins)
    print(
        f"target: a host-tier load beats recomputing the context at every length: worst "
        f"{worst:.1f}x ({'holds' if worst > 1 else 'short'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
