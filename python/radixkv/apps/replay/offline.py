"""What ``radixkv replay`` adds for agents: ``--workload agent`` (the synthetic workload of
:mod:`radixkv.apps.replay.agent_workload` instead of a trace file) and ``--bound belady`` (rows from
the offline simulations of :mod:`radixkv.apps.replay.belady` beside the replayed policies).

The offline rows serve the same requests one at a time with the same pool: ``lru*`` as today's
cache evicts, ``belady*`` by Belady's rule (the most any eviction or retention order can reach
in that model); their times to first token come from :func:`radixkv.apps.replay.prefill_queue
.prefill_ttfts`, and they have no queue waits. The gap between the two starred rows is what a
better order could win; the replayed rows add concurrency (pages pinned by requests in flight,
reserved for outputs) on top.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixkv.apps.common.args import UsageError, nonnegative_int, positive_int
from radixkv.apps.common.trace import TraceRequest
from radixkv.apps.replay.agent_workload import AgentRequest, AgentWorkload, live_history_tokens
from radixkv.apps.replay.belady import BoundResult, simulate
from radixkv.apps.replay.block_keys import block_keys
from radixkv.apps.replay.prefill_queue import prefill_ttfts

#: ``--workload`` choices.
WORKLOADS = ("trace", "agent")
#: ``--bound`` choices.
BOUNDS = ("belady",)
#: ``--num-pages`` without ``--workload agent`` when not given.
TRACE_NUM_PAGES = 262_144
#: The pool ``--workload agent`` gets when ``--num-pages`` is not given: this share of the live
#: sessions' histories (:func:`radixkv.apps.replay.agent_workload.live_history_tokens`).
AGENT_POOL_SHARE = 1 / 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--workload``, its knobs, and ``--bound``."""
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="trace",
        help="trace: replay TRACE; agent: a synthetic agent workload instead (sessions of many "
        "turns with growing histories over a shared system prompt, heavy-tailed tool pauses, "
        "sub-agents, one-shot background requests; see radixkv.apps.replay.agent_workload) "
        "(default: trace)",
    )
    p.add_argument(
        "--sessions",
        type=positive_int,
        default=AgentWorkload.sessions,
        help=f"with --workload agent: lead sessions (default: {AgentWorkload.sessions})",
    )
    p.add_argument(
        "--seed",
        type=nonnegative_int,
        default=AgentWorkload.seed,
        help="with --workload agent: the seed; equal seeds give equal requests (default: 0)",
    )
    p.add_argument(
        "--bound",
        choices=BOUNDS,
        default=None,
        help="also print offline rows (one request at a time, same pool): belady, Belady's "
        "optimum (evict the page used again farthest in the future), and lru, today's order in "
        "the same model (default: none)",
    )


def check(args: argparse.Namespace, routed: bool) -> None:
    """A :class:`UsageError` for a combination the options cannot make."""
    if args.workload == "agent" and args.trace is not None:
        raise UsageError(
            f"replay: --workload agent generates its requests: drop the trace {args.trace!r}"
        )
    if args.bound is not None and (routed or args.host_pages):
        raise UsageError(
            f"replay: --bound {args.bound} models one pool without a host tier: not with "
            "--replicas, --router or --host-pages"
        )


def agent_requests(args: argparse.Namespace) -> list[AgentRequest]:
    """The synthetic workload of ``--sessions`` and ``--seed`` (the first ``--limit``)."""
    reqs = AgentWorkload(sessions=args.sessions, seed=args.seed).generate()
    return reqs[: args.limit] if args.limit is not None else reqs


def agent_pool_pages(requests: Sequence[AgentRequest], page_size: int) -> int:
    """Pages of :data:`AGENT_POOL_SHARE` of the live sessions' histories (at least one)."""
    return max(1, int(live_history_tokens(requests) * AGENT_POOL_SHARE) // page_size)


def describe(requests: Sequence[AgentRequest], args: argparse.Namespace) -> str:
    """One line on the agent workload."""
    kinds = {k: sum(r.kind == k for r in requests) for k in ("lead", "subagent", "oneshot")}
    subs = len({r.session for r in requests if r.kind == "subagent"})
    live = live_history_tokens(requests)
    return (
        f"agent workload: {args.sessions} sessions (seed {args.seed}): {kinds['lead']} lead "
        f"turns, {kinds['subagent']} turns of {subs} sub-agents, {kinds['oneshot']} one-shot "
        f"requests; live histories {live / 1e6:.2f}M tokens on average"
    )


@dataclass
class OfflineRow:
    """One offline simulation: its label, result and times to first token (per served
    request, in arrival order)."""

    label: str
    result: BoundResult
    ttfts: np.ndarray


def offline_rows(
    requests: Sequence[TraceRequest],
    num_pages: int,
    page_size: int,
    prefill_tps: float,
    token_budget: int,
) -> list[OfflineRow]:
    """``lru*`` and ``belady*`` over ``requests`` (sorted by arrival here, as the replay
    serves them)."""
    reqs = sorted(requests, key=lambda r: r.arrival)
    blocks = None
    rows = []
    for policy in ("lru", "belady"):
        res = simulate(reqs, num_pages, page_size, policy, blocks=blocks)
        if blocks is None:
            kept = [r for r, ok in zip(reqs, res.served) if ok]
            blocks = block_keys(kept, page_size)
        served = np.flatnonzero(res.served)
        arrivals = np.fromiter((reqs[i].arrival for i in served), np.float64, len(served))
        lengths = np.fromiter((len(reqs[i].tokens) for i in served), np.int64, len(served))
        ttfts = prefill_ttfts(arrivals, lengths - res.cached[served], prefill_tps, token_budget)
        rows.append(OfflineRow(f"{policy}*", res, ttfts))
    return rows


def format_rows(rows: Sequence[OfflineRow], bound: float) -> list[str]:
    """The offline rows in the columns of :func:`radixkv.apps.replay.cmd.format_table`, and a
    footnote."""
    out = []
    for row in rows:
        r = row.result
        p50, p99 = (np.percentile(row.ttfts, q) if len(row.ttfts) else 0.0 for q in (50, 99))
        out.append(
            f"{row.label:<11} {r.hit_rate:>8.2%} {r.hit_rate / bound if bound else 0:>8.2%} "
            f"{r.computed_tokens / 1e6:>9.2f}M {r.evicted_pages:>9} {'-':>8} {'-':>8} "
            f"{p50:>7.2f}s {p99:>7.2f}s {r.dropped:>8}"
        )
    out.append(
        "* offline, one request at a time with the same pool: belady* is the most any "
        "eviction or\n  retention order reaches there, lru* RadixCache's order; ttft from a "
        "prefill queue without pages"
    )
    return out
