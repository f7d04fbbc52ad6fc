"""Benchmarks of the torch layer, run on request (``python benches/bench_torch.py``), not by pytest.

Every figure is a ratio against a baseline measured in the same run:

(a) agent session: time to first token per turn, cached over uncached, next to the compute bound
    (prompt tokens computed with the cache / prompt tokens): what the cache can save at best;
(b) no hits at all (unique prompts): engine throughput with the cache over caching off, i.e.
    what the cache costs when it never pays;
(c) paged attention (``Step.attention``: pool write, gather, mask) over SDPA on the same KV held
    in one contiguous tensor, for a prefill over a cached prefix and for a decode step;
(d) end to end: ``radixkv.Engine`` decode throughput (``attention="flex"``, compiled ahead by
    ``KVCache.warmup``, and ``"sdpa"``, which ``"auto"`` picks on CPU) over the same model and
    weights decoding in a plain loop with each layer's K/V in contiguous ``[B, Hkv, L, D]``
    tensors (a static cache: SDPA, no pages, no scheduler), B unique prompts prefilled, then
    greedy decode steps, the systems stepped in turn; the greedy tokens of all must be identical
    (checked).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

import radixkv
from common import at_least_one, positive_ints
from radixkv.kv.backends import sdpa
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


#: ``attend(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]`` for one layer.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ContiguousDecode:
    """(d)'s baseline: ``model`` (its ``_run``, one attention callable per layer) decoding
    ``prompts`` (``[B, P]``) greedily with each layer's K/V in contiguous ``[B, Hkv, L, D]``
    tensors preallocated to the final length ``P + steps`` and written in place, the way a
    simple static cache works. Prefill: causal SDPA over the prompts. Decode: SDPA over the
    filled part, query heads folded onto their KV head (``[B, Hkv, G, D]``), the form the paged
    backends use too and 2x faster than ``enable_gqa`` on CPU, so the baseline is the stronger
    one. ``outputs[b]``: request ``b``'s greedy tokens so far."""

    def __init__(self, model: CausalLM, prompts: np.ndarray, steps: int) -> None:
        self.model = model
        attn = model.layers[0].self_attn
        self.hq, self.hkv, self.d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.b, self.length = prompts.shape
        self.prompts = prompts
        w = model.embed_tokens.weight
        shape = (self.b, self.hkv, self.length + steps, self.d)
        self.k = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in model.layers]
        self.v = [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in model.layers]
        self.outputs: list[list[int]] = [[] for _ in range(self.b)]
        self.last: torch.Tensor | None = None

    def _attend_prefill(self, layer: int) -> Attend:
        b, n, hq, hkv, d = self.b, self.length, self.hq, self.hkv, self.d

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = self.k[layer][:, :, :n], self.v[layer][:, :, :n]
            kc.copy_(k.view(b, n, hkv, d).transpose(1, 2))
            vc.copy_(v.view(b, n, hkv, d).transpose(1, 2))
            qh = q.view(b, n, hq, d).transpose(1, 2)
            o = sdpa(qh, kc, vc, None, True, self.model.scale)
            return o.transpose(1, 2).reshape(b * n, hq, d)

        return attend

    def _attend_decode(self, layer: int, pos: int) -> Attend:
        b, hq, hkv, d = self.b, self.hq, self.hkv, self.d

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k[layer][:, :, pos] = k
            self.v[layer][:, :, pos] = v
            kc, vc = self.k[layer][:, :, : pos + 1], self.v[layer][:, :, : pos + 1]
            o = torch.nn.functional.scaled_dot_product_attention(
                q.reshape(b, hkv, hq // hkv, d), kc, vc, scale=self.model.scale
            )
            return o.reshape(b, hq, d)

        return attend

    def _sample(self, x: torch.Tensor) -> None:
        self.last = self.model._logits(x).argmax(dim=-1)
        for out, tok in zip(self.outputs, self.last.tolist()):
            out.append(tok)

    @torch.inference_mode()
    def prefill(self) -> None:
        """Every prompt at once; samples each request's first token."""
        ids = torch.from_numpy(self.prompts.astype(np.int64)).reshape(-1)
        positions = torch.arange(self.length).repeat(self.b)
        attends = [self._attend_prefill(i) for i in range(len(self.model.layers))]
        x = self.model._run(ids, positions, attends)
        self._sample(x.view(self.b, self.length, -1)[:, -1])

    @torch.inference_mode()
    def step(self) -> None:
        """One decode step of every request: feeds its last token, samples the next."""
        if self.last is None:
            raise RuntimeError("prefill() first")
        pos = self.length + len(self.outputs[0]) - 1
        positions = torch.full((self.b,), pos, dtype=torch.long)
        attends = [self._attend_decode(i, pos) for i in range(len(self.model.layers))]
        self._sample(self.model._run(self.last, positions, attends))


def engine_decode(model, args) -> None:
    """(d) Engine decode throughput against the contiguous-KV loop, per batch size."""
    cfg = model.config
    p_len, steps = args.decode_prompt, args.decode_steps
    batches = args.decode_batches
    page = 16
    # One pool size for every run, so flex compiles once per batch bucket only.
    num_pages = max(batches) * math.ceil((p_len + steps + 2) / page) + 8
    print(
        f"(d) engine decode vs contiguous KV: prompts of {p_len} tokens (unique), "
        f"{steps} greedy decode steps, page size {page}, fp32"
    )
    print(f"    {'B':>3} {'system':<22} {'ms/step':>8} {'tokens/s':>9} {'tok/s ratio':>11}")
    for b in batches:
        rng = np.random.default_rng(3 + b)
        prompts = rng.integers(0, cfg.vocab_size, (b, p_len))
        systems: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
        for name in ("flex", "sdpa") if args.warmup else ("sdpa",):
            kv = radixkv.KVCache(
                radixkv.RadixCache(num_pages, page_size=page),
                cfg.num_layers,
                cfg.num_kv_heads,
                model.layers[0].self_attn.head_dim,
                attention=name,
            )
            kv.warmup(cfg.num_heads, batch_sizes=[b], scale=model.scale)  # compiles flex only
            eng = radixkv.Engine(model, kv, token_budget=b * p_len + b, max_batch=b, policy="fcfs")
            ids = [eng.submit(p, max_new_tokens=steps + 2) for p in prompts]
            eng.step()  # prefill: every prompt in one step, each request's first token
            if any(len(eng.sequences[i].output) != 1 for i in ids):
                raise RuntimeError(f"B={b}: the prompts were not prefilled in one engine step")
            systems[f"engine {name}"] = (eng.step, lambda eng=eng, ids=ids: eng.run(ids))
        base = ContiguousDecode(model, prompts, steps + 1)
        base.prefill()
        systems["contiguous SDPA"] = (base.step, lambda base=base: base.outputs)
        for step, _ in systems.values():
            step()  # one decode step each, untimed: first-call costs out of the figures
        # Stepped in turn, the order rotating, so that drift of a shared machine hits all alike.
        times: dict[str, list[float]] = {name: [] for name in systems}
        names = list(systems)
        for i in range(steps):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                systems[name][0]()
                times[name].append(time.perf_counter() - start)
        outputs = {}
        for name, (_, finish) in systems.items():
            res = finish()
            outputs[name] = [r.output for r in res] if name.startswith("engine") else res
        for name, out in outputs.items():
            if out != base.outputs:  # a figure over different work would mean nothing
                raise RuntimeError(f"B={b}: {name} decoded other greedy tokens than the loop")
        total_base = sum(times["contiguous SDPA"])
        for name in names:
            t = times[name]
            print(
                f"    {b:>3} {name:<22} {statistics.median(t) * 1e3:>8.2f} "
                f"{b * steps / sum(t):>9,.0f} {total_base / sum(t):>11.3f}"
            )
    print(
        "    greedy tokens identical in every system (checked); ms/step: median; tok/s ratio: "
        "tokens/s over the contiguous loop's, same run"
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
    "decode_batch": "2",
    "decode_prompt": 32,
    "decode_steps": 4,
    "warmup": False,
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
    p.add_argument("--decode-batch", default="8,32", help="batch sizes of (d), comma-separated")
    p.add_argument("--decode-prompt", type=int, default=1024, help="prompt tokens in (d)")
    p.add_argument("--decode-steps", type=int, default=64, help="decode steps timed in (d)")
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compile flex ahead (KVCache.warmup) for (d)'s flex engine; off (the --quick "
        "default): that engine is skipped and sdpa runs alone",
    )
    p.add_argument("--only", default="abcd", help="which of a, b, c, d to run")
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
    args.decode_batches = positive_ints(p, args.decode_batch, "--decode-batch")
    at_least_one(p, args, "decode_prompt", "decode_steps")
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
    if "d" in args.only:
        engine_decode(model, args)


if __name__ == "__main__":
    main()
