"""Benchmarks of the torch layer, run on request (``python benches/bench_torch.py``), not by pytest.

Every figure is a ratio against a baseline measured in the same run:

(a) agent session: time to first token per turn, cached over uncached, next to the compute bound
    (prompt tokens computed with the cache / prompt tokens): what the cache can save at best;
(b) no hits at all (unique prompts): engine throughput with the cache over caching off, i.e.
    what the cache costs when it never pays;
(c) paged attention (``Step.attention``: pool write, gather, mask) over SDPA on the same KV held
    in one contiguous tensor, for a prefill over a cached prefix and for a decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import radixkv
from radixkv.models import CausalLM, ModelConfig


def prefill_flops(cfg, start: int, end: int) -> float:
    """Forward FLOPs of computing positions ``start..end`` over a cached ``0..start``: the
    projections and MLP per token, plus attention of each new token over every key up to it."""
    d, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    linear = 2 * (2 * d * d + 2 * d * kv + 3 * d * cfg.intermediate_size)
    n = end - start
    keys = n * (start + end + 1) / 2  # sum of (p + 1) for p in start..end-1
    return cfg.num_layers * (n * linear + 4 * cfg.num_heads * cfg.head_dim * keys)


def agent_session(model, args) -> None:
    """(a) a multi-turn session with growing prompts, once cached and once with caching off."""
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    system = rng.integers(0, vocab, args.system)
    turns = [
        (rng.integers(0, vocab, args.message), rng.integers(0, vocab, args.tool))
        for _ in range(args.turns)
    ]
    runs = {}
    for caching in (True, False):
        cache = radixkv.RadixCache(args.pool, page_size=1)
        eng = radixkv.Engine(
            model, model.make_kv_cache(cache), token_budget=args.budget, prefix_caching=caching
        )
        eng.generate([system[:32]], max_new_tokens=1, namespace="warmup")
        session = radixkv.Session(eng, system=system)
        results = []
        for message, tool in turns:
            results.append(session.send(message, max_new_tokens=args.reply))
            session.append(tool)
        runs[caching] = results
    print(f"(a) agent session, {args.turns} turns (TTFT cached / uncached vs compute bound)")
    print(
        f"    {'turn':>4} {'prompt':>7} {'computed':>8} {'ttft on':>9} {'ttft off':>9} "
        f"{'ratio':>6} {'bound':>6} {'flops':>6}"
    )
    cfg = model.config

    def flop_bound(r) -> float:
        cached = r.prompt_tokens - r.computed_tokens
        return prefill_flops(cfg, cached, r.prompt_tokens) / prefill_flops(cfg, 0, r.prompt_tokens)

    for i, (a, b) in enumerate(zip(runs[True], runs[False])):
        print(
            f"    {i + 1:>4} {a.prompt_tokens:>7} {a.computed_tokens:>8} "
            f"{a.ttft_s * 1e3:>7.1f}ms {b.ttft_s * 1e3:>7.1f}ms "
            f"{a.ttft_s / b.ttft_s:>6.3f} {a.computed_tokens / a.prompt_tokens:>6.3f} "
            f"{flop_bound(a):>6.3f}"
        )
    later = slice(1, None)
    on = sum(r.ttft_s for r in runs[True][later])
    off = sum(r.ttft_s for r in runs[False][later])
    bound = sum(r.computed_tokens for r in runs[True][later]) / sum(
        r.prompt_tokens for r in runs[True][later]
    )
    cached_flops = sum(
        prefill_flops(cfg, r.prompt_tokens - r.computed_tokens, r.prompt_tokens)
        for r in runs[True][later]
    )
    all_flops = sum(prefill_flops(cfg, 0, r.prompt_tokens) for r in runs[True][later])
    same = [r.output for r in runs[True]] == [r.output for r in runs[False]]
    print(
        f"    turns 2..{args.turns}: TTFT ratio {on / off:.3f}, compute bound {bound:.3f} "
        f"(tokens computed / prompt tokens), {cached_flops / all_flops:.3f} (FLOPs, attention "
        f"included); outputs identical: {same}"
    )


def unique_prompts(model, args) -> None:
    """(b) throughput when nothing is ever cached."""
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, args.unique_len) for _ in range(args.unique_prompts)]
    rates = {True: [], False: []}
    for _ in range(args.repeat):
        for caching in (True, False):
            cache = radixkv.RadixCache(args.pool, page_size=1)
            eng = radixkv.Engine(
                model,
                model.make_kv_cache(cache),
                token_budget=args.budget,
                max_batch=args.batch,
                prefix_caching=caching,
            )
            eng.generate([prompts[0][:16]], max_new_tokens=1, namespace="warmup")
            start = time.perf_counter()
            res = eng.generate(prompts, max_new_tokens=args.reply)
            took = time.perf_counter() - start
            assert all(r.cached_tokens == 0 for r in res)
            rates[caching].append(sum(r.prompt_tokens + len(r.output) for r in res) / took)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(
        f"(b) {args.unique_prompts} unique prompts x {args.unique_len} tokens, "
        f"{args.reply} generated: {on:,.0f} vs {off:,.0f} tokens/s; cache / no cache = "
        f"{on / off:.3f}"
    )


def attention(args, device: str) -> None:
    """(c) Step.attention against SDPA over contiguous K/V, prefill and decode."""
    b, hq, hkv, d, length = args.batch, 8, 2, 64, args.kv_len
    for phase, q_len in (("prefill", args.q_len), ("decode", 1)):
        cache = radixkv.RadixCache(b * length // 16 + b, page_size=16)
        kv = radixkv.KVCache(cache, 1, hkv, d, dtype=args.dtype, device=device)
        kv.k[0].normal_()
        kv.v[0].normal_()
        rng = np.random.default_rng(2)
        reqs = []
        for _ in range(b):
            r = cache.admit(rng.integers(0, 1 << 20, length - q_len))
            cache.commit(r, length - q_len)
            cache.extend(r, rng.integers(0, 1 << 20, q_len))
            reqs.append(r)
        step = kv.plan(reqs)
        q = torch.randn(step.num_tokens, hq, d, device=device, dtype=args.dtype)
        k = torch.randn(step.num_tokens, hkv, d, device=device, dtype=args.dtype)
        v = torch.randn_like(k)
        # The baseline: the same keys already laid out contiguously, one SDPA call.
        kc = kv.k[0][step.kv_slots].transpose(1, 2).contiguous()
        vc = kv.v[0][step.kv_slots].transpose(1, 2).contiguous()
        qc = q.view(b, q_len, hq, d).transpose(1, 2).contiguous()
        mask = None
        if q_len > 1:  # bottom-right causal, additive like the paged step's (the faster form)
            pos = torch.arange(length - q_len, length, device=device)
            allowed = torch.arange(length, device=device)[None, :] <= pos[:, None]
            mask = torch.zeros(allowed.shape, dtype=args.dtype, device=device)
            mask.masked_fill_(~allowed, float("-inf"))

        def paged(step=step, q=q, k=k, v=v):
            return step.attention(0, q, k, v)

        def contiguous(q=qc, k=kc, v=vc, mask=mask):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True
            )

        t_paged, t_dense = (
            timeit(paged, args.repeat, device),
            timeit(contiguous, args.repeat, device),
        )
        print(
            f"(c) {device} {phase:<7} B={b} q={q_len} kv={length}: paged {t_paged * 1e3:.2f} ms,"
            f" contiguous SDPA {t_dense * 1e3:.2f} ms, paged / contiguous = "
            f"{t_paged / t_dense:.2f}"
        )


def timeit(fn, repeat: int, device: str) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs after one warm-up."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(max(repeat, 3)):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


#: ``--quick``: every part runs, on sizes that take a few seconds in all.
QUICK = {
    "turns": 3,
    "system": 96,
    "message": 16,
    "tool": 16,
    "reply": 2,
    "unique_prompts": 4,
    "unique_len": 32,
    "batch": 2,
    "kv_len": 256,
    "q_len": 32,
    "pool": 4096,
    "budget": 256,
    "repeat": 1,
    "hidden": 64,
    "layers": 2,
    "threads": 1,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system", type=int, default=1200, help="system prompt tokens")
    p.add_argument("--message", type=int, default=60, help="user message tokens per turn")
    p.add_argument("--tool", type=int, default=120, help="tool output tokens per turn")
    p.add_argument("--reply", type=int, default=8, help="tokens generated per request")
    p.add_argument("--unique-prompts", type=int, default=16)
    p.add_argument("--unique-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="batch of (b) and (c)")
    p.add_argument("--kv-len", type=int, default=2048, help="keys per request in (c)")
    p.add_argument("--q-len", type=int, default=128, help="new tokens per request, (c) prefill")
    p.add_argument("--pool", type=int, default=32768, help="pool tokens of (a) and (b)")
    p.add_argument("--budget", type=int, default=2048, help="engine token budget")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--only", default="abc", help="which of a, b, c to run")
    p.add_argument("--hidden", type=int, default=256, help="model width (the built-in: 256)")
    p.add_argument("--layers", type=int, default=4, help="model depth (the built-in: 4)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of a few seconds: a tiny model and short prompts (options given "
        "explicitly still win); its figures say nothing",
    )
    args = p.parse_args()
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dtype = torch.float32
    # SwiGLU width in Llama's ratio (688 / 256), rounded to a multiple of 8.
    inter = (args.hidden * 688 // 256 + 7) // 8 * 8
    config = ModelConfig(hidden_size=args.hidden, intermediate_size=inter, num_layers=args.layers)
    model = CausalLM.random(config, seed=0)
    cfg = model.config
    print(
        f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads}/"
        f"{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    if "a" in args.only:
        agent_session(model, args)
    if "b" in args.only:
        unique_prompts(model, args)
    if "c" in args.only:
        attention(args, "cpu")
        if torch.cuda.is_available():
            args.dtype = torch.bfloat16
            attention(args, "cuda")


if __name__ == "__main__":
    main()
