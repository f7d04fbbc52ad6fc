"""The host tier measured, not modeled: K multi-turn conversations served by ``radixkv.Engine``
on the built-in model, one CPU thread, three setups side by side in the same run.

Usage: .venv/bin/python benches/bench_tier_engine.py [--quick] [--conversations K]
[--turns T] [--system S] [--context C] [--message LO,HI] [--reply R] [--threads N] [--json PATH]

Workload (agent-like): every conversation starts from a shared S-token system prompt and its own
C-token context (a document, a tool output); each turn appends a user message of LO..HI tokens
to the history and generates R tokens greedily, which join the history too. The K conversations
take turns round robin (one turn of each, then the next turn of each, ...), so a conversation
comes back only after every other one has had its turn: the pattern that makes a device pool
too small for all of them thrash.

Setups (page size 16, the same model and weights, greedy):

(a) ``device``: a device pool holding about one conversation (its last request), no tier;
(b) ``device+host``: the same device pool plus a host tier holding every conversation
    (``RadixCache(..., host_pages=H)``, ``KVCache(..., host_device="cpu")``);
(c) ``device xK``: a device pool holding every conversation, no tier.

Each turn runs in the three setups in turn, the order rotating, so that drift of a shared machine
hits all alike. Printed per setup: prompt tokens computed (prefill work), the hit rate from the
cache's stats split by tier (device / host), the wall time of the run (the sum of the turns,
each timed around ``Session.send``), the mean time to first token (``Result.ttft_s``), and for
(b) the time spent performing the copies between the tiers (``KVCache.apply_copies``, timed
from a subclass that calls it before each ``plan``) and the bytes they moved. Then the ratios
(b)/(a) and (b)/(c) of TTFT and wall time. The greedy tokens of the three setups must be identical
(checked: the run stops otherwise), so the figures compare the same work.

On the CPU the "device" and the host are the same memory, so a copy between the tiers is a
memcpy: this measures what the tier's bookkeeping and copies cost an engine, not a PCIe link.

``--quick``: a 2-layer, 64-wide model, 3 conversations of 2 short turns (a smoke run of a few
seconds; its figures mean nothing). Default: the built-in model shape (4 layers, hidden 256),
6 conversations x 10 turns, histories of about 1.3k to 4.6k tokens; about a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import radixkv
from common import fmt_x, pin_one_core, table
from radixkv.kv.kv_cache import KVCache
from radixkv.models import CausalLM, ModelConfig

PAGE = 16
SETUPS = ("a", "b", "c")
LABELS = {"a": "(a) device", "b": "(b) device+host", "c": "(c) device xK"}


class TimedKVCache(KVCache):
    """A ``KVCache`` that performs the logged tier copies itself before each ``plan`` (the
    public ``apply_copies``, which ``plan`` would otherwise run first) and times them.
    ``copy_s``: seconds spent copying; ``copy_pages``: page copies performed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copy_s = 0.0
        self.copy_pages = 0

    def timed_copies(self) -> int:
        """``apply_copies()``, timed; returns the page copies it performed."""
        t0 = time.perf_counter()
        n = self.apply_copies()
        self.copy_s += time.perf_counter() - t0
        self.copy_pages += n
        return n

    def plan(self, requests: Sequence[radixkv.Request]) -> radixkv.Step:
        if self.host_pages:
            self.timed_copies()  # plan then finds nothing queued
        return super().plan(requests)


@dataclass
class Conversation:
    """One conversation's inputs: its first context and the user message of each turn."""

    context: np.ndarray
    messages: list[np.ndarray]


@dataclass
class Run:
    """One setup: its engine, pool, sessions and what its turns reported."""

    label: str
    cache: radixkv.RadixCache
    kv: TimedKVCache
    engine: radixkv.Engine
    sessions: list[radixkv.Session] = field(default_factory=list)
    results: list[list[radixkv.Result]] = field(default_factory=list)  # per conversation
    turn_s: list[float] = field(default_factory=list)


def conversations(args: argparse.Namespace, vocab: int) -> tuple[np.ndarray, list[Conversation]]:
    """The shared system prompt and each conversation's context and messages (seeded)."""
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab, args.system, dtype=np.uint32)
    lo, hi = args.message
    convs = [
        Conversation(
            rng.integers(0, vocab, args.context, dtype=np.uint32),
            [
                rng.integers(0, vocab, int(rng.integers(lo, hi + 1)), dtype=np.uint32)
                for _ in range(args.turns)
            ],
        )
        for _ in range(args.conversations)
    ]
    return system, convs


def conversation_tokens(system: np.ndarray, conv: Conversation, reply: int) -> int:
    """Tokens of a conversation's last request: its whole history, last reply included."""
    return len(system) + len(conv.context) + sum(len(m) + reply for m in conv.messages)


def make_run(model: CausalLM, label: str, device_pages: int, host_pages: int, budget: int) -> Run:
    cfg = model.config
    cache = radixkv.RadixCache(device_pages, PAGE, host_pages=host_pages)
    p = model.embed_tokens.weight
    kv = TimedKVCache(
        cache,
        cfg.num_layers,
        cfg.num_kv_heads,
        model.layers[0].self_attn.head_dim,
        dtype=p.dtype,
        device=p.device,
        host_device="cpu" if host_pages else None,
    )
    engine = radixkv.Engine(model, kv, token_budget=budget, max_batch=1)
    return Run(label, cache, kv, engine)


