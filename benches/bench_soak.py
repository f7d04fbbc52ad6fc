"""Soak: a long multi-turn agent workload under eviction pressure; does memory stay flat?

    .venv/bin/python benches/bench_soak.py [--quick] [--ops N] [--kind radix1,block16]

Each cache (``RadixCache(P=1)``, ``BlockCache(P=16)``) runs ``--ops`` cache operations (default
10**6; ``--quick``: 2*10**4) of an agent workload: many tenants (a namespace and a system prompt
each), sessions that grow turn by turn (the whole history resent, a user message and a reply
appended), sub-agents branching off a turn's prompt (``fork``, then a task and a reply of their
own), sessions with a private namespace of their own, and turns that end by ``abort`` or by
dropping the open request (garbage-collected, which aborts it). Up to 16 turns are in flight at
once, their operations interleaved. The pool holds a small fraction of the working set, so
nearly every admission evicts; a turn the pool cannot supply (``OutOfPages``) is aborted.

An *operation* is one cache call (``admit``, ``extend``, ``commit``, ``fork``, ``finish``,
``abort``) or one dropped request. At ~10 evenly spaced points it prints the operations done,
the process's resident memory, ``cache.metadata_bytes``, ``used_pages`` and the operations per
second since the previous point; at the end, the ratio of the last interval's RSS and
metadata to the first one's (flat memory is ~1.0), and ``cache.check()`` must pass.

This is not a timed comparison: the operations per second are there to show the rate does not
decay as the run goes on (same-run first/last ratio), not as a figure to compare across machines.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

import radixkv
from common import BLOCK16, RADIX1, Kind, pin_one_core

VOCAB = 1 << 17
TENANTS = 200
SYSTEM_TOKENS = 512
MAX_HISTORY = 4096  # a session ends once its history passes this many tokens
IN_FLIGHT = 16  # turns open at once
WORKING_SET_SESSIONS = 256  # live sessions; their histories are the working set
POOL_TOKENS = 65_536  # the pool: a small fraction of what the live sessions hold


def rss_bytes() -> tuple[int, str]:
    """The process's resident memory now, from ``/proc/self/statm`` where there is one; else
    the peak resident size from ``resource`` (a bound, not the current value), else 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), "rss"
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (peak if sys.platform == "darwin" else peak * 1024), "peak rss"
    except (ImportError, OSError):
        return 0, "rss n/a"


@dataclass
class Session:
    """One conversation: its namespace and the tokens it has sent and received so far."""

    namespace: str
    history: np.ndarray
    turns: int = 0


@dataclass
class Workload:
    """The generator of turns: each turn is a generator that makes one cache call per step."""

    cache: radixkv.Cache
    rng: random.Random
    nprng: np.random.Generator
    systems: list[np.ndarray] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    next_private: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.systems = [self.tokens(SYSTEM_TOKENS) for _ in range(TENANTS)]
        self.sessions = [self.new_session() for _ in range(WORKING_SET_SESSIONS)]

    def tokens(self, n: int) -> np.ndarray:
        return self.nprng.integers(0, VOCAB, n, dtype=np.uint32)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def new_session(self) -> Session:
        tenant = self.rng.randrange(TENANTS)
        if self.rng.random() < 0.1:  # a private namespace of its own, never seen again
            self.next_private += 1
            ns = f"private-{self.next_private}"
        else:
            ns = f"tenant-{tenant}"
        return Session(ns, self.systems[tenant].copy())

    def turn(self) -> Iterator[None]:
        """One turn of a random live session: admit the history and a new user message, commit
        it, maybe branch sub-agents off it, extend by the reply, commit, and end the request
        (finish; or abort, or drop, now and then). Yields after every cache call."""
        cache, rng = self.cache, self.rng
        k = rng.randrange(len(self.sessions))
        s = self.sessions[k]
        prompt = np.concatenate([s.history, self.tokens(rng.randint(32, 128))])
        reply = self.tokens(rng.randint(16, 96))
        try:
            req = cache.admit(prompt, s.namespace)
        except radixkv.OutOfPages:
            self.count("admit out of pages")
            yield
            return
        yield
        open_reqs = [req]
        try:
            cache.commit(req, len(prompt))
            yield
            if rng.random() < 0.15:  # sub-agents: forks of the prompt, each with its own task
                for _ in range(rng.randint(2, 4)):
                    sub = cache.fork(req)
                    open_reqs.append(sub)
                    yield
                    task = self.tokens(rng.randint(16, 64))
                    cache.extend(sub, task)
                    yield
                    cache.commit(sub, sub.num_tokens)
                    yield
                    self.close(sub)
                    open_reqs.remove(sub)
                    yield
            cache.extend(req, reply)
            yield
            cache.commit(req, len(prompt) + len(reply))
            yield
            ended = self.close(req)
            open_reqs.clear()
            yield
        except radixkv.OutOfPages:
            self.count("extend out of pages")
            for r in open_reqs:
                cache.abort(r)
            self.count("abort")
            yield
            return
        if ended == "finish":
            s.history = np.concatenate([prompt, reply])
            s.turns += 1
            if len(s.history) > MAX_HISTORY:  # the session is over: a new one takes its place
                self.sessions[k] = self.new_session()
                self.count("session")

    def close(self, req: radixkv.Request) -> str:
        """Ends ``req``: finish (mostly), abort, or drop the last reference (the cache aborts
        a request garbage-collected while open)."""
        u = self.rng.random()
        how = "finish" if u < 0.9 else "abort" if u < 0.95 else "drop"
        if how == "finish":
            self.cache.finish(req)
        elif how == "abort":
            self.cache.abort(req)
        self.count(how)
        return how


