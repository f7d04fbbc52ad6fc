"""What the Python cache benchmarks share: inputs, the timer, tables and the command line.

The cache benchmarks (``bench_admit.py``, ``bench_evict.py``, ``bench_agent.py``,
``bench_metadata.py``, ``bench_mooncake.py``, ``bench_boundary.py``) measure what a Python caller
pays, PyO3 boundary included. Every figure is the median of several repeats of a
``time.perf_counter_ns`` loop (or, with ``--clock thread``, ``time.thread_time_ns``), after a
warm-up, with the garbage collector off and the process pinned to one core when the OS allows.
Each figure is set against baselines measured in the same run:

- ``ref``: the pure-Python reference models (``tests/python/support/reference.py``) doing the
  same work, as a speed-up (``ref / radixkv``). Skipped with a note when the module is missing.
- ``no cache``: the same loop with nothing cached (a miss: every page allocated and freed), or
  with the cache reset before every admission for the traces, as a ratio (``radixkv / no cache``).
- ``core`` (only with ``--core-from-criterion``): the Rust core alone, read from the last
  ``cargo bench --bench cache`` run (``target/criterion``). That run is not this one and may
  have measured another commit: the run says how old the files are and that it cannot tell
  which commit they measured. The gap to ``radixkv`` is the boundary's cost.

The token ids and the agent trace are the ones ``benches/cache.rs`` generates.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from itertools import islice
from pathlib import Path
from typing import Any, ClassVar

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

import radixkv

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT / "benches" / "data" / "mooncake_conversation_trace.jsonl.gz"
MOONCAKE_BLOCK = 512  # tokens per hash id of the trace
CRITERION = ROOT / "target" / "criterion"
REFERENCE = ROOT / "tests" / "python" / "support" / "reference.py"

CLOCKS = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}


def mooncake_records(limit: int) -> Iterator[dict[str, Any]]:
    """The first ``limit`` requests of the gzipped Mooncake trace, as parsed JSON objects."""
    with gzip.open(MOONCAKE, "rt", encoding="utf-8") as f:
        for line in islice((line for line in f if line.strip()), limit):
            yield json.loads(line)


def mooncake_bound(records: list[dict[str, Any]]) -> tuple[float, int, int]:
    """The unbounded-cache bound over ``records`` in order, at 512-token blocks: the fraction
    of prompt tokens in blocks whose prefix of hash ids (the block and every block before it) an
    earlier request had. Returns (bound, prompt tokens, distinct blocks, i.e. distinct prefixes)."""
    trie: dict[tuple[int, int], int] = {}  # (prefix, next hash id) -> the longer prefix
    hit = total = 0
    for r in records:
        node = k = 0  # k: blocks of this request whose prefix was seen before
        for h in r["hash_ids"]:
            child = trie.get((node, h))
            if child is None:  # a new prefix (and so is every longer one)
                child = trie[(node, h)] = len(trie) + 1
            else:
                k += 1
            node = child
        n = r["input_length"]
        hit += min(k * MOONCAKE_BLOCK, n)
        total += n
    return (hit / total if total else 0.0), total, len(trie)


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
        if cache.host_pages:
            cache.drain_copies()  # no tensors here: the log only grows


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
    """Median-of-repeats timing with warm-up and calibration; results in nanoseconds.

    ``clock`` is the clock of every measurement: wall time by default; ``thread`` counts only the
    CPU time of this thread, which leaves out the time other processes hold the core."""

    def __init__(self, quick: bool, clock: str = "wall"):
        self.repeat = 3 if quick else 7
        self.min_ns = 5e6 if quick else 25e6  # each repeat runs at least this long
        self.best = 0.0  # the fastest repeat of the last measurement (the median is returned)
        self.clock = CLOCKS[clock]

    def _median(self, times: Any) -> float:
        times = list(times)
        self.best = min(times)
        return statistics.median(times)

    def _loop(self, fn: Callable[[], Any], number: int) -> int:
        clock = self.clock
        gc.disable()
        try:
            t0 = clock()
            for _ in range(number):
                fn()
            return clock() - t0
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
                t0 = self.clock()
                fn(state)
                return self.clock() - t0
            finally:
                gc.enable()
                del state

        first = once()
        repeat = number or int(max(1, min(self.repeat, budget_s * 1e9 / max(first, 1))))
        return self._median(once() for _ in range(repeat))


# ---------------------------------------------------------------------------------------------
# Formatting


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
    """Median of the last ``cargo bench --bench cache`` for a benchmark, if it ran. That run is
    not this one: use it only through ``Bench.core`` (``--core-from-criterion``), which says so."""
    path = CRITERION / group / bench.replace("/", "_") / "new" / "estimates.json"
    try:
        return json.loads(path.read_text())["median"]["point_estimate"]
    except (OSError, KeyError, ValueError):
        return None


def criterion_provenance() -> str:
    """Where the ``core`` column comes from: the age of the criterion files, and the commit
    checked out now (which they cannot vouch for: criterion records no commit)."""
    files = list(CRITERION.glob("*/*/new/estimates.json"))
    if not files:
        return "no cargo bench results under target/criterion: the 'core' column is n/a"
    newest, oldest = (f(p.stat().st_mtime for p in files) for f in (max, min))
    age = time.time() - newest

    def ago(t: float) -> str:
        t = time.time() - t
        return f"{t / 3600:.1f} h" if t >= 3600 else f"{t / 60:.0f} min"

    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = "unknown"
    return (
        f"the 'core' column is NOT measured in this run: it is read from an earlier cargo bench "
        f"(target/criterion, {len(files)} results written {ago(oldest)} to {ago(newest)} ago"
        f"{', older than a day' if age > 86400 else ''}); nothing records which commit they "
        f"measured, so they may not be of the code checked out now (HEAD {head}, plus any "
        f"uncommitted changes)"
    )


def positive_ints(ap: argparse.ArgumentParser, text: str, flag: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``: a comma-separated option of positive ints (batch sizes,
    context lengths), or the parser's error naming ``flag`` and the value given."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        ap.error(f"{flag} must be positive ints, comma-separated, got {text!r}")
    return values


def at_least_one(ap: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """The parser's error, naming the option and its value, for the first of the int options
    ``names`` (attribute names: ``page_size`` is ``--page-size``) below 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def table(headers: list[str], rows: list[list[str]], hide: tuple[str, ...] = ()) -> None:
    """Prints an aligned table; columns whose header is in ``hide`` are left out."""
    keep = [i for i, h in enumerate(headers) if h not in hide]
    headers = [headers[i] for i in keep]
    rows = [[r[i] for i in keep] for r in rows]
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


