"""Sliding-window layers: what a window group saves in KV memory, and what it costs in reuse.

    .venv/bin/python benches/bench_window.py [--quick]

1. Pages a live request holds for a 32,768-token context (page 16), measured on a cache with a
   window group as the engine drives it (prefill in chunks of the token budget, then decode):
   full attention holds every page; a window layer holds its last window. With the layer mix of
   Gemma 3 (5 window layers to 1 global) and gpt-oss (1 to 1), the KV a request needs against a
   model whose layers are all full attention.
2. Hit rate on the Mooncake trace (replay, lpm, the same full pool) and on the agent trace
   (100 sessions x 10 turns over a 1,024-token system prompt, an unbounded full pool), with
   full attention and with window groups of several windows and pool sizes, in one run: a hit
   also needs its last window's window pages, which a window pool smaller than the working set
   drops first; and the smallest window pool again with a window host tier.
3. One window layer's decode attention (8 requests, 8,192-token contexts, window 512, fp32, 8
   query / 2 KV heads of 64, CPU): the full pool through SDPA (gathers every key, masks the
   window), the full pool through flex (block lists narrowed to the window's pages), and the
   window pool of a window group (SDPA over the window pages), each a ratio to SDPA over the
   last 512 keys held contiguous, measured in the same run (lower is better).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))

import radixkv  # noqa: E402
from common import agent_trace, agent_unique_tokens, run_agent  # noqa: E402

PAGE = 16


def held(cache: radixkv.Cache) -> tuple[int, int]:
    """(full pages used, window pages held) by live requests now."""
    s = cache.stats
    return s.used_pages, s.window_pages - s.window_free_pages - s.window_evictable_pages


def pages_per_request(context: int, window: int, budget: int, decode: int) -> dict[str, int]:
    """Drives one request as the engine does; returns the pages it holds at each stage."""
    n_pages = -(-(context + decode) // PAGE) + 64  # room for the next turn
    cache = radixkv.RadixCache(n_pages, PAGE, window=window, window_pages=n_pages)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 50_000, context, dtype=np.uint32)
    req = cache.admit(prompt[:budget])
    peak = held(cache)[1]
    done = 0
    while True:
        cache.commit(req, req.num_tokens)
        done = req.num_tokens
        if done == context:
            break
        cache.extend(req, prompt[done : done + budget])
        peak = max(peak, held(cache)[1])
    for t in range(decode):
        cache.extend(req, [t + 1])
        cache.commit(req, req.num_tokens)
    full, win = held(cache)
    cache.check()
    # The next turn of this conversation: everything cached, a 256-token message to compute.
    cache.finish(req)
    nxt = cache.admit(
        np.concatenate([prompt, np.arange(1, decode + 1, dtype=np.uint32), prompt[:256]])
    )
    turn_cached = nxt.num_cached
    turn = held(cache)[1]
    cache.abort(nxt)
    return {
        "full": full,
        "window_decode": win,
        "window_prefill_peak": peak,
        "turn_cached": turn_cached,
        "turn_window": turn,
    }


def section_pages(quick: bool) -> None:
    context, budget = (8192, 2048) if quick else (32768, 8192)
    print(
        f"== 1. pages a live request holds: {context}-token context, page {PAGE}, prefill in "
        f"chunks of {budget} tokens, then 32 decode steps"
    )
    print(
        f"{'window':>8}{'full':>8}{'window, decode':>16}{'window, prefill peak':>22}"
        f"{'next turn cached':>18}{'its window pages':>18}"
    )
    rows = {}
    for window in (128, 1024, 4096):
        r = pages_per_request(context, window, budget, 32)
        rows[window] = r
        print(
            f"{window:>8}{r['full']:>8}{r['window_decode']:>16}{r['window_prefill_peak']:>22}"
            f"{r['turn_cached']:>18}{r['turn_window']:>18}"
        )
    print("KV a request needs, against all layers full attention (decode):")
    for name, window, local, glob in (
        ("Gemma 3 (window 1024, 5 local : 1 global)", 1024, 5, 1),
        ("Gemma 2 / Mistral-style (window 4096, 1 : 1)", 4096, 1, 1),
        ("gpt-oss (window 128, 1 : 1)", 128, 1, 1),
        ("Gemma 3 shape with a 4096 window (5 : 1)", 4096, 5, 1),
    ):
        r = rows[window]
        mixed = glob * r["full"] + local * r["window_decode"]
        alone = (local + glob) * r["full"]
        print(f"  {name:48} {alone / mixed:5.2f}x less ({mixed} of {alone} layer-pages)")


def section_mooncake(quick: bool) -> None:
    from radixkv.apps.common.trace import SAMPLE_TRACE, read_trace
    from radixkv.apps.replay.simulate import ReplayConfig, replay

    trace = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    if quick or not trace.exists():
        trace = SAMPLE_TRACE
    requests = list(read_trace(trace, limit=400 if quick else None))
    pool = 8192 if quick else 65536
    print(
        f"== 2a. Mooncake replay: {len(requests)} requests, lpm, page {PAGE}, full pool "
        f"{pool} pages ({pool * PAGE / 1e6:.2f}M tokens)"
    )
    print(f"{'':34}{'hit rate':>9}{'of full':>9}")
    base = replay(requests, ReplayConfig(num_pages=pool)).hit_rate
    print(f"{'full attention':34}{base:>9.2%}{1:>9.3f}")
    for window in (1024, 4096):
        for frac in (1, 4, 16):
            cfg = ReplayConfig(num_pages=pool, window=window, window_pages=pool // frac)
            r = replay(requests, cfg).hit_rate
            name = f"window {window}, window pool 1/{frac}"
            print(f"{name:34}{r:>9.2%}{r / base if base else float('nan'):>9.3f}")


def section_agent(quick: bool) -> None:
    trace = agent_trace()
    if quick:
        trace = trace[:300]
    pool = agent_unique_tokens(agent_trace()) // PAGE + 1024
    total = sum(len(p) for p, _ in trace)
    print(
        f"== 2b. agent trace: {len(trace)} requests, {total / 1e6:.2f}M prompt tokens, an "
        f"unbounded full pool ({pool} pages)"
    )
    print(f"{'':34}{'hit rate':>9}{'of full':>9}{'cut hits':>10}")
    full = radixkv.RadixCache(pool, PAGE)
    run_agent(full, trace)
    base = full.stats.hit_rate
    print(f"{'full attention':34}{base:>9.2%}{1:>9.3f}{0:>10}")
    for window in (1024, 4096):
        for frac in (1, 2, 4, 8):
            c = radixkv.RadixCache(pool, PAGE, window=window, window_pages=pool // frac)
            run_agent(c, trace)
            c.check()
            s = c.stats
            name = f"window {window}, window pool 1/{frac}"
            print(f"{name:34}{s.hit_rate:>9.2%}{s.hit_rate / base:>9.3f}{s.window_cut_hits:>10}")
        # The smallest pool again, with a window host tier: the windows it pushes out go to
        # host memory, and a session's next turn loads its last window back.
        for hfrac in (8, 2):
            c = radixkv.RadixCache(
                pool,
                PAGE,
                host_pages=pool // hfrac,
                window=window,
                window_pages=pool // 8,
                window_host_pages=pool // hfrac,
            )
            run_agent(c, trace)
            c.check()
            s = c.stats
            name = f"  1/8 + window host tier 1/{hfrac}"
            print(
                f"{name:34}{s.hit_rate:>9.2%}{s.hit_rate / base:>9.3f}{s.window_cut_hits:>10}"
                f"   {s.window_loaded_pages} window pages loaded"
            )


def section_attention(quick: bool) -> None:
    import statistics
    import time

    import torch
    import torch.nn.functional as F

    from radixkv.kv import backends

    torch.set_num_threads(1)
    batch, context, window = (4, 2048, 256) if quick else (8, 8192, 512)
    hq, hkv, d = 8, 2, 64
    print(
        f"== 3. one window layer's decode: {batch} requests x {context} tokens, window {window}, "
        f"page {PAGE}, fp32, {hq}/{hkv} heads of {d}"
    )
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1 << 16, context - 1) for _ in range(batch)]

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(5 if quick else 15):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def decode_step(kv, cache):
        reqs = [cache.admit(t) for t in prompts]
        for r in reqs:
            cache.commit(r, r.num_tokens)  # the context "computed" (random KV in the pool)
            cache.extend(r, [1])
        for pools in (kv.k, kv.v):
            pools[0].copy_(torch.randn(pools[0].shape, generator=g))
        step = kv.plan(reqs)
        q = torch.randn(batch, hq, d, generator=g)
        k, v = torch.randn(batch, hkv, d, generator=g), torch.randn(batch, hkv, d, generator=g)
        return step, q, k, v

    rows = {}
    pages = batch * (context // PAGE + 2) + 8
    for name in ("sdpa", "flex"):
        if name not in backends.available(torch.device("cpu")):
            continue
        cache = radixkv.RadixCache(pages, PAGE)
        kv = radixkv.KVCache(cache, 1, hkv, d, attention=name)
        if name == "flex":
            kv.warmup(hq, batch_sizes=[batch])
        step, q, k, v = decode_step(kv, cache)
        assert step.backends == [name]
        args = (0, q, k, v)
        rows[f"full pool, {name}"] = timed(lambda s=step, a=args: s.attention(*a, window=window))
    wpages = batch * (context // PAGE + 2) + 8
    cache = radixkv.RadixCache(pages, PAGE, window=window, window_pages=wpages)
    kv = radixkv.KVCache(cache, 1, hkv, d, attention="sdpa", window_layers=[0])
    step, q, k, v = decode_step(kv, cache)
    st = cache.stats
    held = st.window_pages - st.window_free_pages - st.window_evictable_pages
    rows[f"window pool, sdpa ({held // batch} pages a request)"] = timed(
        lambda: step.attention(0, q, k, v, window=window)
    )
    kc = torch.randn(batch, hkv, window, d, generator=g)
    vc = torch.randn(batch, hkv, window, d, generator=g)
    qc = q.view(batch, hkv, hq // hkv, d)
    base = timed(lambda: F.scaled_dot_product_attention(qc, kc, vc))
    print(f"  {'SDPA over the window, contiguous (baseline)':52}{base * 1e3:>9.3f} ms")
    for name, t in rows.items():
        print(f"  {name:52}{t * 1e3:>9.3f} ms {t / base:>8.1f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds' worth (smoke runs)")
    args = ap.parse_args(argv)
    section_pages(args.quick)
    section_attention(args.quick)
    section_agent(args.quick)
    section_mooncake(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
