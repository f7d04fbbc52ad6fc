"""Python-side benchmark of radixkv: what a caller pays, PyO3 boundary included.

    .venv/bin/python benches/bench_cache.py [--quick] [--mooncake-requests N] [--json PATH]

Every figure is the median of several repeats of a ``time.perf_counter_ns`` loop (or, with
``--clock thread``, ``time.thread_time_ns``), after a warm-up, with the garbage collector off and
the process pinned to one core when the OS allows. Each figure is set against baselines measured
in the same run:

- ``ref``: the pure-Python reference models (``tests/reference.py``) doing the same work, as a
  speed-up (``ref / radixkv``). Skipped with a note when the module is missing.
- ``no cache``: the same loop with nothing cached (a miss: every page allocated and freed), or
  with the cache reset before every admission for the traces, as a ratio (``radixkv / no cache``).
- ``core``: the Rust core alone, read from the last ``cargo bench --bench cache`` run
  (``target/criterion``), when there is one; the gap is the boundary's cost.

The token ids and the agent trace are the ones ``benches/cache.rs`` generates.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

import radixkv

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
MOONCAKE_BOUND = 0.374  # unbounded cache, 512-token blocks, whole trace (traces/README.md)
CRITERION = ROOT / "target" / "criterion"

#: The clock of every measurement: wall time by default; ``--clock thread`` counts only the CPU
#: time of this thread, which leaves out the time other processes hold the core.
CLOCK = time.perf_counter_ns

# ---------------------------------------------------------------------------------------------
# Deterministic inputs (mirrors benches/cache.rs)

VOCAB = 1 << 17
MASK = (1 << 64) - 1


def mix64_int(x: int) -> int:
    """splitmix64's finalizer on one Python int."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (numpy's uint64 arithmetic wraps)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream(k: int, start: int, n: int) -> np.ndarray:
    """Tokens ``start .. start + n`` of stream ``k``, uint32: ``mix64(k << 32 | i) % VOCAB``."""
    i = np.arange(start, start + n, dtype=np.uint64) | np.uint64(k << 32)
    return (mix64(i) % np.uint64(VOCAB)).astype(np.uint32)


SYSTEM_TOKENS, SESSIONS, TURNS = 1024, 100, 10


def agent_trace() -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, output) of each of the 1,000 requests: 100 sessions x 10 turns over a shared
    1,024-token system prompt. A turn's prompt is the session so far plus a new user message
    (64-256 tokens); it then generates 64-512 tokens. Sessions interleave turn by turn."""
    history = [[stream(1, 0, SYSTEM_TOKENS)] for _ in range(SESSIONS)]
    nxt = 0
    out = []
    for t in range(TURNS):
        for s in range(SESSIONS):
            j = s * TURNS + t
            user = 64 + mix64_int(3 << 32 | 2 * j) % 193
            gen = 64 + mix64_int(3 << 32 | (2 * j + 1)) % 449
            history[s].append(stream(2, nxt, user))
            nxt += user
            output = stream(2, nxt, gen)
            nxt += gen
            out.append((np.concatenate(history[s]), output))
            history[s].append(output)
    return out


def agent_unique_tokens(trace: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Tokens the trace computes in all, each once (what an unbounded cache ends up holding)."""
    finals = sum(len(p) + len(o) for p, o in trace[-SESSIONS:])
    return finals - (SESSIONS - 1) * SYSTEM_TOKENS


def run_agent(cache: Any, trace: list, disabled: bool = False) -> None:
    """admit, commit the prompt, extend with the output, commit, finish; with ``disabled`` the
    cache is reset before every admission (caching off)."""
    for prompt, output in trace:
        if disabled:
            cache.reset()
        n = len(prompt)
        req = cache.admit(prompt)
        cache.commit(req, n)
        cache.extend(req, output)
        cache.commit(req, n + len(output))
        cache.finish(req)


