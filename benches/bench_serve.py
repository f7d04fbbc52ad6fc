"""bench_serve: agent sessions through ``radixkv serve`` over HTTP, with and without the prefix
cache, in one run, on the real model (SmolLM2-135M-Instruct, float32, CPU).

    .venv/bin/python benches/bench_serve.py [--quick] [--sessions N] [--turns T] [--threads K]

N concurrent agent sessions (a system prompt with tool schemas, a growing history, tool outputs)
talk to the server with the official ``openai`` client, each turn sending the whole conversation,
greedy. The same sessions run against the same server with ``prefix_caching=False``. Printed: TTFT
p50/p99 of turns 2+, requests/s, prompt tokens computed (the engine's own count), their ratios;
and the HTTP layer's own cost per request: a one-token request through the server minus the same
request through ``Engine`` directly (both cached, alternating, medians). Both servers run in this
process (uvicorn in a thread), so the engine's counters are read directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

import torch

import radixkv.hf
from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} in the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "pattern": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for name in sorted(
        [
            "read_file",
            "write_file",
            "run_tests",
            "grep",
            "list_dir",
            "git_diff",
            "git_log",
            "open_pr",
            "search_docs",
            "run_linter",
            "format_code",
            "install_package",
        ]
    )
]


def system_prompt(tools: int) -> str:
    schemas = "\n".join(json.dumps(t, sort_keys=True) for t in TOOLS[:tools])
    return (
        "You are a coding agent working in a Rust and Python repository. Call one tool per "
        "step and answer briefly.\nTools:\n" + schemas
    )


def tool_output(session: int, turn: int, lines: int) -> str:
    return "\n".join(
        f"tests/test_{session}_{turn}.py::test_case_{i} {'PASSED' if (i + turn) % 3 else 'FAILED'}"
        for i in range(lines)
    )


async def run_sessions(
    url: str, sessions: int, turns: int, max_tokens: int, tool_lines: int, tools: int
) -> list[list[tuple[int, float, int]]]:
    """Each session's turns as (turn, ttft seconds, cached tokens)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    async def one(s: int) -> list[tuple[int, float, int]]:
        messages = [
            {"role": "system", "content": system_prompt(tools)},
            {"role": "user", "content": f"Session {s}: fix the failing tests."},
        ]
        out = []
        for turn in range(turns):
            t0 = time.perf_counter()
            stream = await client.chat.completions.create(
                model="smollm2",
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            ttft, text, cached = None, [], 0
            async for chunk in stream:
                for c in chunk.choices:
                    if c.delta.content:
                        ttft = ttft or time.perf_counter() - t0
                        text.append(c.delta.content)
                if chunk.usage is not None:
                    cached = chunk.usage.prompt_tokens_details.cached_tokens
            out.append((turn, ttft if ttft is not None else time.perf_counter() - t0, cached))
            messages += [
                {"role": "assistant", "content": "".join(text)},
                {"role": "user", "content": "Tool output:\n" + tool_output(s, turn, tool_lines)},
            ]
        return out

    return await asyncio.gather(*(one(s) for s in range(sessions)))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def http_overhead(server, model, tok, repeats: int) -> tuple[float, float]:
    """Median seconds of a one-token cached request through HTTP and through Engine directly."""
    import httpx

    messages = [{"role": "user", "content": "Say yes."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    body = {"model": "smollm2", "messages": messages, "max_tokens": 1, "temperature": 0}
    eng = server.engine
    http, direct = [], []
    with httpx.Client(timeout=60) as client:
        client.post(server.url + "/v1/chat/completions", json=body).raise_for_status()  # warm
        for _ in range(repeats):
            t = time.perf_counter()
            client.post(server.url + "/v1/chat/completions", json=body).raise_for_status()
            http.append(time.perf_counter() - t)

            def through_engine():
                t = time.perf_counter()
                rid = eng.submit(ids, max_new_tokens=1)
                eng.run([rid], release=True)
                return time.perf_counter() - t

            direct.append(server.loop.call_blocking(through_engine))
    return statistics.median(http), statistics.median(direct)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds' worth (smoke runs)")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if smollm2_path() is None:
        print(f"bench_serve: skipped: the real model is not installed: {SMOLLM2_INSTALL}")
        return 0
    from test_serve import Server

    torch.set_num_threads(args.threads)
    sessions, turns, max_tokens, tool_lines, tools, repeats = (
        (2, 2, 4, 4, 4, 5) if args.quick else (args.sessions, args.turns, 12, 12, 12, 21)
    )
    model, tok = radixkv.hf.load("smollm2")
    rows = {}
    for caching in (True, False):
        server = Server(model, tok, prefix_caching=caching)
        try:
            before = server.engine.stats.tokens
            t0 = time.perf_counter()
            done = asyncio.run(
                run_sessions(server.url, sessions, turns, max_tokens, tool_lines, tools)
            )
            wall = time.perf_counter() - t0
            computed = server.engine.stats.tokens - before
            later = [ttft for s in done for turn, ttft, _ in s if turn > 0]
            cached = sum(c for s in done for _, _, c in s)
            rows[caching] = dict(
                p50=pct(later, 0.5),
                p99=pct(later, 0.99),
                rps=sessions * turns / wall,
                computed=computed,
                cached=cached,
            )
            if caching:
                overhead = http_overhead(server, model, tok, repeats)
        finally:
            server.close()
    on, off = rows[True], rows[False]
    print(
        f"== {sessions} agent sessions x {turns} turns over HTTP (openai client, SmolLM2-135M, "
        f"float32, {args.threads} threads), greedy, {max_tokens} tokens a reply"
    )
    print(f"{'':24}{'caching on':>14}{'caching off':>14}{'off / on':>10}")
    for key, label, fmt in (
        ("p50", "TTFT p50, turns 2+ (s)", "{:.3f}"),
        ("p99", "TTFT p99, turns 2+ (s)", "{:.3f}"),
        ("rps", "requests/s", "{:.2f}"),
        ("computed", "tokens computed", "{:,}"),
        ("cached", "cached_tokens reported", "{:,}"),
    ):
        ratio = off[key] / on[key] if on[key] else float("nan")
        if key == "rps":
            ratio = on[key] / off[key]
        print(f"{label:24}{fmt.format(on[key]):>14}{fmt.format(off[key]):>14}{ratio:>9.2f}x")
    http, direct = overhead
    print(
        f"HTTP layer per request: {1e3 * (http - direct):.2f} ms (a cached one-token chat "
        f"request: {1e3 * http:.1f} ms served, {1e3 * direct:.1f} ms through Engine directly; "
        f"medians of {repeats})"
    )
    target = "holds" if off["p50"] / on["p50"] >= 5 else "short"
    print(
        f"target: TTFT p50 of turns 2+ >= 5x lower with caching: {off['p50'] / on['p50']:.2f}x "
        f"({target})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
