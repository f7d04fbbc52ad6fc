"""bench_shared: the shared KV tier on a real ``redis-server`` (started here on a free loopback
port, stopped by its PID; skipped, saying why, where ``redis-server`` or redis-py is missing),
or on a store the caller runs (``--store URL``: Mooncake Store, ``mooncake://master:port``,
beside a ``mooncake_client`` holder; nothing in it is flushed).

    .venv/bin/python benches/bench_shared.py [--quick] [--threads K] [--replicas R] [--only S]
        [--store URL]

1. Agent sessions over R replicas, round robin with no affinity (turn k of session s goes to
   replica (s + k) mod R: every turn lands on another replica than the one before), each
   replica an ``Engine`` in this process with a pool of C pages: without a shared tier, with
   one, and one engine whose pool holds R x C pages serving every request. Hit rate (prompt
   tokens found cached / prompt tokens; goal: the shared tier keeps >= 0.95x the single big
   cache's) and time to first token (mean and p90, one output token). A turn's prompt is the
   whole session so far: a shared system prompt, the session's own context, then per turn the
   reply and a tool's output. Between rounds of turns every replica's writes are flushed: an
   agent's tool runs for seconds, far longer than a write takes. The model is a random one
   (Llama-shaped, 4 layers, hidden 256, float32, CPU): what counts here is which tokens are
   computed, not what they mean.
2. A fetch against recompute, per context length and page size: the time to first token of a
   request whose context another replica computed and put in the store (fetched, installed, 8
   new tokens computed) against the same request computed from scratch; where the fetch
   starts to win. SmolLM2-135M (float32, CPU) when installed and not ``--quick``, else the
   random model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Store:
    """A ``redis-server`` on a free loopback port in ``directory``, persistence off."""

    def __init__(self, exe: str, directory: Path) -> None:
        import redis

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(directory)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis.from_url(self.url, socket_timeout=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def flush(self) -> None:
        self.client.flushall()

    def used_mb(self) -> float | None:
        return float(self.client.info("memory")["used_memory"]) / 1e6

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


#: The secret the replicas share on a store that is not local (a Mooncake store always).
KEY = b"bench_shared's secret, 32 bytes."


def is_local(url: str) -> bool:
    from radixkv.kv.tiers.store import is_local as local

    return local(url)


class GivenStore:
    """A store the caller runs (``--store URL``): nothing is started, flushed or measured."""

    def __init__(self, url: str) -> None:
        self.url = url

    def flush(self) -> None:
        pass

    def used_mb(self) -> float | None:
        return None

    def stop(self) -> None:
        pass


def random_model():
    from radixkv.models import CausalLM, ModelConfig

    cfg = ModelConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
    )
    return CausalLM.random(cfg, seed=0)


def make_engine(model, pages: int, page_size: int, url: str | None):
    """An engine over a fresh ``RadixCache`` of ``pages`` pages, on the store ``url`` if any."""
    import radixkv
    from radixkv.kv.kv_cache import KVCache
    from radixkv.kv.tiers.fingerprint import model_fingerprint

    layers, kv_heads, head_dim = model.kv_shape
    kv = KVCache(
        radixkv.RadixCache(pages, page_size),
        layers,
        kv_heads,
        head_dim,
        fingerprint=model_fingerprint(model) if url else None,
        shared_store=url,
        shared_store_key=None if url is None or is_local(url) else KEY,
    )
    return radixkv.Engine(model, kv)


def ttft(engine, prompt: np.ndarray) -> tuple[float, int, list[int]]:
    """``(seconds, cached tokens, output)`` of one request of one output token."""
    t = time.perf_counter()
    (res,) = engine.run([engine.submit(prompt, max_new_tokens=1, stop=())], release=True)
    return time.perf_counter() - t, res.cached_tokens, res.output


def warm(model, page: int) -> None:
    """One request on a throwaway engine: the first call's one-time costs are not timed."""
    e = make_engine(model, 64, page, None)
    ttft(e, np.arange(300, dtype=np.uint32) % model.config.vocab_size)


# ---- 1. agent sessions over replicas ---------------------------------------------------------