def play(model: CausalLM, args: argparse.Namespace) -> dict[str, Any]:
    cfg = model.config
    system, convs = conversations(args, cfg.vocab_size)
    longest = max(conversation_tokens(system, c, args.reply) for c in convs)
    one = math.ceil(longest / PAGE) + 2  # pages of the longest request, plus a little
    every = args.conversations * one
    budget = max(args.budget, longest)  # each prompt prefilled in one step: TTFT = one step
    runs = {
        "a": make_run(model, LABELS["a"], one, 0, budget),
        "b": make_run(model, LABELS["b"], one, every, budget),
        "c": make_run(model, LABELS["c"], every, 0, budget),
    }
    for run in runs.values():
        for conv in convs:
            run.sessions.append(
                radixkv.Session(run.engine, system=np.concatenate([system, conv.context]))
            )
            run.results.append([])
    # First-call costs out of the figures: one untimed request on a throwaway pool.
    warm = make_run(model, "warm-up", one, 0, budget)
    warm.engine.generate([convs[0].context[:256]], max_new_tokens=args.reply)

    order = list(SETUPS)
    i = 0
    for t in range(args.turns):
        for k, conv in enumerate(convs):
            for s in order[i % 3 :] + order[: i % 3]:
                run = runs[s]
                t0 = time.perf_counter()
                res = run.sessions[k].send(conv.messages[t], max_new_tokens=args.reply)
                run.turn_s.append(time.perf_counter() - t0)
                run.results[k].append(res)
            i += 1
    for run in runs.values():
        run.kv.timed_copies()  # anything logged after the last plan (nothing, normally)

    # The figures compare the same work only if every setup produced the same tokens.
    ref = [[r.output for r in rs] for rs in runs["c"].results]
    for s in ("a", "b"):
        got = [[r.output for r in rs] for rs in runs[s].results]
        if got != ref:
            k, t = next(
                (k, t)
                for k in range(len(ref))
                for t in range(len(ref[k]))
                if got[k][t] != ref[k][t]
            )
            raise RuntimeError(
                f"{LABELS[s]} generated other tokens than {LABELS['c']} (conversation {k}, "
                f"turn {t + 1}: {got[k][t]} vs {ref[k][t]}): the figures would compare other work"
            )

    bytes_per_page = PAGE * 2 * cfg.num_layers * cfg.num_kv_heads * runs["a"].kv.head_dim * 4
    out: dict[str, Any] = {
        "longest_tokens": longest,
        "device_pages": {"a": one, "b": one, "c": every},
        "host_pages": every,
    }
    rows = []
    for s, run in runs.items():
        st = run.cache.stats
        flat = [r for rs in run.results for r in rs]
        computed = sum(r.computed_tokens for r in flat)
        prompt = sum(r.prompt_tokens for r in flat)
        ttft = statistics.fmean(r.ttft_s for r in flat if r.ttft_s is not None)
        # Turn 1 finds only the system prompt cached in every setup: the later turns apart.
        later = [r.ttft_s for rs in run.results for r in rs[1:] if r.ttft_s is not None]
        ttft_later = statistics.fmean(later) if later else float("nan")
        wall = sum(run.turn_s)
        device_hit = st.hit_tokens - st.host_hit_tokens
        fig = {
            "prompt_tokens": prompt,
            "computed_tokens": computed,
            "hit_rate": st.hit_rate,
            "device_hit_rate": device_hit / st.query_tokens,
            "host_hit_rate": st.host_hit_tokens / st.query_tokens,
            "wall_s": wall,
            "mean_ttft_s": ttft,
            "mean_ttft_later_s": ttft_later,
            "offloaded_pages": st.offloaded_pages,
            "loaded_pages": st.loaded_pages,
            "copy_s": run.kv.copy_s,
            "copy_pages": run.kv.copy_pages,
            "copy_bytes": run.kv.copy_pages * bytes_per_page,
        }
        if run.kv.copy_pages != st.offloaded_pages + st.loaded_pages:
            raise RuntimeError(
                f"{run.label}: {run.kv.copy_pages} page copies performed, but the cache logged "
                f"{st.offloaded_pages} offloads + {st.loaded_pages} loads"
            )
        out[s] = fig
        rows.append(
            [
                run.label,
                f"{run.cache.stats.num_pages * PAGE:,}",
                f"{st.host_pages * PAGE:,}",
                f"{computed:,} / {prompt:,}",
                f"{st.hit_rate:.3f}",
                f"{fig['device_hit_rate']:.3f} / {fig['host_hit_rate']:.3f}",
                f"{wall:.2f} s",
                f"{ttft * 1e3:.1f} ms",
                f"{ttft_later * 1e3:.1f} ms",
                f"{run.kv.copy_s * 1e3:.1f} ms" if run.kv.host_pages else "-",
                f"{fig['copy_bytes'] / 2**20:,.1f} MiB" if run.kv.host_pages else "-",
            ]
        )
    print(
        f"{args.conversations} conversations x {args.turns} turns, round robin; system "
        f"{args.system} + context {args.context} tokens, messages {args.message[0]}-"
        f"{args.message[1]}, {args.reply} generated per turn; longest request {longest:,} "
        f"tokens; page size {PAGE}; KV {bytes_per_page // PAGE:,} bytes/token"
    )
    table(
        [
            "setup",
            "device tokens",
            "host tokens",
            "computed / prompt",
            "hit rate",
            "device / host",
            "wall",
            "mean TTFT",
            "turns 2+",
            "copy time",
            "copied",
        ],
        rows,
    )
    a, b, c = out["a"], out["b"], out["c"]
    ratios = {
        "ttft_b_over_a": b["mean_ttft_s"] / a["mean_ttft_s"],
        "ttft_b_over_c": b["mean_ttft_s"] / c["mean_ttft_s"],
        "ttft_later_b_over_a": b["mean_ttft_later_s"] / a["mean_ttft_later_s"],
        "ttft_later_b_over_c": b["mean_ttft_later_s"] / c["mean_ttft_later_s"],
        "wall_b_over_a": b["wall_s"] / a["wall_s"],
        "wall_b_over_c": b["wall_s"] / c["wall_s"],
        "copy_share_of_b_wall": b["copy_s"] / b["wall_s"],
    }
    out["ratios"] = ratios
    gbps = b["copy_bytes"] / b["copy_s"] / 1e9 if b["copy_s"] else float("nan")
    for other in ("a", "c"):
        print(
            f"(b)/({other}): mean TTFT {fmt_x(ratios[f'ttft_b_over_{other}'])}, turns 2+ "
            f"{fmt_x(ratios[f'ttft_later_b_over_{other}'])}, wall "
            f"{fmt_x(ratios[f'wall_b_over_{other}'])}"
        )
    print(
        f"(b) tier copies: {b['offloaded_pages']:,} pages offloaded, {b['loaded_pages']:,} "
        f"loaded, {b['copy_bytes'] / 2**20:,.1f} MiB in {b['copy_s'] * 1e3:.1f} ms "
        f"({gbps:.2f} GB/s), {ratios['copy_share_of_b_wall']:.1%} of its wall time"
    )
    print(
        "greedy tokens identical in the three setups (checked); wall: sum of the turns, each "
        "timed around Session.send; TTFT: Result.ttft_s, mean over every turn (turns 2+: "
        "over every turn but each conversation's first)"
    )
    return out