def publish(cache: Any, tokens: np.ndarray) -> None:
    """Admits ``tokens``, computes them all and finishes: cached from now on."""
    req = cache.admit(tokens)
    cache.commit(req, len(tokens))
    cache.finish(req)


def prompts(n: int) -> dict[str, np.ndarray]:
    """``hit`` is cached, ``half`` shares its first half with it, ``miss`` shares nothing."""
    hit, miss = stream(10, 0, n), stream(11, 0, n)
    return {"hit": hit, "half": np.concatenate([hit[: n // 2], miss[n // 2 :]]), "miss": miss}


# ---------------------------------------------------------------------------------------------
# Timing


class Timer:
    """Median-of-repeats timing with warm-up and calibration; results in nanoseconds."""

    def __init__(self, quick: bool):
        self.repeat = 3 if quick else 7
        self.min_ns = 5e6 if quick else 25e6  # each repeat runs at least this long
        self.best = 0.0  # the fastest repeat of the last measurement (the median is returned)

    def _median(self, times: Any) -> float:
        times = list(times)
        self.best = min(times)
        return statistics.median(times)

    @staticmethod
    def _loop(fn: Callable[[], Any], number: int) -> int:
        gc.disable()
        try:
            t0 = CLOCK()
            for _ in range(number):
                fn()
            return CLOCK() - t0
        finally:
            gc.enable()

    def steady(self, fn: Callable[[], Any], budget_s: float = 10.0) -> float:
        """Time per call of ``fn``, which leaves its state as it found it."""
        first = self._loop(fn, 1)  # warm-up, and a first estimate
        if first > self.min_ns:
            repeat = int(max(1, min(self.repeat, budget_s * 1e9 / first)))
            return self._median(self._loop(fn, 1) for _ in range(repeat))
        number = 1
        while True:
            t = self._loop(fn, number)
            if t >= self.min_ns / 4:
                break
            number *= 4
        number = max(1, int(number * self.min_ns / max(t, 1)))
        return self._median(self._loop(fn, number) / number for _ in range(self.repeat))

    def batched(
        self,
        setup: Callable[[], Any],
        fn: Callable[[Any], Any],
        budget_s: float = 10.0,
        number: int | None = None,
    ) -> float:
        """Time of ``fn(setup())``, a fresh state each call; only ``fn`` is timed."""

        def once() -> int:
            state = setup()
            gc.disable()
            try:
                t0 = CLOCK()
                fn(state)
                return CLOCK() - t0
            finally:
                gc.enable()
                del state

        first = once()
        repeat = number or int(max(1, min(self.repeat, budget_s * 1e9 / max(first, 1))))
        return self._median(once() for _ in range(repeat))


def fmt_ns(ns: float | None) -> str:
    if ns is None:
        return "n/a"
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.2f} us"
    if ns < 1e9:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}x"


def div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def criterion_ns(group: str, bench: str) -> float | None:
    """Median of the last ``cargo bench --bench cache`` for a benchmark, if it ran."""
    path = CRITERION / group / bench.replace("/", "_") / "new" / "estimates.json"
    try:
        return json.loads(path.read_text())["median"]["point_estimate"]
    except (OSError, KeyError, ValueError):
        return None


def table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print(line)
    for r in rows:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
            )
        )
    print()


# ---------------------------------------------------------------------------------------------
# The caches under test, and their reference models


def load_reference() -> Any:
    """``tests/reference.py``, or None (with a note) when it is missing or does not import."""
    path = ROOT / "tests" / "reference.py"
    if not path.exists():
        print(f"note: {path.relative_to(ROOT)} not found: the pure-Python baseline is skipped")
        return None
    sys.path.insert(0, str(path.parent))
    try:
        import reference  # type: ignore[import-not-found]
    except Exception as e:  # a half-written module must not stop the benchmark
        print(f"note: tests/reference.py does not import ({e!r}): pure-Python baseline skipped")
        return None
    finally:
        sys.path.pop(0)
    return reference


