"""Hit rate and replay time over the first requests of the Mooncake conversation trace
(``benches/data``), unbounded pool: admit, commit the prompt, finish.

    .venv/bin/python benches/bench_mooncake.py [--quick] [--clock thread] [--mooncake-requests N]
        [--mooncake-radix-page-size P]

Baselines in the same run: caching off (the cache reset before every admission); the hit rate
beside the unbounded-cache bound over the same requests and over the whole trace (both computed
from the trace in this run). Method and options:
``benches/common.py``, ``benches/README.md``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import ClassVar

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

import radixkv
from common import (
    BLOCK16,
    MOONCAKE,
    Bench,
    Kind,
    div,
    fmt_ns,
    fmt_x,
    mooncake_bound,
    mooncake_records,
    table,
)


class MooncakeBench(Bench):
    sections: ClassVar = {"mooncake": "mooncake"}

    @classmethod
    def add_args(cls, ap: argparse.ArgumentParser) -> None:
        ap.add_argument(
            "--mooncake-requests",
            type=int,
            metavar="N",
            help="requests of the Mooncake trace to replay (default 3000; 300 with --quick)",
        )
        ap.add_argument(
            "--mooncake-radix-page-size",
            type=int,
            default=16,
            metavar="P",
            help="page size of the RadixCache in the Mooncake replay (default 16; 1 is slow with "
            "a pool of tens of millions of pages, see README)",
        )

    def mooncake(self) -> None:
        n_req = self.args.mooncake_requests or (300 if self.args.quick else 3000)
        if not MOONCAKE.exists():
            print(f"note: {MOONCAKE} not found: Mooncake replay skipped\n")
            return
        everything = list(mooncake_records(1 << 62))
        reqs = everything[:n_req]
        # The unbounded-cache bounds at 512-token blocks, over these requests and over all.
        bound, total, blocks = mooncake_bound(reqs)
        self.whole = (*mooncake_bound(everything), len(everything))
        print(
            f"== Mooncake conversation trace: first {len(reqs):,} requests, "
            f"{total:,} prompt tokens, {blocks:,} distinct 512-token blocks"
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
        clock = self.timer.clock
        rows = []
        # The first replay in a process also pays for first touching the index's memory (page
        # faults); later ones reuse what the allocator got back. Both are shown: the median of
        # the repeats is the steady cost, the first one the cold start.
        repeats = 1 if self.args.quick else 3
        cold = {}
        for k in kinds:
            pages = -(-blocks * 512 // k.p) + 1024  # every distinct block fits: nothing evicted
            for disabled in (False, True):
                times = []
                for rep in range(repeats):
                    c = k.make(pages)
                    spent = 0
                    desc = f"{k.label}{' caching off' if disabled else ''} {rep + 1}/{repeats}"
                    for r in tqdm(reqs, desc=desc, unit="req", leave=False, disable=None):
                        toks = expand(r)
                        gc.disable()
                        t0 = clock()
                        if disabled:
                            c.reset()
                        req = c.admit(toks)
                        c.commit(req, len(toks))
                        c.finish(req)
                        spent += clock() - t0
                        gc.enable()
                    times.append(spent)
                    if not disabled:
                        hit = c.stats.hit_rate
                    del c
                if disabled:
                    off = sorted(times)[len(times) // 2]
                    continue
                cold[k.label] = times[0]
                on = sorted(times)[len(times) // 2]
            self.results[f"mooncake/{k.crit}"] = {
                "ns": on,
                "nocache_ns": off,
                "hit_rate": hit,
                "bound": bound,
                "requests": len(reqs),
                "cold_ns": cold[k.label],
            }
            rows.append(
                [
                    k.label,
                    f"{100 * hit:.1f}%",
                    f"{100 * bound:.1f}%",
                    fmt_ns(on),
                    fmt_ns(cold[k.label]),
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
                "first replay",
                "per request",
                "caching off",
                "vs caching off",
            ],
            rows,
        )
        whole, whole_tokens, _, n_all = self.whole
        print(
            f"bound over the whole trace ({n_all:,} requests, {whole_tokens:,} prompt tokens), "
            f"computed in this run: {100 * whole:.2f}%; the first requests hit less because the "
            f"cache starts cold.\n"
        )

    def summary(self) -> None:
        for key, x in self.results.items():
            print(
                f"Mooncake, first {x['requests']:,} requests, {key.split('/')[1]}: hit rate "
                f"{100 * x['hit_rate']:.1f}% (bound on these {100 * x['bound']:.1f}%, "
                f"whole trace {100 * self.whole[0]:.2f}%), {fmt_ns(x['ns'])}, "
                f"{fmt_x(div(x['ns'], x['nocache_ns']))} of caching off"
            )


if __name__ == "__main__":
    sys.exit(MooncakeBench.main(__doc__))
