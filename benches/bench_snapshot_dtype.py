"""How exact a hybrid model stays with its recurrent-state snapshots held narrower than its
states (issue 51: "snapshot dtype option (bf16 for fp32 states halves them), measured for
exactness"), per family, against transformers' ``generate``.

    .venv/bin/python benches/bench_snapshot_dtype.py [--family F ...] [--dtype bfloat16 ...]
        [--turns 4] [--new 8] [--sessions 2] [--quick]

Each of the 8 tiny families (fp32, CPU: tests/python/support/tiny_hybrid.py) serves
``--sessions`` multi-turn sessions on ``radixkv.hf.engine(..., snapshot_dtype=D)``: each turn
re-sends the whole history (the engine's own replies, then 5 new tokens), so every turn after the
first restores the snapshot where the previous turn ended. Per family and dtype it prints:

- ``tokens``: greedy output tokens equal to ``generate`` on the same prompt, of all;
- ``turns``: turns whose whole output equals ``generate``'s;
- ``max |dlogprob|``: the largest error of an output token's log-probability against one fp32
  forward over the whole sequence (prompt and the engine's own tokens before it);
- ``restored``: snapshots restored (hits), so that the figures do measure restored states.

fp32 snapshots (the states' own dtype) run first, as the baseline of the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python" / "support"))

import radixkv
import radixkv.hf
from tiny_hybrid import FAMILIES, VOCAB, build

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def session(
    model: Any, dtype: torch.dtype | None, turns: int, new: int, seed: int
) -> tuple[int, int, int, float, int]:
    """One session: (tokens equal to generate's, tokens, turns equal, max |dlogprob|,
    snapshots restored)."""
    cache = radixkv.RadixCache(512, page_size=1, state_slots=16)
    eng = radixkv.hf.engine(model, cache, token_budget=64, snapshot_dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    same = total = same_turns = 0
    err = 0.0
    for _ in range(turns):
        (r,) = eng.generate([prompt], max_new_tokens=new, logprobs=True)
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
            want = want[0, len(prompt) :].tolist()
            seq = torch.tensor([prompt + r.output[:-1]])
            logits = model(input_ids=seq).logits[0, len(prompt) - 1 :].float()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(r.output)), torch.tensor(r.output)]
        err = max(err, (torch.tensor(r.logprobs) - ref).abs().max().item())
        same += sum(a == b for a, b in zip(r.output, want))
        total += len(want)
        same_turns += r.output == want
        prompt = prompt + r.output + torch.randint(0, VOCAB, (5,), generator=gen).tolist()
    eng.cache.check()
    return same, total, same_turns, err, eng.states.restored


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--dtype", nargs="*", default=["bfloat16"], choices=list(DTYPES))
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--quick", action="store_true", help="one family, one session of 2 turns of 4 tokens"
    )
    args = ap.parse_args()
    if args.quick:
        args.family, args.sessions, args.turns, args.new = args.family[:1], 1, 2, 4
    torch.set_num_threads(args.threads)
    dtypes = ["float32"] + [d for d in args.dtype if d != "float32"]
    print(
        f"{'family':<18} {'snapshots':<9} {'tokens':>9} {'turns':>7} {'max |dlogprob|':>15} "
        f"{'restored':>8}"
    )
    for family in args.family:
        model = build(family)
        for name in dtypes:
            dtype = None if name == "float32" else DTYPES[name]
            same = total = same_turns = restored = 0
            err = 0.0
            for s in range(args.sessions):
                a, b, c, e, n = session(model, dtype, args.turns, args.new, seed=100 + s)
                same, total, same_turns = same + a, total + b, same_turns + c
                err, restored = max(err, e), restored + n
            turns = args.turns * args.sessions
            print(
                f"{family:<18} {name:<9} {same:>4}/{total:<4} {same_turns:>3}/{turns:<3} "
                f"{err:>15.3g} {restored:>8}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
