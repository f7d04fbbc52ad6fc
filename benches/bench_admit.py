"""admit + finish of one prompt, the read-only match_prefix, and block_hashes: the cost of a
request's admission, from a full hit to a miss, as a Python caller pays it.

    .venv/bin/python benches/bench_admit.py [--quick] [--clock thread]
        [--only admit,pages,match,hash]

Baselines in the same run: a miss (the no-cache case), the pure-Python reference model. With
``--core-from-criterion``, also the core alone as an earlier ``cargo bench --bench cache``
measured it (not this run; labelled so). Method and options: ``benches/common.py``,
``benches/README.md``.
"""

from __future__ import annotations

import os
import sys
from typing import ClassVar

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import radixkv
from common import (
    BLOCK16,
    KINDS,
    RADIX1,
    Bench,
    Targets,
    div,
    fmt_ns,
    fmt_x,
    prompts,
    publish,
    stream,
    table,
)


class AdmitBench(Bench):
    sections: ClassVar = {
        "admit": "admit_finish",
        "pages": "admit_pages_finish",
        "match": "match_prefix",
        "hash": "block_hashes",
    }

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
                    core = self.core(f"admit_finish_{n // 1024}k", f"{k.crit}/{case}")
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
                self.hide,
            )

    def admit_pages_finish(self) -> None:
        print(
            "== admit + reading req.pages + finish of a fully cached prompt (what an engine does "
            "per request); req.pages alone against numpy copying an int32 array of its length"
        )
        rows = []
        for n in (2048, 32768):
            toks = prompts(n)["hit"]
            for k in KINDS:
                cache = k.make(4 * n // k.p)
                publish(cache, toks)

                def per_request(c=cache, toks=toks):
                    req = c.admit(toks)
                    req.pages  # noqa: B018 - the read is what is timed
                    c.finish(req)

                t = self.timer.steady(per_request)
                req = cache.admit(toks)
                tp = self.timer.steady(lambda req=req: req.pages)
                table_copy = req.pages
                tc = self.timer.steady(lambda a=table_copy: a.copy())
                cache.finish(req)
                self.results[f"admit_pages_finish/{n}/{k.crit}"] = {
                    "ns": t,
                    "best_ns": None,
                    "ref_ns": None,
                    "pages_ns": tp,
                    "copy_ns": tc,
                }
                rows.append(
                    [
                        f"{k.label} {n // 1024}k",
                        fmt_ns(t),
                        fmt_ns(tp),
                        f"{len(table_copy):,}",
                        fmt_ns(tc),
                        fmt_x(div(tp, tc)),
                    ]
                )
        table(
            ["prompt", "admit+pages+finish", "req.pages", "pages", "numpy copy", "pages / copy"],
            rows,
            self.hide,
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
                    core = self.core(f"match_prefix_{n // 1024}k", f"{k.crit}/{case}")
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
        table(["prompt", "radixkv", "core", "ref (Python)", "speed-up vs ref"], rows, self.hide)

    def block_hashes(self) -> None:
        print("== block_hashes of 2,048 tokens, page_size=16 (128 chained blake3 digests)")
        toks = stream(10, 0, 2048)
        t = self.timer.steady(lambda: radixkv.block_hashes(toks, 16))
        rows = [
            [
                "radixkv.block_hashes",
                fmt_ns(t),
                fmt_ns(self.core("block_hashes_2k", "chained_p16")),
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
                    fmt_ns(self.core("block_hashes_2k", "blake3_once")),
                    fmt_x(div(tb, t)),
                ]
            )
        except ImportError:
            tb = None
        self.results["block_hashes_2k"] = {"ns": t, "ref_ns": tr, "blake3_once_ns": tb}
        table(["", "time", "core", "vs radixkv"], rows, self.hide)

    def summary(self) -> None:
        targets = Targets()
        for k, target in ((RADIX1, 10e3), (BLOCK16, 25e3)):
            x = self.results.get(f"admit_finish/2048/{k.crit}/hit")
            miss = self.results.get(f"admit_finish/2048/{k.crit}/miss")
            if x and miss:
                targets.row(
                    f"admit+finish 2k full hit, {k.label}", x, target, miss["ns"], "of a miss"
                )
        for n, k, target in (
            (2048, RADIX1, 1.5e3),
            (2048, BLOCK16, 4e3),
            (32768, RADIX1, 15e3),
            (32768, BLOCK16, 60e3),
        ):
            x = self.results.get(f"admit_pages_finish/{n}/{k.crit}")
            if x:
                targets.row(
                    f"admit+pages+finish {n // 1024}k full hit, {k.label}",
                    x,
                    target,
                    x["copy_ns"],
                    "of copying its page table",
                )
        targets.print()


if __name__ == "__main__":
    sys.exit(AdmitBench.main(__doc__))
