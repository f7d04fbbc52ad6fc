"""bench_decode: decode tokens/s of ``radixkv.hf.engine`` against transformers' own
``model.generate`` on the same weights, at several numbers of running requests, in one run.

    .venv/bin/python benches/bench_decode.py [--quick] [--model smollm2|tiny|llama3-8b]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--batches 1,8,32,64] [--prompt 128]
        [--new 32] [--threads 1] [--repeat 3] [--compile [BACKEND]]

B requests of ``--prompt`` tokens each (distinct random ids, all of one length, so ``generate``
needs no padding), greedy, ``--new`` tokens each. Each method's decode rate is measured as B x
(new - 1) tokens over the time of the whole run less the time of the same run with one new token
(its prefill), so that both are charged the same way; the methods alternate ``--repeat`` times.
The ratio is given of each method's best run (a shared machine's noise only ever adds time: on a
2-core machine ``generate``'s own steps at 8 requests varied by 1.4x within one run) and of the
medians; the target is read on the best runs. ``generate`` uses transformers' static cache on
CUDA (a preallocated contiguous cache, its fastest decode) and its default dynamic cache on the
CPU. The engine runs without prefix caching (nothing is shared between the prompts anyway): one
engine per batch size, its pool sized for the batch, warmed up by one untimed run of the same
shape (which compiles the kernels and, on CUDA, captures the batch's decode graph) and kept for
the timed runs, so that no capture or compile lands in a rate. The forward is timed with CUDA
events (never a host sync, and nothing recorded while a graph is being captured). Printed per
batch size: both rates (best runs), their ratios, the share of the engine's decode time spent
outside the model's forward or graph replay (planning, packing, sampling, commit, Python),
whether the tokens equal ``generate``'s, and the engine's graph counters over the timed runs
(captured / replayed / eager steps). The last lines are the graph counters of all engines and
the target (>= 1.0x ``generate`` at every batch size) and whether it holds; on CUDA a capture
that failed, or timed decode steps that replayed no graph, make it short whatever the rates.

``--compile``: a second engine per batch size, ``radixkv.hf.engine(..., compile=BACKEND)``
(``torch.compile`` of the model around radixkv's attention, Inductor by default), timed in the
same alternation: its rate and its ratios to ``generate`` and to the eager engine, and the
seconds of its warm-up run (which compiles each new shape; the eager engine's warm-up is given
beside it). The target line stays the eager engine's.
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

import graph_counters
from common import at_least_one, positive_ints, table


class ForwardClock:
    """Seconds spent in the model's forward (the top-level call) and in the engine's graph
    replays, accumulated. On CUDA each span is a pair of events recorded on the stream (no host
    sync; read by :meth:`read`, after the run's own sync); a forward that runs while a graph
    is being captured records nothing (an event there would join the graph)."""

    def __init__(self, model: Any, eng: Any, device: str) -> None:
        self._cuda = device.startswith("cuda")
        self._spans: list[tuple[Any, Any]] = []
        self._depth = 0
        self._t: Any = None
        self._handles = [
            model.register_forward_pre_hook(self._start),
            model.register_forward_hook(self._stop),
        ]
        self._graphs = getattr(eng, "graphs", None)
        if self._graphs is not None:
            run = self._graphs.run

            def timed(step: Any) -> Any:
                self._start()
                try:
                    return run(step)
                finally:
                    self._stop()

            self._graphs.run = timed

    def _now(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _start(self, *_: Any) -> None:
        self._depth += 1
        if self._depth == 1 and not (self._cuda and torch.cuda.is_current_stream_capturing()):
            self._t = self._now()

    def _stop(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._t is not None:
            if not (self._cuda and torch.cuda.is_current_stream_capturing()):
                self._spans.append((self._t, self._now()))
            self._t = None

    def read(self) -> float:
        """Seconds of the spans since the last read (the caller has waited for the device)."""
        spans, self._spans = self._spans, []
        if self._cuda:
            return sum(a.elapsed_time(b) for a, b in spans) / 1e3
        return sum(b - a for a, b in spans)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self._graphs is not None:
            del self._graphs.run  # the instance attribute: the class's method again
            self._graphs = None


def run_generate(model: Any, prompts: torch.Tensor, new: int, static: bool) -> torch.Tensor:
    kw: dict[str, Any] = dict(
        max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
    )
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
    return out[:, prompts.shape[1] :]


def make_engine(model: Any, b: int, prompt: int, new: int, page: int, compile: Any = False) -> Any:
    """One engine for ``b`` requests of ``prompt`` + ``new`` tokens, kept for every run
    (``compile``: ``radixkv.hf.engine``'s)."""
    pages = b * (-(-(prompt + new) // page)) + 8
    return radixkv.hf.engine(
        model,
        radixkv.RadixCache(pages, page_size=page),
        token_budget=max(b * prompt, 256),
        max_batch=b,
        prefix_caching=False,
        stop_tokens=(),
        compile=compile,
    )


def run_engine(eng: Any, prompts: torch.Tensor, new: int) -> list[list[int]]:
    rows = prompts.cpu().numpy()
    ids = [eng.submit(row, max_new_tokens=new) for row in rows]
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
    ap.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="also time an engine whose model is torch.compile'd (default backend: inductor)",
    )
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

    rows, ratios, counts, timed_replays = [], [], [], []
    compiled_rows: list[list[str]] = []
    for b in batches:
        prompts = torch.randint(0, vocab, (b, args.prompt), generator=gen).to(args.device)
        rates: dict[str, list[float]] = {"generate": [], "engine": [], "compiled": []}
        outside: list[float] = []
        outs: dict[str, Any] = {}
        eng = make_engine(model, b, args.prompt, args.new, args.page_size)
        # Warm-up of this shape: compiles, and captures the batch's graph, before any timer.
        warm = torch.randint(0, vocab, (b, args.prompt), generator=gen).to(args.device)
        warm_s = {"engine": timed(lambda e=eng, w=warm: run_engine(e, w, args.new), args.device)[0]}
        comp = None
        if args.compile:
            comp = make_engine(model, b, args.prompt, args.new, args.page_size, args.compile)
            warm_s["compiled"] = timed(
                lambda c=comp, w=warm: run_engine(c, w, args.new), args.device
            )[0]
        before = graph_counters.counters([eng])
        for _ in range(args.repeat):
            t1, _ = timed(
                lambda prompts=prompts: run_generate(model, prompts, 1, static), args.device
            )
            tn, outs["generate"] = timed(
                lambda prompts=prompts: run_generate(model, prompts, args.new, static), args.device
            )
            rates["generate"].append(b * (args.new - 1) / max(tn - t1, 1e-9))
            clock = ForwardClock(model, eng, args.device)
            try:
                t1, _ = timed(
                    lambda eng=eng, prompts=prompts: run_engine(eng, prompts, 1), args.device
                )
                f1 = clock.read()
                tn, outs["engine"] = timed(
                    lambda eng=eng, prompts=prompts: run_engine(eng, prompts, args.new),
                    args.device,
                )
                fn = clock.read()
            finally:
                clock.close()
            rates["engine"].append(b * (args.new - 1) / max(tn - t1, 1e-9))
            decode = max(tn - t1, 1e-9)
            outside.append(max(0.0, decode - (fn - f1)) / decode)
            if comp is not None:
                t1, _ = timed(
                    lambda c=comp, prompts=prompts: run_engine(c, prompts, 1), args.device
                )
                tn, outs["compiled"] = timed(
                    lambda c=comp, prompts=prompts: run_engine(c, prompts, args.new), args.device
                )
                rates["compiled"].append(b * (args.new - 1) / max(tn - t1, 1e-9))
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
                graph_cell(before, after := graph_counters.counters([eng])),
            ]
        )
        if comp is not None:
            c = max(rates["compiled"])
            same_c = sum(1 for x, y in zip(outs["compiled"], want) if x == y)
            compiled_rows.append(
                [
                    str(b),
                    f"{g:,.1f}",
                    f"{e:,.1f}",
                    f"{c:,.1f}",
                    f"{c / g:.2f}x",
                    f"{c / e:.2f}x",
                    f"{warm_s['compiled']:.1f} / {warm_s['engine']:.1f}",
                    f"{same_c}/{b}",
                ]
            )
        timed_replays.append(after["replayed"] - before["replayed"])
        counts.append(after)
        del eng, comp  # pools and graphs: the next batch size's engines get the memory
    table(
        [
            "requests",
            "generate tok/s",
            "engine tok/s",
            "engine / generate",
            "(medians)",
            "engine outside forward",
            "tokens equal",
            "graphs timed (captured/replayed/eager)",
        ],
        rows,
    )
    if compiled_rows:
        print(f"torch.compile (backend {args.compile}) of the model around radixkv's attention:")
        table(
            [
                "requests",
                "generate tok/s",
                "engine tok/s",
                "compiled tok/s",
                "compiled / generate",
                "compiled / engine",
                "warm-up s (compiled / eager)",
                "tokens equal",
            ],
            compiled_rows,
        )
    c = graph_counters.total(counts)
    print(graph_counters.line(c, args.device, "(all engines, warm-ups included)"))
    worst = min(ratios)
    verdict = "holds" if worst >= 1.0 else "short"
    if not graph_counters.ok(c, args.device) or (
        args.device.startswith("cuda") and min(timed_replays) == 0
    ):
        verdict = "short: CUDA graphs not captured and replayed, the rates are eager ones"
    print(
        f"target: decode tokens/s >= 1.0x model.generate at every batch size: worst "
        f"{worst:.2f}x ({verdict})"
    )
    return 0


def graph_cell(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The graph counters of the timed runs of one engine: captured/replayed/eager (or off)."""
    if after["on"] == 0:
        return "off"
    cell = "/".join(str(after[k] - before[k]) for k in ("captured", "replayed", "eager"))
    return cell + (f" FAILED {after['failed']}" if after["failed"] else "")


if __name__ == "__main__":
    sys.exit(main())