#: ``--quick``: every part runs, on sizes that take a few seconds in all.
QUICK = {
    "conversations": 3,
    "turns": 2,
    "system": 32,
    "context": 96,
    "message": "16,48",
    "reply": 2,
    "hidden": 64,
    "layers": 2,
}


def message_range(text: str) -> tuple[int, int]:
    """``LO,HI`` (1 <= LO <= HI) as a pair; ArgumentTypeError naming the bad value otherwise."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two ints), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--conversations", type=int, default=6, help="K, conversations")
    p.add_argument("--turns", type=int, default=10, help="turns per conversation")
    p.add_argument("--system", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--context", type=int, default=1024, help="each conversation's first context")
    p.add_argument(
        "--message", type=message_range, default="200,400", help="user message tokens: LO,HI"
    )
    p.add_argument("--reply", type=int, default=4, help="tokens generated per turn")
    p.add_argument(
        "--budget",
        type=int,
        default=2048,
        help="engine token budget (at least the "
        "longest request, so that every prompt is prefilled in one step)",
    )
    p.add_argument("--hidden", type=int, default=256, help="model width (the built-in: 256)")
    p.add_argument("--layers", type=int, default=4, help="model depth (the built-in: 4)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write every figure to this file")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of a few seconds: a tiny model and short conversations (options "
        "given explicitly still win); its figures say nothing",
    )
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**QUICK)
        args = p.parse_args(argv)
    for name in ("conversations", "turns", "context", "reply", "budget", "hidden", "layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.system < 0:
        p.error(f"--system must be >= 0, got {args.system}")
    if args.conversations < 2:
        p.error(f"--conversations must be >= 2 (one fits the small pool), got {args.conversations}")
    torch.set_num_threads(args.threads)
    # SwiGLU width in Llama's ratio (688 / 256), rounded to a multiple of 8.
    inter = (args.hidden * 688 // 256 + 7) // 8 * 8
    config = ModelConfig(hidden_size=args.hidden, intermediate_size=inter, num_layers=args.layers)
    model = CausalLM.random(config, seed=0)
    print(
        f"radixkv {radixkv.__version__}, torch {torch.__version__}, {pin_one_core()}, "
        f"{torch.get_num_threads()} CPU thread(s); model: {config.num_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_heads}/{config.num_kv_heads} heads, vocab "
        f"{config.vocab_size}, fp32"
    )
    t0 = time.perf_counter()
    out = play(model, args)
    print(f"(run: {time.perf_counter() - t0:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
