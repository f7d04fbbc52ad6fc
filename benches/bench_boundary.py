"""Where the time goes at the PyO3 boundary: the cost of an empty call, of reading tokens from
numpy or a list, admit and finish apart, the agent trace call by call, and allocation as the
pool fills.

    .venv/bin/python benches/bench_boundary.py [--quick] [--clock thread]

With ``--core-from-criterion``, set against the core alone as an earlier ``cargo bench --bench
cache`` measured it (not this run; labelled so). Method and options: ``benches/common.py``,
``benches/README.md``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
from typing import ClassVar

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import time

import numpy as np

import radixkv
from common import BLOCK16, RADIX1, Bench, fmt_ns, publish, stream, table


class BoundaryBench(Bench):
    sections: ClassVar = {"boundary": "boundary"}

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
            core = self.core("admit_finish_2k", f"{k.crit}/hit")
            rows.append([f"{k.label} 2k full hit: admit", fmt_ns(statistics.median(a_ns))])
            rows.append([f"{k.label} 2k full hit: finish", fmt_ns(statistics.median(f_ns))])
            if self.args.core_from_criterion:
                rows.append([f"{k.label} 2k full hit: core (earlier cargo bench)", fmt_ns(core)])
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


if __name__ == "__main__":
    sys.exit(BoundaryBench.main(__doc__))
