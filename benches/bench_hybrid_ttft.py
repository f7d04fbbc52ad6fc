"""Time to first token of a cached turn of a hybrid model served by ``radixkv.hf.engine`` against
the same turn recomputed (issue 51, "Measure": TTFT of a cached turn on a tiny hybrid, CPU).

    .venv/bin/python benches/bench_hybrid_ttft.py [--family qwen3_5] [--prompt 1024]
        [--follow 32] [--reps 5] [--threads 1] [--quick]

A random model of the family (hidden 256, 4 layers: 3 recurrent and 1 attention for Qwen3.5,
fp32, CPU). Turn 1 is a prompt of ``--prompt`` tokens and 8 generated; turn 2 re-sends it whole
with the reply and ``--follow`` new tokens. Cached: turn 2 on the engine that served turn 1
(it restores the snapshot where turn 1 ended and computes the rest); recomputed: turn 2 on an
engine with ``prefix_caching=False``. Each figure is the median of ``--reps`` runs (turn 1
served again on a fresh cache each time). Both engines' tokens are checked equal. ``--quick``: a
128-token prompt, one run (the smoke check's size).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python" / "support"))

import radixkv
import radixkv.hf
from tiny_hybrid import FAMILIES, VOCAB, build


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_5", choices=list(FAMILIES))
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--follow", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a 128-token prompt, one run")
    args = ap.parse_args()
    if args.quick:
        args.prompt, args.reps = 128, 1
    torch.set_num_threads(args.threads)
    model = build(args.family, hidden_size=256, intermediate_size=512)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (args.prompt,), generator=gen).tolist()
    follow = torch.randint(0, VOCAB, (args.follow,), generator=gen).tolist()
    pages = 2 * (args.prompt + args.follow + 64)
    budget = args.prompt + args.follow + 16
    cached, recomputed = [], []
    for _ in range(args.reps):
        eng = radixkv.hf.engine(
            model, radixkv.RadixCache(pages, page_size=1, state_slots=8), token_budget=budget
        )
        (first,) = eng.generate([prompt], max_new_tokens=8)
        turn2 = prompt + first.output + follow
        (hit,) = eng.generate([turn2], max_new_tokens=1)
        cold = radixkv.hf.engine(
            model,
            radixkv.RadixCache(pages, page_size=1, state_slots=8),
            token_budget=budget,
            prefix_caching=False,
        )
        (miss,) = cold.generate([turn2], max_new_tokens=1)
        assert hit.output == miss.output, (hit.output, miss.output)
        cached.append(hit.ttft_s)
        recomputed.append(miss.ttft_s)
    c, r = statistics.median(cached), statistics.median(recomputed)
    print(
        f"{args.family}, turn 2 of {len(turn2)} tokens ({hit.cached_tokens} cached), "
        f"{args.threads} CPU thread(s), median of {args.reps}:"
    )
    print(f"  TTFT cached     {c * 1e3:8.1f} ms")
    print(f"  TTFT recomputed {r * 1e3:8.1f} ms   ({r / c:.1f}x the cached turn)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
