"""How long `radixkv serve` takes to start: seconds from launching the command until ``/health``
answers and until its first chat reply (one token, greedy), best of ``--runs`` starts, and where
the time goes inside one process (imports, model loading, the engine, the app).

    python benches/bench_serve_start.py [--runs 3] [--quick] [-- SERVE ARGS...]

The model is ``--model``'s (default: the packaged SmolLM2-135M-Instruct, converted once into the
model cache beforehand: a cold conversion is not timed here). Each start is a fresh process, so
imports are paid every time; the shared, noisy machine is why the best of several is reported.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(serve_args: list[str]) -> tuple[float, float]:
    """Seconds to ``/health`` answering and to the first chat reply, from the launch."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "radixkv", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"radixkv serve exited: {proc.stderr.read()}") from None
                time.sleep(0.02)
        ready = time.perf_counter() - t0
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
        req = urllib.request.Request(
            url + "/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=300).read()
        return ready, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(60)


def breakdown(serve_args: list[str]) -> list[tuple[str, float]]:
    """Where one start goes, timed in this process as the command runs it (once)."""
    parts: list[tuple[str, float]] = []
    t = time.perf_counter()
    from radixkv.apps import cli
    from radixkv.apps.serve import cmd as serve_cmd

    args, _ = cli.build_parser().parse_known_args(["serve", *serve_args])
    parts.append(("command line", time.perf_counter() - t))
    t = time.perf_counter()
    import torch

    parts.append(("import torch", time.perf_counter() - t))
    threads = args.threads if args.threads is not None else serve_cmd.default_threads()
    torch.set_num_threads(threads)
    t = time.perf_counter()
    import radixkv.hf

    parts.append(("import radixkv.hf (transformers' model code)", time.perf_counter() - t))
    t = time.perf_counter()
    from radixkv.apps.serve import app as serve

    parts.append(("import the server (fastapi)", time.perf_counter() - t))
    timed = {}
    for mod, name in ((radixkv.hf, "load"), (radixkv.hf, "engine"), (serve, "create_app")):
        real = getattr(mod, name)

        def wrapper(*a, _real=real, _name=name, **k):
            t = time.perf_counter()
            out = _real(*a, **k)
            timed[_name] = time.perf_counter() - t
            return out

        setattr(mod, name, wrapper)
    t = time.perf_counter()
    serve_cmd.build(args)
    total = time.perf_counter() - t
    parts += [
        ("load the model and tokenizer (radixkv.hf.load)", timed["load"]),
        ("the engine and its KV pool (radixkv.hf.engine)", timed["engine"]),
        ("the app (create_app)", timed["create_app"]),
        ("the rest of build", total - sum(timed.values())),
    ]
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="starts to time (the best is reported)")
    p.add_argument("--quick", action="store_true", help="one start, no breakdown (smoke)")
    p.add_argument("serve_args", nargs="*", help="arguments for radixkv serve (after --)")
    a = p.parse_args()
    if a.quick:
        a.runs = 1
    runs = [one_start(a.serve_args) for _ in range(a.runs)]
    for ready, first in runs:
        print(f"start: /health after {ready:.2f} s, first reply after {first:.2f} s")
    print(
        f"best of {a.runs}: /health after {min(r for r, _ in runs):.2f} s, "
        f"first reply after {min(f for _, f in runs):.2f} s"
    )
    if a.quick:
        return
    print("where one start goes (in one process):")
    for what, seconds in breakdown(a.serve_args):
        print(f"  {what:50s} {seconds:6.2f} s")


if __name__ == "__main__":
    main()
