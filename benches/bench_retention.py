"""Agent-aware retention against today's LRU and against Belady's offline optimum (issue 26):
recomputed prompt tokens and time to first token of agent turns, side by side in one run.

    .venv/bin/python benches/bench_retention.py [--quick] [--sessions N] [--keep-alive S]
        [--mooncake-requests N] [--page-size P]

Two workloads:

- ``agent``: the synthetic agent workload (``radixkv.apps.replay.agent_workload``: sessions of many
  turns over a shared system prompt, heavy-tailed tool pauses, sub-agents, one-shot background
  traffic) with a pool that holds a third of the live sessions' histories.
- ``mooncake``: the first requests of the Mooncake conversation trace (``benches/data``) with a
  pool of a third of the distinct pages they name. The trace has no session ids, so every
  request is retained alike.

Every row serves the requests one at a time in arrival order with the same pool (the model of
``radixkv.apps.replay.belady``), so the rows differ only in what they evict:

- ``LRU (today's cache)``: a ``RadixCache``, ``finish(req)``.
- ``Belady (offline)``: the page used again farthest in the future goes first: no order
  recomputes fewer tokens in this model.
- ``retention``: a ``RadixCache`` whose clock follows the arrivals (``cache.advance(t)`` before
  each admission); a turn that its session follows is finished with ``retain=--keep-alive``
  seconds and an eviction class (lead sessions above sub-agents; last turns and one-shot
  requests plainly). Printed as "not in this build" when ``finish`` takes no ``retain=``.

Times to first token come from a prefill queue over each row's recomputed tokens
(``radixkv.apps.replay.prefill_queue``, 50,000 tokens/s, 131,072-token batches, as
``radixkv replay``),
percentiles over agent turns (lead and sub-agent; every request for Mooncake). "gap closed":
the share of LRU's excess over Belady that a row removes. The LRU model of
``radixkv.apps.replay.belady`` is checked against the real cache in the same run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

import radixkv
from common import MOONCAKE, Bench, table
from radixkv.apps.common.trace import TraceRequest, read_trace
from radixkv.apps.replay.agent_workload import AgentWorkload, live_history_tokens
from radixkv.apps.replay.belady import BoundResult, fits, simulate
from radixkv.apps.replay.block_keys import block_keys
from radixkv.apps.replay.prefill_queue import prefill_ttfts

PREFILL_TPS, TOKEN_BUDGET = 50_000.0, 131_072
#: Eviction classes of the retention row (0 goes first): lead sessions above their sub-agents
#: (the issue: a branch defaults to a lower class than its trunk), both above plain pages.
LEAD_CLASS, SUBAGENT_CLASS = 2, 1
NOT_IN_BUILD = "retention: not in this build"

#: What a retention row passes to ``finish`` for a request: keyword arguments, or None (plain).
Retain = Callable[[TraceRequest], "dict[str, Any] | None"]


def retention_supported() -> bool:
    """Whether this build's ``RadixCache.finish`` takes ``retain=`` (and the cache a clock)."""
    cache = radixkv.RadixCache(4, 1)
    req = cache.admit([1, 2])
    cache.commit(req, 2)
    try:
        cache.finish(req, retain=0.0)
    except TypeError:
        return False
    return hasattr(cache, "advance")


class Served:
    """One row's outcome: cached tokens per request (0 when not served) and what was not."""

    def __init__(self, label: str, n: int) -> None:
        self.label = label
        self.cached = np.zeros(n, dtype=np.int64)
        self.served = np.zeros(n, dtype=bool)
        self.refused = 0  # admissions that raised OutOfPages
        self.note = ""


def serve(
    label: str, reqs: Sequence[TraceRequest], num_pages: int, page_size: int, retain: Retain | None
) -> Served:
    """Today's ``RadixCache`` over ``reqs`` one at a time; with ``retain``, its clock set to
    each arrival and ``finish(req, **retain(r))`` where that gives keywords."""
    cache = radixkv.RadixCache(num_pages, page_size)
    out = Served(label, len(reqs))
    for i, r in enumerate(reqs):
        if not fits(r, num_pages, page_size):
            continue
        if retain is not None:
            cache.advance(r.arrival)
        try:
            req = cache.admit(r.tokens, r.namespace)
        except radixkv.OutOfPages:
            out.refused += 1
            continue
        out.cached[i], out.served[i] = req.num_cached, True
        cache.commit(req, req.num_tokens)
        kwargs = retain(r) if retain is not None else None
        if kwargs:
            cache.finish(req, **kwargs)
        else:
            cache.finish(req)
    cache.check()
    if retain is not None:
        s = cache.stats
        out.note = (
            f"retentions {s.retentions}, forced evictions {s.forced_evictions}, expired "
            f"{s.expired_retentions}"
        )
    return out


def from_bound(label: str, res: BoundResult) -> Served:
    out = Served(label, len(res.served))
    out.cached, out.served = res.cached, res.served
    return out


