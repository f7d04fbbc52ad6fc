"""evict: freeing 64k tokens' worth of pages from a pool full of evictable ones.

    .venv/bin/python benches/bench_evict.py [--quick] [--clock thread] [--no-ref]

Baselines in the same run: allocating as many pages from a free pool (admitting a 64k-token
miss), the pure-Python reference model. With ``--core-from-criterion``, also the core alone as an
earlier ``cargo bench --bench cache`` measured it (not this run; labelled so). Method and options:
``benches/common.py``, ``benches/README.md``.
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
    publish,
    stream,
    table,
)


class EvictBench(Bench):
    sections: ClassVar = {"evict": "evict", "events": "events"}

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
            core = self.core("evict_64k", f"{k.crit}/evict")
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
            self.hide,
        )

    def events(self) -> None:
        """With KV events on, an eviction records the block key of every page it drops: each
        radix edge keeps its pages' keys, so that costs a copy per page, not a re-hash of the
        whole path (which was 32,768 hashes for one page of a 32k-token leaf at page size 1)."""
        print("== evict one page of a 32k-token leaf, KV events off and on (RadixCache P=1)")
        tokens = stream(23, 0, 1 << 15)
        rows = []
        times = {}
        for on in (False, True):

            def leaf(on=on):
                c = RADIX1.make(len(tokens) + 16)
                c.record_events(on)
                publish(c, tokens)
                c.drain_events()
                return c

            times[on] = self.timer.batched(leaf, lambda c: c.evict(1))
            self.results[f"evict_1_of_32k_leaf/events_{'on' if on else 'off'}"] = {"ns": times[on]}
            rows.append(["on" if on else "off", fmt_ns(times[on])])
        rows.append(["on / off", fmt_x(div(times[True], times[False]))])
        table(["events", "evict 1 page"], rows, self.hide)

    def summary(self) -> None:
        targets = Targets()
        for k in (RADIX1, BLOCK16):
            x = self.results.get(f"evict_64k/{k.crit}")
            if x:
                targets.row(
                    f"evict 64k tokens, {k.label}", x, 1e6, x["alloc_free_ns"], "of alloc 64k free"
                )
        targets.print()


if __name__ == "__main__":
    sys.exit(EvictBench.main(__doc__))