def soak(kind: Kind, ops: int, seed: int, intervals: int) -> dict[str, float]:
    """Runs ``ops`` operations on a fresh cache of ``kind``; prints the intervals; returns the
    end ratios."""
    pages = POOL_TOKENS // kind.p
    cache = kind.make(pages)
    wl = Workload(cache, random.Random(seed), np.random.default_rng(seed))
    working = WORKING_SET_SESSIONS * MAX_HISTORY // 2
    print(
        f"== {kind.label}: {pages:,} pages ({POOL_TOKENS:,} tokens); working set ~{working:,} "
        f"tokens ({WORKING_SET_SESSIONS} live sessions, {TENANTS} tenants), {ops:,} operations"
    )
    header = f"{'ops':>10} {'rss MiB':>9} {'metadata KiB':>13} {'used pages':>11} {'ops/s':>9}"
    print(header)
    marks = [ops * (i + 1) // intervals for i in range(intervals)]
    rows: list[tuple[int, int, int, int, float]] = []
    flight: list[Iterator[None]] = []
    done = 0
    rng = wl.rng
    t_prev, ops_prev = time.perf_counter(), 0
    rss_kind = "rss"
    for mark in marks:
        while done < mark:
            while len(flight) < IN_FLIGHT:
                flight.append(wl.turn())
            i = rng.randrange(len(flight))
            try:
                next(flight[i])
                done += 1
            except StopIteration:
                flight[i] = flight[-1]
                flight.pop()
        now = time.perf_counter()
        rss, rss_kind = rss_bytes()
        row = (
            done,
            rss,
            cache.metadata_bytes,
            cache.stats.used_pages,
            (done - ops_prev) / max(now - t_prev, 1e-9),
        )
        rows.append(row)
        print(
            f"{row[0]:>10,} {row[1] / 2**20:>9.1f} {row[2] / 1024:>13,.1f} {row[3]:>11,} "
            f"{row[4]:>9,.0f}",
            flush=True,
        )
        t_prev, ops_prev = now, done
    for gen in flight:  # end the turns in flight: their open requests are aborted on close
        gen.close()
    flight.clear()
    gc.collect()
    cache.check()
    stats = cache.stats
    first, last = rows[0], rows[-1]
    ratios = {
        "rss": last[1] / first[1] if first[1] else float("nan"),
        "metadata": last[2] / first[2] if first[2] else float("nan"),
        "ops_per_s": last[4] / first[4] if first[4] else float("nan"),
    }
    print(
        f"last/first interval: {rss_kind} {ratios['rss']:.3f}, metadata_bytes "
        f"{ratios['metadata']:.3f}, ops/s {ratios['ops_per_s']:.3f}; after the run: "
        f"check() passed, used_pages {stats.used_pages}, hit rate {stats.hit_rate:.3f}, "
        f"evicted pages {stats.evicted_pages:,}"
    )
    print("  " + ", ".join(f"{k}: {v:,}" for k, v in sorted(wl.counts.items())))
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="~2*10**4 operations per cache")
    ap.add_argument(
        "--ops",
        type=int,
        default=None,
        help="operations per cache (default 10**6; --quick 2*10**4)",
    )
    ap.add_argument(
        "--kind",
        default="radix1,block16",
        help="caches to soak, comma-separated: radix1, block16 (default both)",
    )
    ap.add_argument("--intervals", type=int, default=10, help="report points (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    args = ap.parse_args(argv)
    ops = args.ops if args.ops is not None else (20_000 if args.quick else 1_000_000)
    if ops < 1 or args.intervals < 1:
        ap.error(f"--ops and --intervals must be >= 1, got {ops} and {args.intervals}")
    kinds = {"radix1": RADIX1, "block16": BLOCK16}
    chosen = [k for k in args.kind.split(",") if k]
    for k in chosen:
        if k not in kinds:
            ap.error(f"unknown --kind {k!r} (choose from {', '.join(kinds)})")
    print(
        f"radixkv {radixkv.__version__}, numpy {np.__version__}, Python "
        f"{sys.version.split()[0]}, {pin_one_core()}"
    )
    # A dropped request is aborted by the cache with a ResourceWarning: expected here.
    warnings.simplefilter("ignore", ResourceWarning)
    for k in chosen:
        t0 = time.perf_counter()
        soak(kinds[k], ops, args.seed, min(args.intervals, ops))
        print(f"({kinds[k].label}: {time.perf_counter() - t0:.1f} s)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