class RetentionBench(Bench):
    sections: ClassVar = {"agent": "agent", "mooncake": "mooncake"}

    @classmethod
    def add_args(cls, ap: argparse.ArgumentParser) -> None:
        ap.add_argument(
            "--sessions",
            type=int,
            metavar="N",
            help="lead sessions of the agent workload (default 64; 16 with --quick)",
        )
        ap.add_argument(
            "--keep-alive",
            type=float,
            default=60.0,
            metavar="S",
            help="seconds a paused turn's pages are retained (default 60: about the pauses' p90)",
        )
        ap.add_argument(
            "--mooncake-requests",
            type=int,
            metavar="N",
            help="requests of the Mooncake trace (default 3000; 300 with --quick)",
        )
        ap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")

    def rows(
        self,
        title: str,
        reqs: list[TraceRequest],
        num_pages: int,
        retain: Retain,
        agent: np.ndarray,
    ) -> None:
        """The side-by-side table of one workload."""
        p = self.args.page_size
        kept = [r for r in reqs if fits(r, num_pages, p)]
        blocks = block_keys(kept, p)
        lru = serve("LRU (today's cache)", reqs, num_pages, p, None)
        model = simulate(reqs, num_pages, p, "lru", blocks=blocks)
        best = from_bound("Belady (offline)", simulate(reqs, num_pages, p, "belady", blocks=blocks))
        outcomes = [lru, best]
        if retention_supported():
            keep = f"retention (keep-alive {self.args.keep_alive:g} s)"
            outcomes.append(serve(keep, reqs, num_pages, p, retain))
        lengths = np.fromiter((len(r.tokens) for r in reqs), np.int64, len(reqs))
        arrivals = np.fromiter((r.arrival for r in reqs), np.float64, len(reqs))
        recomputed = {o.label: int((lengths - o.cached)[o.served].sum()) for o in outcomes}
        excess = recomputed[lru.label] - recomputed[best.label]
        print(f"== {title}")
        rows = []
        for o in outcomes:
            ttft = prefill_ttfts(
                arrivals[o.served], (lengths - o.cached)[o.served], PREFILL_TPS, TOKEN_BUDGET
            )
            mine = ttft[agent[o.served]]
            p50, p99 = (float(np.percentile(mine, q)) if len(mine) else 0.0 for q in (50, 99))
            prompt = int(lengths[o.served].sum())
            gap = recomputed[lru.label] - recomputed[o.label]
            rows.append(
                [
                    o.label,
                    f"{int(o.served.sum()):,}",
                    f"{o.refused}",
                    f"{o.cached[o.served].sum() / prompt:.1%}" if prompt else "n/a",
                    f"{recomputed[o.label] / 1e6:.3f}M",
                    f"{gap / excess:.0%}" if excess else "n/a",
                    f"{p50:.3f}s",
                    f"{p99:.3f}s",
                ]
            )
            self.results[f"{title.split(':')[0]}/{o.label}"] = {
                "recomputed_tokens": recomputed[o.label],
                "ttft_p50": p50,
                "ttft_p99": p99,
                "served": int(o.served.sum()),
            }
        if len(outcomes) == 2:
            rows.append(["retention", "-", "-", "-", "-", "-", "-", "-"])
        headers = ["policy", "served", "refused", "hit rate", "recomputed", "gap closed"]
        table([*headers, "agent ttft p50", "agent ttft p99"], rows)
        if len(outcomes) == 2:
            print(NOT_IN_BUILD)
        else:
            print(f"retention row: {outcomes[2].note}")
        same = "equal" if model.computed_tokens == recomputed[lru.label] else "DIFFERENT"
        print(
            "LRU model of radixkv.apps.replay.belady: "
            f"{model.computed_tokens / 1e6:.3f}M recomputed, "
            f"{same} to today's cache\n"
        )

    def agent(self) -> None:
        sessions = self.args.sessions or (16 if self.args.quick else 64)
        w = AgentWorkload(sessions=sessions)
        reqs = w.generate()
        live = live_history_tokens(reqs)
        pages = max(1, int(live / 3) // self.args.page_size)
        keep = self.args.keep_alive

        def retain(r: TraceRequest) -> dict[str, Any] | None:
            if r.kind == "oneshot" or r.final:
                return None
            cls = LEAD_CLASS if r.kind == "lead" else SUBAGENT_CLASS
            return {"retain": keep, "priority": min(cls, radixkv.EVICTION_CLASSES - 1)}

        agent = np.fromiter((r.kind != "oneshot" for r in reqs), bool, len(reqs))
        self.rows(
            f"agent: {sessions} sessions, {len(reqs):,} requests ({int(agent.sum()):,} agent "
            f"turns), pool {pages:,} pages of {self.args.page_size} = a third of the live "
            f"histories ({live / 1e6:.2f}M tokens on average)",
            reqs,
            pages,
            retain,
            agent,
        )

    def mooncake(self) -> None:
        if not MOONCAKE.exists():
            print(f"note: {MOONCAKE} not found: Mooncake rows skipped\n")
            return
        n = self.args.mooncake_requests or (300 if self.args.quick else 3000)
        reqs = sorted(read_trace(MOONCAKE, limit=n), key=lambda r: r.arrival)
        distinct = block_keys(reqs, self.args.page_size).num_blocks
        pages = max(1, distinct // 3)
        keep = self.args.keep_alive
        self.rows(
            f"mooncake: first {len(reqs):,} requests, pool {pages:,} pages of "
            f"{self.args.page_size} = a third of the {distinct:,} distinct pages they name",
            reqs,
            pages,
            lambda r: {"retain": keep},
            np.ones(len(reqs), dtype=bool),
        )


if __name__ == "__main__":
    sys.exit(RetentionBench.main(__doc__))
