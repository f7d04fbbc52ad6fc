"""The agent trace: 1,000 requests, 100 sessions x 10 turns over a shared 1,024-token system
prompt, each request admit, commit, extend, commit, finish.

    .venv/bin/python benches/bench_agent.py [--quick] [--clock thread] [--no-ref]

Baselines in the same run: caching off (the cache reset before every admission), the pure-Python
reference model (skipped with ``--quick``). With ``--core-from-criterion``, also the core alone as
an earlier ``cargo bench --bench cache`` measured it (not this run; labelled so). Method and
options: ``benches/common.py``, ``benches/README.md``.
"""

from __future__ import annotations

import os
import sys
from typing import ClassVar

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from common import (
    BLOCK16,
    KINDS,
    RADIX1,
    Bench,
    Targets,
    div,
    fmt_ns,
    fmt_x,
    run_agent,
    table,
)


class AgentBench(Bench):
    sections: ClassVar = {"agent": "agent"}

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
            core = self.core("agent_trace", f"{k.crit}/cached")
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
            self.hide,
        )

    def summary(self) -> None:
        targets = Targets()
        for k in (RADIX1, BLOCK16):
            x = self.results.get(f"agent_trace/{k.crit}")
            if x:
                targets.row(
                    f"agent trace 1,000 req, {k.label}", x, 20e6, x["nocache_ns"], "of caching off"
                )
        targets.print()


if __name__ == "__main__":
    sys.exit(AgentBench.main(__doc__))
