"""Memory: metadata bytes per cached token once the agent trace has run, every computed token
cached.

    .venv/bin/python benches/bench_metadata.py

A size, not a time: no baseline. Method: ``benches/common.py``, ``benches/README.md``.
"""

from __future__ import annotations

import os
import sys
from typing import ClassVar

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from common import KINDS, Bench, run_agent, table


class MetadataBench(Bench):
    sections: ClassVar = {"metadata": "metadata"}

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

    def summary(self) -> None:
        m = self.results.get("metadata/radix_p1")
        if m:
            ok = m["per_token"] <= 12
            print(
                f"metadata per cached token, RadixCache(P=1): {m['per_token']:.2f} B "
                f"(target <= 12 B): {'PASS' if ok else 'FAIL'}"
            )
            b = self.results.get("metadata/block_p16")
            if b:
                print(
                    f"metadata per cached token, BlockCache(P=16): {b['per_token']:.2f} B "
                    "(no target)"
                )


if __name__ == "__main__":
    sys.exit(MetadataBench.main(__doc__))
