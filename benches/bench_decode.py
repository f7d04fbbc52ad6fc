"""bench_decode: decode tokens/s of ``radixkv.hf.engine`` against transformers' own
``model.generate`` on the same weights, at several numbers of running requests, in one run.

    .venv/bin/python benches/bench_decode.py [--quick] [--model smollm2|tiny|llama3-8b]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--batches 1,8,32,64] [--prompt 128]
        [--new 32] [--threads 1] [--repeat 3]

B requests of ``--prompt`` tokens each (distinct random ids, all of one length, so ``generate``
needs no padding), greedy, ``--new`` tokens each. Each method's decode rate is measured as B x
(new - 1) tokens over the time of the whole run less the time of the same run with one new token
(its prefill), so that both are charged the same way; the methods alternate ``--repeat`` times.
The ratio is given of each method's best run (a shared machine's noise only ever adds time: on a
2-core machine ``generate``'s own steps at 8 requests varied by 1.4x within one run) and of the
medians; the target is read on the best runs. ``generate`` uses transformers' static cache on
CUDA (a preallocated contiguous cache, its fastest decode) and its default dynamic cache on the
CPU. The engine runs without prefix caching (nothing is shared between the prompts anyway), one
pool sized for the batch. Printed per batch size: both rates (best runs), their ratios, the
share of the engine's decode time spent outside the model's forward (planning, packing,
sampling, commit, Python), and whether the tokens equal ``generate``'s. The last line is the
target (>= 1.0x ``generate`` at every batch size) and whether it holds.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

try:
    import torch

    import radixkv
    import radixkv.hf
    from shapes import build, model_parser, parse_model_args, sync
except ImportError as e:  # an install without the [hf] extra: nothing to measure
    print(f"bench_decode: skipped ({e}); pip install radixkv[hf]")
    sys.exit(0)

from common import at_least_one, positive_ints, table


class ForwardClock:
    """Seconds spent in the model's forward (the top-level call), accumulated."""

    def __init__(self, model: Any, device: str) -> None:
        self.seconds = 0.0
        self._device = device
        self._handles = [
            model.register_forward_pre_hook(self._start),
            model.register_forward_hook(self._stop),
        ]
        self._t = 0.0

    def _start(self, *_: Any) -> None:
        sync(self._device)
        self._t = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        sync(self._device)
        self.seconds += time.perf_counter() - self._t

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def run_generate(model: Any, prompts: torch.Tensor, new: int, static: bool) -> torch.Tensor:
    kw: dict[str, Any] = dict(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
    return out[:, prompts.shape[1] :]


def run_engine(model: Any, prompts: torch.Tensor, new: int, page: int) -> list[list[int]]:
    b, p = prompts.shape
    pages = b * (-(-(p + new) // page)) + 8
    eng = radixkv.hf.engine(
        model,
        radixkv.RadixCache(pages, page_size=page),
        token_budget=max(b * p, 256),
        max_batch=b,
        prefix_caching=False,
        stop_tokens=(),
    )
    rows = prompts.cpu().numpy()
    ids = [eng.submit(rows[i], max_new_tokens=new) for i in range(b)]
    results = {r.id: r for r in eng.run(ids, release=True)}
    return [list(results[i].output) for i in ids]


def timed(fn: Any, device: str) -> tuple[float, Any]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def main(argv: list[str] | None = None) -> int:
    ap = model_parser(__doc__)
    ap.add_argument("--batches", default="1,8,32,64", help="running requests, comma-separated")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = parse_model_args(ap, argv, quick=dict(batches="1,4", prompt=16, new=4, repeat=1))
    batches = positive_ints(ap, args.batches, "--batches")
    at_least_one(ap, args, "prompt", "new", "page_size", "repeat")
    model = build(args.model, args.device, args.torch_dtype)
    vocab = model.config.vocab_size
    static = args.device.startswith("cuda")
    print(
        f"bench_decode: {args.model}, {args.device}, {args.dtype}, {args.threads} CPU thread(s); "
        f"prompts of {args.prompt} tokens, {args.new} new tokens each, greedy; generate with its "
        f"{'static' if static else 'dynamic'} cache"
    )
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(0, vocab, (2, 8), generator=gen).to(args.device)
    run_generate(model, warm, 2, static)
    run_engine(model, warm, 2, args.page_size)

    rows, ratios = [], []
    for b in batches:
        prompts = torch.randint(0, vocab, (b, args.prompt), generator=gen).to(args.device)
        rates: dict[str, list[float]] = {"generate": [], "engine": []}
        outside: list[float] = []
        outs: dict[str, Any] = {}
        for _ in range(args.repeat):
            t1, _ = timed(
                lambda prompts=prompts: run_generate(model, prompts, 1, static), args.device
            )
            tn, outs["generate"] = timed(
                lambda prompts=prompts: run_generate(model, prompts, args.new, static), args.device
            )
            rates["generate"].append(b * (args.new - 1) / max(tn - t1, 1e-9))
            clock = ForwardClock(model, args.device)
            try:
                t1, _ = timed(
                    lambda prompts=prompts: run_engine(model, prompts, 1, args.page_size),
                    args.device,
                )
                f1, clock.seconds = clock.seconds, 0.0
                tn, outs["engine"] = timed(
                    lambda prompts=prompts: run_engine(model, prompts, args.new, args.page_size),
                    args.device,
                )
                fn = clock.seconds
            finally:
                clock.close()
            rates["engine"].append(b * (args.new - 1) / max(tn - t1, 1e-9))
            decode = max(tn - t1, 1e-9)
            outside.append(max(0.0, decode - (fn - f1)) / decode)
        g, e = max(rates["generate"]), max(rates["engine"])
        med = statistics.median(rates["engine"]) / statistics.median(rates["generate"])
        ratios.append(e / g)
        want = outs["generate"].cpu().tolist()
        same = sum(1 for x, y in zip(outs["engine"], want) if x == y)
        rows.append(
            [
                str(b),
                f"{g:,.1f}",
                f"{e:,.1f}",
                f"{e / g:.2f}x",
                f"{med:.2f}x",
                f"{100 * statistics.median(outside):.1f}%",
                f"{same}/{b}",
            ]
        )
    table(
        [
            "requests",
            "generate tok/s",
            "engine tok/s",
            "engine / generate",
            "(medians)",
            "engine outside forward",
            "tokens equal",
        ],
        rows,
    )
    worst = min(ratios)
    verdict = "holds" if worst >= 1.0 else "short"
    print(
        f"target: decode tokens/s >= 1.0x model.generate at every batch size: worst "
        f"{worst:.2f}x ({verdict})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