def sessions(args, store: Store | GivenStore) -> None:
    model = random_model()
    vocab = model.config.vocab_size
    r = args.replicas
    n_sessions, n_turns = (6, 3) if args.quick else (12, 4)
    system, context, tool, page = 256, 384, 64, 16
    # One replica's pool holds about two sessions' contexts; R of them hold 2R.
    per_replica = 2 * (system + context + n_turns * (tool + 1)) // page
    rng = np.random.default_rng(0)
    sys_tokens = rng.integers(0, vocab, system).astype(np.uint32)
    ctx = [rng.integers(0, vocab, context).astype(np.uint32) for _ in range(n_sessions)]
    tools = [
        [rng.integers(0, vocab, tool).astype(np.uint32) for _ in range(n_turns)]
        for _ in range(n_sessions)
    ]
    print(
        f"== 1. {n_sessions} agent sessions x {n_turns} turns, round robin over {r} replicas "
        f"of {per_replica} pages (page {page}) each; system prompt {system}, context {context}, "
        f"tool output {tool} tokens a turn ({args.threads} threads)"
    )
    print(f"{'setup':<34}{'hit rate':>9}{'x single':>10}{'TTFT mean':>11}{'p90':>8}")
    results = {}
    warm(model, page)
    big = f"1 cache of {r} x {per_replica} pages"
    for name, replicas, pages, shared in (
        (big, 1, r * per_replica, False),
        (f"{r} replicas, no shared tier", r, per_replica, False),
        (f"{r} replicas, shared tier", r, per_replica, True),
    ):
        store.flush()
        engines = [
            make_engine(model, pages, page, store.url if shared else None) for _ in range(replicas)
        ]
        history = [np.concatenate([sys_tokens, c]) for c in ctx]
        cached = total = 0
        times = []
        for turn in range(n_turns):
            for s in range(n_sessions):
                engine = engines[(s + turn) % replicas]
                t, hit, out = ttft(engine, history[s])
                times.append(t)
                cached += hit
                total += len(history[s])
                reply = np.asarray(out, np.uint32)
                history[s] = np.concatenate([history[s], reply, tools[s][turn]])
            for e in engines:  # the tools' pause: every write lands
                if e.kv.shared is not None:
                    e.kv.shared.flush()
        for e in engines:
            e.kv.close()
        rate = cached / total
        results[name] = rate
        times.sort()
        p90 = times[int(0.9 * (len(times) - 1))]
        single = rate / results[big] if results[big] else float("nan")
        print(
            f"{name:<34}{rate:>9.3f}{single:>9.2f}x{np.mean(times) * 1e3:>9.1f}ms"
            f"{p90 * 1e3:>6.1f}ms"
        )
    ratio = results[f"{r} replicas, shared tier"] / results[big] if results[big] else 0.0
    goal = "meets" if ratio >= 0.95 else "misses"
    print(f"the shared tier keeps {ratio:.2f}x the single cache's hit rate ({goal} the 0.95x goal)")


# ---- 2. fetch against recompute --------------------------------------------------------------


def crossover(args, store: Store | GivenStore) -> None:
    import torch

    real = False
    if not args.quick:
        from radixkv.hf._load import smollm2_path

        real = smollm2_path() is not None
    if real:
        import radixkv.hf
        from radixkv.hf._adapter import HFCausalLM

        model = HFCausalLM(radixkv.hf.load("smollm2")[0])
        name = "SmolLM2-135M float32"
    else:
        model = random_model()
        name = "the random model"
    torch.set_num_threads(args.threads)
    lengths = (128, 512) if args.quick else (256, 1024, 2048)
    page_sizes = (16,) if args.quick else (16, 64)
    reps = 1 if args.quick else 3
    vocab = model.config.vocab_size
    rng = np.random.default_rng(1)
    print(
        f"== 2. time to first token: the context fetched from the store (another replica "
        f"computed it) against computed again, + 8 new tokens, 1 output token ({name}, "
        f"{args.threads} threads)"
    )
    print(f"{'page':>5}{'context':>9}{'fetch s':>10}{'recompute s':>13}{'ratio':>8}{'store MB':>9}")
    warm(model, 16)
    for page in page_sizes:
        won = None
        for n in lengths:
            store.flush()
            ctx = rng.integers(0, vocab, n).astype(np.uint32)
            prompt = np.concatenate([ctx, rng.integers(0, vocab, 8).astype(np.uint32)])
            pages = (n + 8) // page + 4
            writer = make_engine(model, pages, page, store.url)
            ttft(writer, ctx)
            writer.kv.shared.flush()
            writer.kv.close()
            mb = store.used_mb()
            fetches, recomputes = [], []
            for _ in range(reps):  # the median of a few: this machine's CPUs are shared
                reader = make_engine(model, pages, page, store.url)
                t, hit, out = ttft(reader, prompt)
                reader.kv.close()
                fetches.append(t)
                cold = make_engine(model, pages, page, None)
                t, _, cold_out = ttft(cold, prompt)
                recomputes.append(t)
                assert hit >= (n - 1) // page * page - page, (hit, n)
                assert out == cold_out, "a fetched context changed the reply"
            fetch, recompute = float(np.median(fetches)), float(np.median(recomputes))
            if won is None and fetch < recompute:
                won = n
            ratio = recompute / fetch
            held = "-" if mb is None else f"{mb:.1f}"
            print(f"{page:>5}{n:>9}{fetch:>10.3f}{recompute:>13.3f}{ratio:>7.1f}x{held:>9}")
        where = f"from {won} tokens on (the shortest tried)" if won else "at no length tried"
        print(f"page {page}: a fetch wins {where}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds' worth (smoke runs)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads for the model")
    ap.add_argument("--replicas", type=int, default=3, choices=(2, 3, 4))
    ap.add_argument("--only", choices=("sessions", "crossover"), help="one section only")
    ap.add_argument(
        "--store",
        metavar="URL",
        help="a store you run instead of the redis-server started here (e.g. mooncake://"
        "127.0.0.1:50051 beside a mooncake_client holder); nothing in it is flushed",
    )
    args = ap.parse_args(argv)
    if args.store is not None:
        return run(args, GivenStore(args.store))
    exe = shutil.which("redis-server")
    if exe is None:
        print("bench_shared: skipped: redis-server is not installed (apt-get install redis-server)")
        return 0
    try:
        import redis  # noqa: F401
    except ImportError:
        print("bench_shared: skipped: redis-py is not installed (pip install 'radixkv[shared]')")
        return 0
    # SIGTERM ends the run through the finally in run(), which stops the store.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as work:
        return run(args, Store(exe, Path(work)))


def run(args, store: Store | GivenStore) -> int:
    import torch

    torch.set_num_threads(args.threads)
    try:
        print(f"store: {store.url}")
        if args.only in (None, "sessions"):
            sessions(args, store)
        if args.only in (None, "crossover"):
            crossover(args, store)
    finally:
        store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