class Targets:
    """The summary table: each figure against its target, the reference model and a baseline."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def row(
        self,
        what: str,
        x: dict[str, Any],
        target_ns: float,
        base_ns: float | None = None,
        base_what: str = "",
    ) -> None:
        ns, ref_ns = x["ns"], x["ref_ns"]
        ok = ns is not None and ns <= target_ns
        self.rows.append(
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

    def print(self) -> None:
        if not self.rows:
            return
        print("== targets (one core, called from Python with numpy input)")
        headers = ["figure", "median", "best", "target", "verdict"]
        table([*headers, "speed-up vs ref", "vs no-cache baseline"], self.rows)


# ---------------------------------------------------------------------------------------------
# The caches under test, and their reference models


def load_reference() -> Any:
    """``tests/python/support/reference.py``, or None (with a note) when it is missing or does not
    import."""
    path = REFERENCE
    if not path.exists():
        print(f"note: {path.relative_to(ROOT)} not found: the pure-Python baseline is skipped")
        return None
    sys.path.insert(0, str(path.parent))
    try:
        import reference  # type: ignore[import-not-found]
    except Exception as e:  # a half-written module must not stop the benchmark
        print(f"note: {path.relative_to(ROOT)} does not import ({e!r}): pure-Python baseline off")
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
    """One benchmark file: its sections (methods named in ``sections``) share the timer, the
    reference models, the agent trace and ``results`` (every figure, for the summary and
    ``--json``)."""

    #: section name -> method name, in the order they run
    sections: ClassVar[dict[str, str]] = {}

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.timer = Timer(args.quick, args.clock)
        self.results: dict[str, Any] = {}
        #: columns that tables leave out: ``core`` unless ``--core-from-criterion``
        self.hide: tuple[str, ...] = () if args.core_from_criterion else ("core",)

    def core(self, group: str, bench: str) -> float | None:
        """The core's figure from an earlier ``cargo bench`` (``--core-from-criterion``), or
        None: this run did not measure it."""
        return criterion_ns(group, bench) if self.args.core_from_criterion else None

    @classmethod
    def add_args(cls, ap: argparse.ArgumentParser) -> None:
        """Options of this benchmark beyond the common ones."""

    @cached_property
    def ref(self) -> Any:
        return None if self.args.no_ref else load_reference()

    @cached_property
    def trace(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return agent_trace()

    @cached_property
    def unique(self) -> int:
        return agent_unique_tokens(self.trace)

    def try_ref(self, what: str, fn: Callable[[], float | None]) -> float | None:
        """A reference-model figure, or None (with a note) when the model fails or is absent."""
        if self.ref is None:
            return None
        try:
            return fn()
        except Exception as e:
            print(f"note: reference model failed on {what}: {e!r}")
            return None

    def summary(self) -> None:
        """Printed after the sections: the figures against their targets."""

    @classmethod
    def main(cls, doc: str | None, argv: list[str] | None = None) -> int:
        ap = argparse.ArgumentParser(
            description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        ap.add_argument("--quick", action="store_true", help="fewer repeats, skip the slow parts")
        ap.add_argument(
            "--no-ref",
            action="store_true",
            help="skip the pure-Python reference baseline (where the benchmark has one)",
        )
        if len(cls.sections) > 1:
            ap.add_argument(
                "--only",
                default="",
                help=f"comma-separated sections: {','.join(cls.sections)}",
            )
        ap.add_argument("--json", type=Path, help="also write every figure to this file")
        ap.add_argument(
            "--core-from-criterion",
            action="store_true",
            help="add a 'core' column (the Rust core alone) read from an earlier cargo bench "
            "(target/criterion): not measured in this run, and of whatever commit that run built",
        )
        ap.add_argument(
            "--clock",
            choices=tuple(CLOCKS),
            default="wall",
            help="wall: time.perf_counter_ns (default); thread: time.thread_time_ns, CPU time of "
            "this thread only (steadier on a shared machine)",
        )
        cls.add_args(ap)
        args = ap.parse_args(argv)
        print(
            f"radixkv {radixkv.__version__}, numpy {np.__version__}, "
            f"Python {sys.version.split()[0]}, {pin_one_core()}, "
            f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs, {args.clock} clock"
        )
        if args.core_from_criterion:
            print(f"note: {criterion_provenance()}")
        b = cls(args)
        chosen = [s for s in getattr(args, "only", "").split(",") if s] or list(cls.sections)
        for s in chosen:
            if s not in cls.sections:
                ap.error(f"unknown section {s!r} (sections: {','.join(cls.sections)})")
        for s in chosen:
            t0 = time.perf_counter()
            getattr(b, cls.sections[s])()
            print(f"({s}: {time.perf_counter() - t0:.1f} s)\n")
        b.summary()
        if args.json:
            args.json.write_text(json.dumps(b.results, indent=1))
        return 0


def pin_one_core() -> str:
    try:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[-1]})
        return f"pinned to CPU {cpus[-1]} (of {len(cpus)})"
    except (AttributeError, OSError) as e:
        return f"not pinned ({e.__class__.__name__})"
