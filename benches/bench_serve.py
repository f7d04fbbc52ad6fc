"""bench_serve: agent sessions through ``radixkv serve`` over HTTP, with and without the prefix
cache, in one run, on the real model (SmolLM2-135M-Instruct, float32, CPU).

    .venv/bin/python benches/bench_serve.py [--quick] [--sessions N] [--turns T] [--threads K]

N concurrent agent sessions (a system prompt with tool schemas, a growing history, tool outputs)
talk to the server with the official ``openai`` client, each turn sending the whole conversation,
greedy. The same sessions run against the same server with ``prefix_caching=False``. Printed: TTFT
p50/p99 of turns 2+, requests/s, prompt tokens computed (the engine's own count), their ratios;
and the HTTP layer's own cost per request: a one-token cached chat request's time inside the
server's ASGI app minus the same request through ``Engine`` directly (alternating, medians), and
apart from it what the client and loopback add. Both servers run in this process (uvicorn in a
thread), so the engine's counters are read directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python" / "support"))

import torch

import radixkv.hf
from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path

# What each tool does, as an agent's tool schema says it (a sentence or two each, as real schemas
# do; a coding agent's system prompt with its tools runs to a few thousand tokens).
TOOL_DOCS = {
    "format_code": "Formats the given files in place with the repository's formatter settings. "
    "Run it after editing; it changes whitespace only.",
    "git_diff": "Shows the uncommitted changes of the working tree, or of one path, as a "
    "unified diff with three lines of context.",
    "git_log": "Lists the most recent commits touching a path, newest first, one line each "
    "with the hash, the author and the subject.",
    "grep": "Searches the repository for lines matching a regular expression and returns "
    "each match with its file and line number; binary and ignored files are skipped.",
    "install_package": "Installs a package into the project's environment and records it in "
    "the lock file. Ask before adding a dependency the project does not already use.",
    "list_dir": "Lists the entries of a directory with their sizes; directories end in a "
    "slash. Hidden entries are left out unless the pattern names them.",
    "open_pr": "Opens a pull request from the current branch with a title and a body that "
    "says what changed and how it was tested.",
    "read_file": "Reads a file of the repository and returns its lines, numbered. Read a "
    "file before editing it; long files are cut at the given number of lines.",
    "run_linter": "Runs the project's linters on the given paths and returns each finding "
    "with its rule, file and line.",
    "run_tests": "Runs the test suite, or the tests matching a pattern, and returns the "
    "summary with the output of every failing test.",
    "search_docs": "Searches the project's documentation and returns the best matching "
    "passages with the page each comes from.",
    "write_file": "Writes the whole content of a file, creating it if needed. Prefer small "
    "edits; never write a file you have not read.",
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": doc,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "a path relative to the root"},
                    "pattern": {"type": "string", "description": "a glob or regex to filter by"},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 2000},
                },
                "required": ["path"],
            },
        },
    }
    for name, doc in sorted(TOOL_DOCS.items())
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


class AsgiTimer:
    """ASGI middleware: the seconds each HTTP request spent in the app, from its arrival to the
    last byte of its response handed to the server."""

    def __init__(self, app) -> None:
        self.app = app
        self.times: list[float] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()

        async def timed_send(message):
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.times.append(time.perf_counter() - t0)
            await send(message)

        await self.app(scope, receive, timed_send)


def http_overhead(server, tok, repeats: int) -> dict[str, float]:
    """Median seconds of a one-token cached chat request: end to end over HTTP (a keep-alive
    http.client connection, the lightest client there is), inside the ASGI app, and through
    ``Engine`` directly on the engine thread (alternating); ``app_rest`` and ``direct_rest``
    are the same less the time in ``Engine.step`` of each request, which is what both share
    (the model's forward), so their difference is the server's own cost without the forward's
    noise."""
    import http.client

    messages = [{"role": "user", "content": "Say yes."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    body = json.dumps({"model": "smollm2", "messages": messages, "max_tokens": 1, "temperature": 0})
    eng, timer = server.engine, server.app
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)

    def post() -> None:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        reply.read()
        assert reply.status == 200, reply.status

    def through_engine() -> float:
        t = time.perf_counter()
        rid = eng.submit(ids, max_new_tokens=1)
        eng.run([rid], release=True)
        return time.perf_counter() - t

    stepping = [0.0]
    step = eng.step

    def timed_step():
        t = time.perf_counter()
        try:
            return step()
        finally:
            stepping[0] += time.perf_counter() - t

    eng.step = timed_step
    post()  # warm
    e2e, direct, app_rest, direct_rest = [], [], [], []
    timer.times.clear()
    try:
        for _ in range(repeats):
            stepping[0] = 0.0
            t = time.perf_counter()
            post()
            e2e.append(time.perf_counter() - t)
            app_rest.append(timer.times[-1] - stepping[0])
            stepping[0] = 0.0
            direct.append(server.loop.call_blocking(through_engine))
            direct_rest.append(direct[-1] - stepping[0])
    finally:
        eng.step = step
        conn.close()
    med = statistics.median
    return dict(
        e2e=med(e2e),
        app=med(timer.times),
        direct=med(direct),
        app_rest=med(app_rest),
        direct_rest=med(direct_rest),
    )


def health_latency(server, model, repeats: int) -> tuple[float, float]:
    """Median seconds of ``GET /health`` sent right after another one, and sent right after a
    forward pass of the model on the engine thread: what running cold costs any request on
    this machine (a CPU forward streams every weight through the caches)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)

    def health() -> float:
        t = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        return time.perf_counter() - t

    x = torch.zeros(1, 20, dtype=torch.long)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    warm, cold = [], []
    for _ in range(repeats):
        health()
        warm.append(health())
        server.loop.call_blocking(forward)
        cold.append(health())
    conn.close()
    return statistics.median(warm), statistics.median(cold)


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
    from serve_thread import Server

    torch.set_num_threads(args.threads)
    sessions, turns, max_tokens, tool_lines, tools, repeats = (
        (2, 2, 4, 4, 4, 5) if args.quick else (args.sessions, args.turns, 12, 12, 12, 21)
    )
    model, tok = radixkv.hf.load("smollm2")
    rows = {}
    for caching in (True, False):
        # A pool that holds every session's context: without the prefix cache, a pool that
        # does not makes the sessions preempt each other and recompute (thrash), which would
        # flatter the cache.
        server = Server(model, tok, prefix_caching=caching, wrap=AsgiTimer, num_pages=32768)
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
                overhead = http_overhead(server, tok, repeats)
                health = health_latency(server, model, repeats)
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
        shown = "" if key == "cached" else f"{ratio:>9.2f}x"  # nothing is cached with it off
        print(f"{label:24}{fmt.format(on[key]):>14}{fmt.format(off[key]):>14}{shown}")
    o = overhead
    print(
        f"HTTP layer per request: {1e3 * (o['app_rest'] - o['direct_rest']):.2f} ms in the "
        f"server (a cached one-token chat request: {1e3 * o['app']:.1f} ms in the app, "
        f"{1e3 * o['direct']:.1f} ms through Engine directly; less Engine.step: "
        f"{1e3 * o['app_rest']:.2f} and {1e3 * o['direct_rest']:.2f} ms), "
        f"{1e3 * (o['e2e'] - o['app']):.2f} ms more for the client and loopback; "
        f"medians of {repeats}"
    )
    print(
        f"for scale: GET /health {1e3 * health[0]:.2f} ms right after another, "
        f"{1e3 * health[1]:.2f} ms right after a forward pass (caches cold)"
    )
    target = "holds" if off["p50"] / on["p50"] >= 5 else "short"
    print(
        f"target: TTFT p50 of turns 2+ >= 5x lower with caching: {off['p50'] / on['p50']:.2f}x "
        f"({target})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
