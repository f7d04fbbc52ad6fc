"""bench_structured: what structured output costs and what jump-forward saves, in one run, on the
real model (SmolLM2-135M-Instruct, float32, CPU).

    .venv/bin/python benches/bench_structured.py [--quick] [--threads K]

1. Mask overhead: B requests decode N tokens each, unconstrained (``stop=()``) and constrained
   by a JSON schema (a string of at least 1,000 characters, so every row runs its N tokens and
   every step computes and applies a mask), jump-forward off so both take one decode step per
   token. The two alternate, repeats taken as medians; the prefill step is not timed. Printed:
   decode tokens/s of each, constrained over unconstrained (the goal is >= 0.90: at most 10%
   overhead per decode step), and the engine's own mask time per step.
2. Jump-forward: tool calls (JSON with fixed keys: the tool's name, its argument names,
   brackets and separators) generated greedy with jump-forward on and off. Printed per tool:
   output tokens (the same text both ways, checked), forward passes of each, their ratio (the
   goal is >= 1.5x fewer), and wall time.

Benchmarks are not tests: nothing asserts a time. Skipped (exit 0) without the real model,
llguidance or transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

try:
    import llguidance  # noqa: F401
    import torch

    import radixkv
    import radixkv.hf
    from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path
except ImportError as e:  # an install without the [hf] or [grammar] extra: nothing to measure
    print(f"bench_structured: skipped ({e}); pip install 'radixkv[hf,grammar]'")
    sys.exit(0)

from common import table

LONG_TEXT = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 1000}},
    "required": ["story"],
    "additionalProperties": False,
}


def tool(name: str, args: dict) -> tuple[str, dict]:
    """A tool call's JSON schema: ``{"name": <name>, "arguments": {...}}`` with fixed keys."""
    params = {
        "type": "object",
        "properties": args,
        "required": list(args),
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return name, schema


SHORT = {"type": "string", "maxLength": 16}
TOOLS = [
    (
        "What is the weather in Paris?",
        tool("get_weather", {"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    ),
    (
        "Find the docs about prefix caching.",
        tool(
            "search_docs",
            {"query": SHORT, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        ),
    ),
    (
        "Show lines 10 to 20 of engine.py.",
        tool(
            "read_file",
            {
                "path": SHORT,
                "start_line": {"type": "integer", "minimum": 1, "maximum": 9999},
                "end_line": {"type": "integer", "minimum": 1, "maximum": 9999},
            },
        ),
    ),
    (
        "Run the tests of the scheduler.",
        tool("run_tests", {"target": SHORT, "verbose": {"type": "boolean"}}),
    ),
]


def chat(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def decode_rate(model, tok, prompts, n: int, grammar) -> tuple[float, float, int]:
    """Decode tokens/s of ``prompts`` run together for ``n`` tokens each (the prefill step
    untimed), the engine's mask seconds per decode step, and the decode steps."""
    eng = radixkv.hf.engine(model, radixkv.RadixCache(16384), tokenizer=tok)
    eng.jump_forward = False
    ids = [eng.submit(p, n, stop=(), grammar=grammar) for p in prompts]
    eng.step()  # the prefill (and the first token)
    mask0, steps0 = eng.stats.mask_s, eng.stats.steps
    t = time.perf_counter()
    while eng.has_work:
        eng.step()
    dt = time.perf_counter() - t
    results = [eng.result(i) for i in ids]
    assert all(r.finish_reason == "length" and len(r.output) == n for r in results)
    steps = eng.stats.steps - steps0
    return len(prompts) * steps / dt, (eng.stats.mask_s - mask0) / steps, steps


def mask_overhead(model, tok, batches: list[int], n: int, repeats: int) -> None:
    print(f"1. Mask overhead: {n} decode tokens per request, jump-forward off, {repeats} repeats")
    rows = []
    for b in batches:
        prompts = [chat(tok, f"Tell story number {i} about a cache.") for i in range(b)]
        free, bound, masks = [], [], []
        decode_rate(model, tok, prompts, 2, LONG_TEXT)  # compile, warm up
        for _ in range(repeats):
            free.append(decode_rate(model, tok, prompts, n, None)[0])
            rate, mask_s, _ = decode_rate(model, tok, prompts, n, LONG_TEXT)
            bound.append(rate)
            masks.append(mask_s)
        f, c, m = statistics.median(free), statistics.median(bound), statistics.median(masks)
        rows.append([f"B={b}", f"{f:.1f}", f"{c:.1f}", f"{c / f:.3f}", f"{m * 1e3:.2f} ms"])
    table(
        ["batch", "free tok/s", "schema tok/s", "schema / free", "mask per step"],
        rows,
    )


def jump_forward(model, tok, tools) -> None:
    print("2. Jump-forward on tool calls (JSON with fixed keys), greedy")
    rows, total = [], {True: 0, False: 0}
    for question, (name, schema) in tools:
        prompt = chat(tok, f"{question} Call {name}.")
        runs = {}
        for jump in (True, False):
            eng = radixkv.hf.engine(model, radixkv.RadixCache(8192), tokenizer=tok)
            eng.jump_forward = jump
            t = time.perf_counter()
            (r,) = eng.generate([prompt], max_new_tokens=96, grammar=schema)
            runs[jump] = (r, eng.stats.steps, time.perf_counter() - t)
            total[jump] += eng.stats.steps
        (on, p_on, t_on), (off, p_off, t_off) = runs[True], runs[False]
        assert on.text == off.text, (on.text, off.text)
        json.loads(on.text)
        rows.append(
            [
                name,
                str(len(on.output)),
                str(on.forced_tokens),
                str(p_off),
                str(p_on),
                f"{p_off / p_on:.2f}x",
                f"{t_off:.2f} s",
                f"{t_on:.2f} s",
                f"{t_off / t_on:.2f}x",
            ]
        )
    rows.append(
        [
            "all",
            "",
            "",
            str(total[False]),
            str(total[True]),
            f"{total[False] / total[True]:.2f}x",
            "",
            "",
            "",
        ]
    )
    table(
        [
            "tool",
            "tokens",
            "forced",
            "passes off",
            "passes on",
            "fewer",
            "time off",
            "time on",
            "faster",
        ],
        rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds' worth (smoke runs)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args()
    if smollm2_path() is None:
        print(f"bench_structured: skipped: the real model is not installed: {SMOLLM2_INSTALL}")
        return
    torch.set_num_threads(args.threads)
    model, tok = radixkv.hf.load("smollm2")
    if args.quick:
        mask_overhead(model, tok, [1], 6, 1)
        jump_forward(model, tok, TOOLS[:1])
    else:
        mask_overhead(model, tok, [1, 8], 24, 5)
        jump_forward(model, tok, TOOLS)


if __name__ == "__main__":
    main()
