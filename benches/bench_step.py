"""bench_step: where a decode step of ``radixkv.hf.engine`` spends its time, part by part, at
several numbers of running requests, on a real model.

    .venv/bin/python benches/bench_step.py [--quick] [--model smollm2|tiny|llama3-8b]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--batches 1,8,32,64] [--prompt 128]
        [--steps 16] [--threads 1]

B requests of ``--prompt`` distinct random tokens are prefilled (one step) and decoded one step
untimed, then ``--steps`` decode steps (``Engine.step``, every request one token) are timed end
to end and split into:

- ``schedule``: the batcher growing every running request by its next token;
- ``plan``: ``KVCache.plan`` (the Rust plan, the step's index tensors, the lane plan);
- ``model``: the transformers forward less its attention calls (embeddings, norms, RoPE, MLPs,
  the head);
- ``attn kernel``: the attention kernels inside ``Step.attention``: the SDPA backend's
  ``scaled_dot_product_attention`` calls, the Triton backend's kernel launches (another
  backend's kernels count in ``attn around``);
- ``attn around``: the rest of ``Step.attention`` (argument checks, the pool and lane writes,
  views);
- ``commit``: ``KVCache.commit``; ``sampling``: the engine's sampling and bookkeeping;
- ``other``: what is left of ``Engine.step`` (its statistics, Python between the parts).

Each part is timed by a wrapper (about a microsecond a call; on CUDA each one synchronizes, so
the figures are of a serialized, eager step). ``untimed ms`` is the step as the engine runs it,
with no timer inside (the device waited for once before and once after the steps; on CUDA the
decode steps replay CUDA graphs, whose counters are printed after the table: a capture that
failed makes the target line short): the breakdown's ``step ms`` exceeds it by what the timers
and the eager launches cost. ``outside forward`` is schedule + plan + commit +
sampling + other as a share of the step, the engine's own cost; the last line checks it against
the target (under 3% of a step at 32 requests).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from typing import Any

try:
    import torch

    import radixkv
    import radixkv.hf
    from radixkv.kv import step as step_mod
    from shapes import build, model_parser, parse_model_args
except ImportError as e:  # an install without the [hf] extra: nothing to measure
    print(f"bench_step: skipped ({e}); pip install radixkv[hf]")
    sys.exit(0)

import graph_counters
from common import at_least_one, positive_ints, table

PARTS = (
    "schedule",
    "plan",
    "model",
    "attn kernel",
    "attn around",
    "commit",
    "sampling",
    "other",
)
OUTSIDE = ("schedule", "plan", "commit", "sampling", "other")


class Clock:
    """Seconds per part, summed over the timed steps; ``sync`` waits for the device first."""

    def __init__(self, device: str) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cuda = device.startswith("cuda")

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(self, part: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += self.now() - t

        return timed


#: The engines whose steps were timed as they run (CUDA graphs where they can): their graph
#: counters are printed at the end.
ENGINES: list[Any] = []


def running(model: Any, b: int, args: argparse.Namespace, cuda_graphs: bool | None) -> Any:
    """An engine with ``b`` requests past their prefill and one decode step."""
    page = 16
    pages = b * (-(-(args.prompt + 2 * args.steps + 4) // page)) + 8
    eng = radixkv.hf.engine(
        model,
        radixkv.RadixCache(pages, page_size=page),
        token_budget=max(b * args.prompt, 256),
        max_batch=b,
        prefix_caching=False,
        stop_tokens=(),
        cuda_graphs=cuda_graphs,
    )
    gen = torch.Generator().manual_seed(b)
    prompts = torch.randint(0, model.config.vocab_size, (b, args.prompt), generator=gen)
    for row in prompts.numpy():
        eng.submit(row, max_new_tokens=2 * args.steps + 3)
    eng.step()  # the prefill
    eng.step()  # one decode step untimed: first-call costs (and a graph's capture) out
    return eng


def measure(model: Any, b: int, args: argparse.Namespace) -> dict[str, float]:
    """Milliseconds per decode step of each part (and ``step``) for ``b`` requests."""
    # The step as it runs (CUDA graphs where the engine uses them), no timer inside: one wait
    # for the device before and after.
    eng = running(model, b, args, None)
    ENGINES.append(eng)
    clock = Clock(args.device)
    t = clock.now()
    for _ in range(args.steps):
        eng.step()
    free = clock.now() - t
    # The breakdown: an eager engine (a graph's replay has no parts to time).
    eng = running(model, b, args, False)
    clock = Clock(args.device)
    kernel = torch.nn.functional.scaled_dot_product_attention
    attention = step_mod.Step.attention
    kernel_s = [0.0]

    def timing(fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t = clock.now()
            try:
                return fn(*a, **k)
            finally:
                kernel_s[0] += clock.now() - t

        return timed

    timed_kernel = timing(kernel)
    triton_kernels = None
    if eng.kv.attention == "triton" or (
        eng.kv.attention == "auto" and "triton" in eng.kv._backends
    ):
        from radixkv.kv.backends import triton_kernels
    launches = (
        {n: getattr(triton_kernels, n) for n in ("paged_decode", "paged_prefill")}
        if triton_kernels is not None
        else {}
    )

    forward_t = [0.0]

    def forward_start(*_: Any) -> None:
        forward_t[0] = clock.now()

    def forward_end(*_: Any) -> None:
        clock.seconds["forward"] += clock.now() - forward_t[0]

    eng.batcher.next_batch = clock.wrap("schedule", eng.batcher.next_batch)  # type: ignore[method-assign]
    eng.kv.plan = clock.wrap("plan", eng.kv.plan)  # type: ignore[method-assign]
    eng.kv.commit = clock.wrap("commit", eng.kv.commit)  # type: ignore[method-assign]
    eng._sample = clock.wrap("sampling", eng._sample)  # type: ignore[method-assign]
    hooks = [
        eng.model.register_forward_pre_hook(forward_start),
        eng.model.register_forward_hook(forward_end),
    ]
    torch.nn.functional.scaled_dot_product_attention = timed_kernel
    for name, fn in launches.items():
        setattr(triton_kernels, name, timing(fn))
    step_mod.Step.attention = clock.wrap("attention", attention)  # type: ignore[method-assign]
    try:
        total = 0.0
        for _ in range(args.steps):
            t = clock.now()
            eng.step()
            total += clock.now() - t
    finally:
        torch.nn.functional.scaled_dot_product_attention = kernel
        for name, fn in launches.items():
            setattr(triton_kernels, name, fn)
        step_mod.Step.attention = attention  # type: ignore[method-assign]
        for h in hooks:
            h.remove()
    s = clock.seconds
    n = args.steps
    out = {
        "step": total,
        "untimed": free,
        "schedule": s["schedule"],
        "plan": s["plan"],
        "model": s["forward"] - s["attention"],
        "attn kernel": kernel_s[0],
        "attn around": s["attention"] - kernel_s[0],
        "commit": s["commit"],
        "sampling": s["sampling"],
    }
    out["other"] = total - sum(out[p] for p in PARTS if p != "other")
    return {k: 1e3 * v / n for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = model_parser(__doc__)
    ap.add_argument("--batches", default="1,8,32,64", help="running requests, comma-separated")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    args = parse_model_args(ap, argv, quick=dict(batches="1,4", prompt=16, steps=3))
    batches = positive_ints(ap, args.batches, "--batches")
    at_least_one(ap, args, "prompt", "steps")
    model = build(args.model, args.device, args.torch_dtype)
    print(
        f"bench_step: {args.model}, {args.device}, {args.dtype}, {args.threads} CPU thread(s); "
        f"prompts of {args.prompt} tokens, {args.steps} decode steps timed; ms per step "
        "(share of the step)"
    )
    rows, outside = [], {}
    for b in batches:
        ms = measure(model, b, args)
        share = {p: ms[p] / ms["step"] for p in PARTS}
        outside[b] = sum(share[p] for p in OUTSIDE)
        rows.append(
            [str(b), f"{ms['untimed']:.2f}", f"{ms['step']:.2f}"]
            + [f"{ms[p]:.3f} ({100 * share[p]:.1f}%)" for p in PARTS]
            + [f"{100 * outside[b]:.2f}%"]
        )
    table(["requests", "untimed ms", "step ms", *PARTS, "outside forward"], rows)
    graphs = graph_counters.counters(ENGINES)
    print(graph_counters.line(graphs, args.device, "(the untimed column's engines)"))
    if 32 in outside:
        verdict = "holds" if outside[32] < 0.03 else "short"
        if not graph_counters.ok(graphs, args.device):
            verdict = "short: CUDA graphs not captured and replayed"
        print(
            f"target: the engine's own cost (outside the forward) under 3% of a step at 32 "
            f"requests: {100 * outside[32]:.2f}% ({verdict})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