class Kind:
    """One cache configuration: a label, the criterion name, page size, and both constructors."""

    def __init__(self, label: str, crit: str, page_size: int, make: Callable, ref_name: str):
        self.label, self.crit, self.p, self.make = label, crit, page_size, make
        self.ref_name = ref_name

    def ref(self, ref_mod: Any, num_pages: int) -> Any:
        return getattr(ref_mod, self.ref_name)(num_pages, self.p)


KINDS = [
    Kind("RadixCache(P=1)", "radix_p1", 1, lambda n: radixkv.RadixCache(n, 1), "RefRadixCache"),
    Kind("RadixCache(P=16)", "radix_p16", 16, lambda n: radixkv.RadixCache(n, 16), "RefRadixCache"),
    Kind("BlockCache(P=16)", "block_p16", 16, lambda n: radixkv.BlockCache(n, 16), "RefBlockCache"),
]
RADIX1, BLOCK16 = KINDS[0], KINDS[2]


class Bench:
    """Runs the sections, prints their tables, and keeps every figure for the summary."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.timer = Timer(args.quick)
        self.ref = None if args.no_ref else load_reference()
        self.results: dict[str, Any] = {}
        self.trace = agent_trace()
        self.unique = agent_unique_tokens(self.trace)

    def try_ref(self, what: str, fn: Callable[[], float | None]) -> float | None:
        """A reference-model figure, or None (with a note) when the model fails or is absent."""
        if self.ref is None:
            return None
        try:
            return fn()
        except Exception as e:
            print(f"note: reference model failed on {what}: {e!r}")
            return None

    # -- admit + finish, match_prefix ---------------------------------------------------------

    def admit_finish(self) -> None:
        print("== admit + finish of one prompt (nothing committed: the cache is left as found)")
        for n in (2048, 32768):
            ps = prompts(n)
            rows = []
            for k in KINDS:
                cache = k.make(4 * n // k.p)
                publish(cache, ps["hit"])
                ref = self.try_ref(
                    f"{k.label} setup", lambda k=k, n=n: k.ref(self.ref, 4 * n // k.p)
                )
                if ref is not None:
                    publish(ref, ps["hit"])
                t, best, tr = {}, {}, {}
                for case, toks in ps.items():
                    t[case] = self.timer.steady(lambda c=cache, toks=toks: c.finish(c.admit(toks)))
                    best[case] = self.timer.best
                    if ref is not None:
                        tr[case] = self.try_ref(
                            f"admit+finish {k.label}",
                            lambda c=ref, toks=toks: self.timer.steady(
                                lambda: c.finish(c.admit(toks)), 5.0
                            ),
                        )
                for case in ps:
                    core = criterion_ns(f"admit_finish_{n // 1024}k", f"{k.crit}/{case}")
                    self.results[f"admit_finish/{n}/{k.crit}/{case}"] = {
                        "ns": t[case],
                        "best_ns": best[case],
                        "ref_ns": tr.get(case),
                        "core_ns": core,
                    }
                    rows.append(
                        [
                            f"{k.label} {n // 1024}k {case}",
                            fmt_ns(t[case]),
                            fmt_ns(core),
                            fmt_x(div(t[case], t["miss"])),
                            fmt_ns(tr.get(case)),
                            fmt_x(div(tr.get(case), t[case])),
                        ]
                    )
            table(
                ["prompt", "radixkv", "core", "vs no cache", "ref (Python)", "speed-up vs ref"],
                rows,
            )

    def match_prefix(self) -> None:
        print("== match_prefix (read-only probe)")
        rows = []
        for n in (2048, 32768):
            ps = prompts(n)
            for k in KINDS:
                cache = k.make(4 * n // k.p)
                publish(cache, ps["hit"])
                ref = self.try_ref("setup", lambda k=k, n=n: k.ref(self.ref, 4 * n // k.p))
                if ref is not None:
                    publish(ref, ps["hit"])
                t = {}
                for case, toks in ps.items():
                    t[case] = self.timer.steady(lambda c=cache, toks=toks: c.match_prefix(toks))
                    tr = (
                        self.try_ref(
                            "match_prefix",
                            lambda c=ref, toks=toks: self.timer.steady(
                                lambda: c.match_prefix(toks), 5.0
                            ),
                        )
                        if ref is not None
                        else None
                    )
                    core = criterion_ns(f"match_prefix_{n // 1024}k", f"{k.crit}/{case}")
                    self.results[f"match_prefix/{n}/{k.crit}/{case}"] = {
                        "ns": t[case],
                        "ref_ns": tr,
                        "core_ns": core,
                    }
                    rows.append(
                        [
                            f"{k.label} {n // 1024}k {case}",
                            fmt_ns(t[case]),
                            fmt_ns(core),
                            fmt_ns(tr),
                            fmt_x(div(tr, t[case])),
                        ]
                    )
        table(["prompt", "radixkv", "core", "ref (Python)", "speed-up vs ref"], rows)

    # -- eviction, hashes ---------------------------------------------------------------------

    def evict(self) -> None:
        print(
            "== evict 64k tokens from a pool full of evictable pages "
            "(64 cached 1,024-token prompts)"
        )
        tokens = 1 << 16
        fills = [stream(20 + k, 0, 1024) for k in range(64)]
        big = stream(19, 0, tokens)
        rows = []
        for k in KINDS:
            pages = tokens // k.p

            def full(make=k.make, pages=pages):
                c = make(pages)
                for f in fills:
                    publish(c, f)
                return c

            t = self.timer.batched(full, lambda c, pages=pages: c.evict(pages))
            best = self.timer.best
            alloc = self.timer.batched(
                lambda make=k.make, pages=pages: make(pages), lambda c: c.admit(big)
            )

            def ref_full(k=k, pages=pages):
                c = k.ref(self.ref, pages)
                for f in fills:
                    publish(c, f)
                return c

            tr = self.try_ref(
                "evict",
                lambda pages=pages, ref_full=ref_full: self.timer.batched(
                    ref_full, lambda c: c.evict(pages), 5.0, number=1 if self.args.quick else 3
                ),
            )
            core = criterion_ns("evict_64k", f"{k.crit}/evict")
            self.results[f"evict_64k/{k.crit}"] = {
                "ns": t,
                "best_ns": best,
                "ref_ns": tr,
                "core_ns": core,
                "alloc_free_ns": alloc,
            }
            rows.append(
                [
                    k.label,
                    fmt_ns(t),
                    fmt_ns(core),
                    fmt_ns(alloc),
                    fmt_x(div(t, alloc)),
                    fmt_ns(tr),
                    fmt_x(div(tr, t)),
                ]
            )
        table(
            [
                "cache",
                "evict 64k",
                "core",
                "alloc 64k free",
                "evict / alloc",
                "ref (Python)",
                "speed-up vs ref",
            ],
            rows,
        )

    def block_hashes(self) -> None:
        print("== block_hashes of 2,048 tokens, page_size=16 (128 chained blake3 digests)")
        toks = stream(10, 0, 2048)
        t = self.timer.steady(lambda: radixkv.block_hashes(toks, 16))
        rows = [
            [
                "radixkv.block_hashes",
                fmt_ns(t),
                fmt_ns(criterion_ns("block_hashes_2k", "chained_p16")),
                "1x",
            ]
        ]
        ref_fn = getattr(self.ref, "ref_block_hashes", None) if self.ref is not None else None
        tr = None
        if ref_fn is not None:
            if ref_fn(toks, 16) != radixkv.block_hashes(toks, 16):
                print("note: reference block hashes differ from radixkv's!")
            tr = self.timer.steady(lambda: ref_fn(toks, 16))
            rows.append(["reference.ref_block_hashes (Python)", fmt_ns(tr), "", fmt_x(div(tr, t))])
        try:
            import blake3

            data = toks.astype("<u4").tobytes()
            tb = self.timer.steady(lambda: blake3.blake3(data).digest())
            rows.append(
                [
                    "blake3 over the 8 KiB once (Python)",
                    fmt_ns(tb),
                    fmt_ns(criterion_ns("block_hashes_2k", "blake3_once")),
                    fmt_x(div(tb, t)),
                ]
            )
        except ImportError:
            tb = None
        self.results["block_hashes_2k"] = {"ns": t, "ref_ns": tr, "blake3_once_ns": tb}
        table(["", "time", "core", "vs radixkv"], rows)

    # -- traces, metadata ---------------------------------------------------------------------

    def agent(self) -> None:
        total = sum(len(p) for p, _ in self.trace)
        print(
            f"== agent trace: {len(self.trace)} requests (100 sessions x 10 turns), "
            f"{total:,} prompt tokens, {self.unique:,} distinct tokens computed"
        )
        rows = []
        for k in KINDS:
            pages = -(-self.unique // k.p) + 2048
            probe = k.make(pages)
            run_agent(probe, self.trace)
            hit = probe.stats.hit_rate
            t = self.timer.batched(
                lambda make=k.make, pages=pages: make(pages), lambda c: run_agent(c, self.trace)
            )
            best = self.timer.best
            t0 = self.timer.batched(
                lambda make=k.make, pages=pages: make(pages),
                lambda c: run_agent(c, self.trace, True),
            )
            tr = None
            if not self.args.quick:
                tr = self.try_ref(
                    "agent trace",
                    lambda k=k, pages=pages: self.timer.batched(
                        lambda: k.ref(self.ref, pages), lambda c: run_agent(c, self.trace), number=1
                    ),
                )
            core = criterion_ns("agent_trace", f"{k.crit}/cached")
            self.results[f"agent_trace/{k.crit}"] = {
                "ns": t,
                "best_ns": best,
                "nocache_ns": t0,
                "ref_ns": tr,
                "core_ns": core,
                "hit_rate": hit,
            }
            rows.append(
                [
                    k.label,
                    fmt_ns(t),
                    fmt_ns(core),
                    f"{hit:.3f}",
                    fmt_ns(t0),
                    fmt_x(div(t, t0)),
                    fmt_ns(tr),
                    fmt_x(div(tr, t)),
                ]
            )
        if self.args.quick:
            print("note: --quick skips the reference model on the agent trace")
        table(
            [
                "cache",
                "1,000 requests",
                "core",
                "hit rate",
                "caching off",
                "vs caching off",
                "ref (Python)",
                "speed-up vs ref",
            ],
            rows,
        )

    def metadata(self) -> None:
        print("== metadata bytes per cached token (the agent trace, every computed token cached)")
        rows = []
        for k in KINDS:
            # The pool holds exactly what the trace caches (P=1), so the free-page bookkeeping
            # is charged to cached tokens, not to an idle over-provisioned pool.
            pages = self.unique if k.p == 1 else -(-self.unique // k.p) + 2048
            c = k.make(pages)
            run_agent(c, self.trace)
            s = c.stats
            cached = s.evictable_pages * k.p
            per = c.metadata_bytes / cached
            self.results[f"metadata/{k.crit}"] = {
                "bytes": c.metadata_bytes,
                "cached_tokens": cached,
                "per_token": per,
                "num_pages": pages,
            }
            rows.append(
                [k.label, f"{pages:,}", f"{cached:,}", f"{c.metadata_bytes:,}", f"{per:.2f}"]
            )
        table(["cache", "pool pages", "cached tokens", "metadata bytes", "bytes / token"], rows)

    def mooncake(self) -> None:
        n_req = self.args.mooncake_requests
        if not MOONCAKE.exists():
            print(f"note: {MOONCAKE} not found: Mooncake replay skipped\n")
            return
        with MOONCAKE.open() as f:
            reqs = [json.loads(line) for line, _ in zip(f, range(n_req))]
        # The unbounded-cache bound over these requests, at 512-token blocks (as the README's).
        seen: set[int] = set()
        hit_b = total = 0
        for r in reqs:
            ids, n = r["hash_ids"], r["input_length"]
            k = 0
            while k < len(ids) and ids[k] in seen:
                k += 1
            hit_b += min(k * 512, n)
            total += n
            seen.update(ids)
        bound = hit_b / total
        print(
            f"== Mooncake conversation trace: first {len(reqs):,} requests, "
            f"{total:,} prompt tokens, {len(seen):,} distinct 512-token blocks"
        )
        offsets = np.arange(512, dtype=np.uint32)

        def expand(r: dict) -> np.ndarray:
            ids = np.asarray(r["hash_ids"], dtype=np.uint32)
            return (ids[:, None] * np.uint32(512) + offsets).ravel()[: r["input_length"]]

        try:
            from tqdm import tqdm
        except ImportError:  # the bar is a nicety

            def tqdm(it, **_kw):
                return it

        rp = self.args.mooncake_radix_page_size
        kinds = [
            Kind(
                f"RadixCache(P={rp})", f"radix_p{rp}", rp, lambda n: radixkv.RadixCache(n, rp), ""
            ),
            BLOCK16,
        ]
        rows = []
        for k in kinds:
            pages = -(-len(seen) * 512 // k.p) + 1024  # every distinct block fits: nothing evicted
            for disabled in (False, True):
                c = k.make(pages)
                spent = 0
                desc = f"{k.label}{' caching off' if disabled else ''}"
                for r in tqdm(reqs, desc=desc, unit="req", leave=False, disable=None):
                    toks = expand(r)
                    gc.disable()
                    t0 = CLOCK()
                    if disabled:
                        c.reset()
                    req = c.admit(toks)
                    c.commit(req, len(toks))
                    c.finish(req)
                    spent += CLOCK() - t0
                    gc.enable()
                if disabled:
                    off = spent
                    continue
                hit, on = c.stats.hit_rate, spent
            self.results[f"mooncake/{k.crit}"] = {
                "ns": on,
                "nocache_ns": off,
                "hit_rate": hit,
                "bound": bound,
                "requests": len(reqs),
            }
            rows.append(
                [
                    k.label,
                    f"{100 * hit:.1f}%",
                    f"{100 * bound:.1f}%",
                    fmt_ns(on),
                    fmt_ns(on / len(reqs)),
                    fmt_ns(off),
                    fmt_x(div(on, off)),
                ]
            )
        table(
            [
                "cache",
                "hit rate",
                "bound (same reqs)",
                "replay",
                "per request",
                "caching off",
                "vs caching off",
            ],
            rows,
        )
        print(
            f"bound over the whole trace (12,031 requests): {100 * MOONCAKE_BOUND:.1f}%; the first "
            f"requests hit less because the cache starts cold.\n"
        )

    # -- where the time goes ------------------------------------------------------------------

    def boundary(self) -> None:
        print("== where the time goes (RadixCache(P=1) unless said)")
        empty = radixkv.RadixCache(1 << 16, 1)
        one = np.array([5], dtype=np.uint32)
        rows = []
        base = self.timer.steady(lambda: empty.match_prefix(one))
        rows.append(["call overhead: match_prefix of 1 token, empty cache", fmt_ns(base)])
        for n in (2048, 32768):
            toks = stream(10, 0, n)
            t = self.timer.steady(lambda toks=toks: empty.match_prefix(toks))
            rows.append([f"  + reading {n // 1024}k uint32 tokens (numpy)", fmt_ns(t - base)])
        toks = stream(10, 0, 2048)
        for what, obj in [
            ("int64 numpy", toks.astype(np.int64)),
            ("Python list", toks.tolist()),
        ]:
            t = self.timer.steady(lambda obj=obj: empty.match_prefix(obj))
            rows.append([f"  + reading 2k tokens from {what}", fmt_ns(t - base)])
        # admit and finish of a full 2k hit, apart. Call by call, the wall clock: reading the
        # thread clock is a system call, which would outweigh a sub-microsecond call.
        clock = time.perf_counter_ns
        for k in (RADIX1, BLOCK16):
            c = k.make(1 << 13)
            publish(c, toks)
            n, a_ns, f_ns = 2000, [], []
            for _ in range(5):
                a = f = 0
                gc.disable()
                for _ in range(n):
                    t0 = clock()
                    r = c.admit(toks)
                    t1 = clock()
                    c.finish(r)
                    f += clock() - t1
                    a += t1 - t0
                gc.enable()
                a_ns.append(a / n)
                f_ns.append(f / n)
            core = criterion_ns("admit_finish_2k", f"{k.crit}/hit")
            rows.append([f"{k.label} 2k full hit: admit", fmt_ns(statistics.median(a_ns))])
            rows.append([f"{k.label} 2k full hit: finish", fmt_ns(statistics.median(f_ns))])
            rows.append([f"{k.label} 2k full hit: core alone (cargo bench)", fmt_ns(core)])
        # The agent trace call by call: which calls take the time.
        for k in (RADIX1, BLOCK16):
            c = k.make(-(-self.unique // k.p) + 2048)
            spent = dict.fromkeys(("admit", "commit", "extend", "finish"), 0)
            gc.disable()
            for prompt, output in self.trace:
                n = len(prompt)
                t0 = clock()
                req = c.admit(prompt)
                t1 = clock()
                c.commit(req, n)
                t2 = clock()
                c.extend(req, output)
                t3 = clock()
                c.commit(req, n + len(output))
                t4 = clock()
                c.finish(req)
                t5 = clock()
                spent["admit"] += t1 - t0
                spent["commit"] += t2 - t1 + t4 - t3
                spent["extend"] += t3 - t2
                spent["finish"] += t5 - t4
            gc.enable()
            for op, ns in spent.items():
                rows.append([f"agent trace {k.label}: all {op} calls", fmt_ns(ns)])
        # Allocation cost as the pool fills: the free set finds its smallest member by a scan.
        if not self.args.quick:
            miss = stream(11, 0, 2048)
            for fill in (0, 1 << 20, 1 << 22):
                pool = fill + (1 << 16)
                c = radixkv.RadixCache(pool, 1)
                for i in range(fill >> 16):
                    publish(c, stream(30 + i, 0, 1 << 16))
                t = self.timer.steady(lambda c=c: c.finish(c.admit(miss)))
                self.results[f"alloc_scan/{fill}"] = t
                rows.append(
                    [f"2k miss, pool {pool:,} pages with the lowest {fill:,} cached", fmt_ns(t)]
                )
        table(["", "time"], rows)

    # -- summary --------------------------------------------------------------------------------

    def summary(self) -> None:
        r = self.results
        rows = []

        def row(what, x, target_ns, base_ns=None, base_what=""):
            ns, ref_ns = x["ns"], x["ref_ns"]
            ok = ns is not None and ns <= target_ns
            rows.append(
                [
                    what,
                    fmt_ns(ns),
                    fmt_ns(x.get("best_ns")),
                    f"<= {fmt_ns(target_ns)}",
                    "PASS" if ok else f"FAIL ({fmt_x(div(ns, target_ns))} of target)",
                    fmt_x(div(ref_ns, ns)),
                    f"{fmt_x(div(ns, base_ns))} {base_what}".strip() if base_ns else "n/a",
                ]
            )

        for k, target in ((RADIX1, 10e3), (BLOCK16, 25e3)):
            x = r.get(f"admit_finish/2048/{k.crit}/hit")
            miss = r.get(f"admit_finish/2048/{k.crit}/miss")
            if x:
                row(
                    f"admit+finish 2k full hit, {k.label}",
                    x,
                    target,
                    miss["ns"],
                    "of a miss",
                )
        for k in (RADIX1, BLOCK16):
            x = r.get(f"evict_64k/{k.crit}")
            if x:
                row(
                    f"evict 64k tokens, {k.label}",
                    x,
                    1e6,
                    x["alloc_free_ns"],
                    "of alloc 64k free",
                )
        for k in (RADIX1, BLOCK16):
            x = r.get(f"agent_trace/{k.crit}")
            if x:
                row(
                    f"agent trace 1,000 req, {k.label}",
                    x,
                    20e6,
                    x["nocache_ns"],
                    "of caching off",
                )
        if rows:
            print("== targets (one core, called from Python with numpy input)")
            table(
                [
                    "figure",
                    "median",
                    "best",
                    "target",
                    "verdict",
                    "speed-up vs ref",
                    "vs no-cache baseline",
                ],
                rows,
            )
        m = r.get("metadata/radix_p1")
        if m:
            ok = m["per_token"] <= 12
            print(
                f"metadata per cached token, RadixCache(P=1): {m['per_token']:.2f} B "
                f"(target <= 12 B): {'PASS' if ok else 'FAIL'}"
            )
            b = r.get("metadata/block_p16")
            if b:
                print(
                    f"metadata per cached token, BlockCache(P=16): {b['per_token']:.2f} B "
                    "(no target)"
                )
        for key, x in r.items():
            if key.startswith("mooncake/"):
                print(
                    f"Mooncake, first {x['requests']:,} requests, {key.split('/')[1]}: hit rate "
                    f"{100 * x['hit_rate']:.1f}% (bound on these {100 * x['bound']:.1f}%, "
                    f"whole trace {100 * MOONCAKE_BOUND:.1f}%), {fmt_ns(x['ns'])}, "
                    f"{fmt_x(div(x['ns'], x['nocache_ns']))} of caching off"
                )


def pin_one_core() -> str:
    try:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[-1]})
        return f"pinned to CPU {cpus[-1]} (of {len(cpus)})"
    except (AttributeError, OSError) as e:
        return f"not pinned ({e.__class__.__name__})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer repeats, skip the slow parts")
    ap.add_argument(
        "--mooncake-requests",
        type=int,
        default=3000,
        metavar="N",
        help="requests of the Mooncake trace to replay (default 3000)",
    )
    ap.add_argument(
        "--mooncake-radix-page-size",
        type=int,
        default=16,
        metavar="P",
        help="page size of the RadixCache in the Mooncake replay (default 16; 1 is slow with a "
        "pool of tens of millions of pages, see README)",
    )
    ap.add_argument("--no-ref", action="store_true", help="skip the pure-Python reference baseline")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated sections: admit,match,evict,hash,agent,metadata,mooncake,boundary",
    )
    ap.add_argument("--json", type=Path, help="also write every figure to this file")
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall: time.perf_counter_ns (default); thread: time.thread_time_ns, CPU time of "
        "this thread only (steadier on a shared machine)",
    )
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.thread_time_ns if args.clock == "thread" else time.perf_counter_ns
    if args.quick and args.mooncake_requests == 3000:
        args.mooncake_requests = 300
    print(
        f"radixkv {radixkv.__version__}, numpy {np.__version__}, "
        f"Python {sys.version.split()[0]}, {pin_one_core()}, "
        f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs, {args.clock} clock"
    )
    if not any(CRITERION.glob("*/*/new/estimates.json")):
        print("note: no cargo bench results under target/criterion: the 'core' column is n/a")
    b = Bench(args)
    sections = {
        "admit": b.admit_finish,
        "match": b.match_prefix,
        "evict": b.evict,
        "hash": b.block_hashes,
        "agent": b.agent,
        "metadata": b.metadata,
        "mooncake": b.mooncake,
        "boundary": b.boundary,
    }
    chosen = [s for s in args.only.split(",") if s] or list(sections)
    for s in chosen:
        t0 = time.perf_counter()
        sections[s]()
        print(f"({s}: {time.perf_counter() - t0:.1f} s)\n")
    b.summary()
    if args.json:
        args.json.write_text(json.dumps(b.results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
