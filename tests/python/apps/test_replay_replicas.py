"""Trace replay over K replicas behind a router: routing decisions, hit rates and loads on
synthetic traces where the right answer can be derived by hand, and the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from radixkv.apps.common.trace import TraceRequest
from radixkv.apps.replay.simulate import (
    ROUTERS,
    ReplayConfig,
    RoutedResult,
    infinite_bound,
    replay,
    replay_replicas,
)

PAGE = 16
PREFIX = 512  # tokens each tenant's prompts share: 32 pages
SUFFIX = 64  # tokens of each prompt's own tail: 4 pages
OUT = 8
#: One request needs ceil((512 + 64 + 8 - 1) / 16) = 37 pages: a replica's pool of 37 pages
#: holds one request at a time, so a prompt of another tenant evicts everything before it.
POOL = 37
ROUNDS = 5


def tenants(k: int = 4, rounds: int = ROUNDS) -> list[TraceRequest]:
    """``k`` tenants, each with its own 512-token prefix, one request each per round. Round
    ``r`` arrives at once at ``10 r`` seconds (every round is done long before the next), its
    tenants in the order ``r, r + 1, ...`` (mod ``k``): rotated, so that the ``i``-th request of
    a round belongs to a different tenant each round. Token ids never repeat across tenants
    or suffixes."""
    reqs = []
    for r in range(rounds):
        for p in range(k):
            t = (p + r) % k
            prefix = np.arange(PREFIX, dtype=np.uint32) + t * 1_000_000
            suffix = np.arange(SUFFIX, dtype=np.uint32) + 500_000_000 + (r * k + p) * SUFFIX
            reqs.append(TraceRequest(10.0 * r, np.concatenate([prefix, suffix]), OUT))
    return reqs


def tenant_of(req: TraceRequest) -> int:
    return int(req.tokens[0]) // 1_000_000


def test_prefix_routing_reaches_one_big_cache_round_robin_does_not():
    k, reqs = 4, tenants()
    cfg = ReplayConfig(page_size=PAGE, num_pages=POOL, policy="lpm")
    got = {router: replay_replicas(reqs, cfg, k, router) for router in ROUTERS}
    # Every round after the first finds each tenant's 512-token prefix cached, exactly, on the
    # replica that served it in round 0: what an unbounded cache finds, and about what one
    # cache of all four pools together finds (tight, it loses a few prefix pages to LRU).
    want = (ROUNDS - 1) * k * PREFIX
    prefix = got["prefix"]
    assert prefix.cached_tokens == want
    assert prefix.hit_rate == pytest.approx(infinite_bound(reqs, PAGE))
    big = replay(reqs, ReplayConfig(page_size=PAGE, num_pages=k * POOL, policy="lpm"))
    assert want * 0.95 <= big.cached_tokens <= want
    # Round 0 arrives at once on idle, cold replicas: the least loaded, then the lowest index,
    # so tenant j lands on replica j and stays there.
    assert all(prefix.assignment[i] == tenant_of(r) for i, r in enumerate(reqs))
    # Round-robin and least-loaded (every replica idle at each round's start) both send the
    # i-th request of a round to replica i: a different tenant each round, whose prefix the
    # one-request pool has evicted. Nothing is ever found.
    for router in ("round-robin", "least-loaded"):
        res = got[router]
        assert res.assignment == [i % k for i in range(len(reqs))]
        assert res.cached_tokens == 0 and res.hit_rate == 0.0
        assert res.evicted_pages > 0
    for res in got.values():
        assert res.requests == len(reqs) and res.dropped == 0
        assert res.cached_tokens + res.computed_tokens == res.prompt_tokens
        assert res.assigned_tokens == [ROUNDS * (PREFIX + SUFFIX)] * k
        assert res.load_spread == 1.0
        assert sum(len(r.ttfts) for r in res.replicas) == len(reqs)
    # Found prefixes are not computed again: their first tokens come no later.
    assert prefix.percentile("ttfts", 50) <= got["round-robin"].percentile("ttfts", 50)


def hot_prefix(n: int = 8) -> list[TraceRequest]:
    """A warm-up request at 0 s, then ``n`` requests at once at 10 s, all on its prefix: the
    replica that served the warm-up holds the prefix, every other replica holds nothing."""
    prefix = np.arange(PREFIX, dtype=np.uint32)
    reqs = []
    for i in range(n + 1):
        suffix = np.arange(SUFFIX, dtype=np.uint32) + 1_000_000 + i * SUFFIX
        reqs.append(TraceRequest(0.0 if i == 0 else 10.0, np.concatenate([prefix, suffix]), OUT))
    return reqs


@pytest.mark.parametrize(
    "threshold, want",
    [
        # Never rebalance: all on the replica with the prefix.
        (math.inf, [0] * 8),
        # Rebalance at any imbalance: the prefix replica only when it is among the least loaded.
        (0.0, [0, 1, 2, 3, 0, 1, 2, 3]),
        # 2.5 prompts' worth (1440 tokens), loads in prompts of 576 tokens before each request:
        # (0,0,0,0) -> 0, (1,0,0,0) -> 0, (2,0,0,0) -> 0, (3,0,0,0): 3 > 2.5 -> 1,
        # (3,1,0,0) -> 2, (3,1,1,0) -> 3, (3,1,1,1): 2 <= 2.5 -> 0, (4,1,1,1): 3 > 2.5 -> 1.
        (2.5 * (PREFIX + SUFFIX), [0, 0, 0, 1, 2, 3, 0, 1]),
    ],
)
def test_prefix_router_balance_threshold(threshold, want):
    reqs = hot_prefix()
    cfg = ReplayConfig(page_size=PAGE, num_pages=1024)
    res = replay_replicas(reqs, cfg, 4, "prefix", threshold)
    assert res.assignment == [0, *want]
    size = PREFIX + SUFFIX
    assert res.assigned_tokens == [size * ([0, *want].count(i)) for i in range(4)]
    # Replica 0 has the prefix from the warm-up; each other replica computes it once, for
    # the first request it gets, and every later request there finds it.
    cold = len(set(want) - {0})
    assert res.cached_tokens == PREFIX * (len(want) - cold)
    lo, hi = min(res.assigned_tokens), max(res.assigned_tokens)
    assert res.load_spread == (math.inf if lo == 0 else hi / lo)


def test_load_is_prefill_not_yet_done():
    """Load counts the prompt tokens whose first token has not come, including those of a
    batch still running at the arrival, and not requests that are only decoding."""
    long = TraceRequest(0.0, np.arange(100_000, dtype=np.uint32), 500)  # 2 s of prefill
    short = [
        TraceRequest(t, np.arange(64, dtype=np.uint32) + 200_000 + 64 * i, 4)
        for i, t in enumerate([0.01, 0.02, 5.0])
    ]
    cfg = ReplayConfig(page_size=PAGE, num_pages=8192)
    res = replay_replicas([long, *short], cfg, 2, "least-loaded")
    # 0.01 s and 0.02 s: replica 0 is computing the long prompt until 2 s, so both go to 1
    # (its first short prompt is in a batch that ends after 0.02 s: still load). At 5 s the
    # long request is decoding (10 s of output): load 0 again, the tie goes to replica 0.
    assert res.assignment == [0, 1, 1, 0]
    rr = replay_replicas([long, *short], cfg, 2, "round-robin")
    assert rr.assignment == [0, 1, 0, 1]
    # The short request round-robin sends behind the long prompt waits for it.
    assert min(rr.replicas[0].ttfts) > 1.9 and max(res.replicas[1].ttfts) < 0.1
    assert rr.percentile("ttfts", 50) > 0.9 > res.percentile("ttfts", 50)


@pytest.mark.parametrize("cache", ["radix", "block"])
def test_one_replica_is_the_plain_replay(cache):
    reqs = tenants(k=3, rounds=3)
    cfg = ReplayConfig(cache=cache, page_size=PAGE, num_pages=2 * POOL, policy="fcfs")
    plain = replay(reqs, cfg)
    for router in ROUTERS:
        one = replay_replicas(reqs, cfg, 1, router)
        (only,) = one.replicas
        assert one.assignment == [0] * len(reqs)
        assert (only.cached_tokens, only.computed_tokens, only.evicted_pages) == (
            plain.cached_tokens,
            plain.computed_tokens,
            plain.evicted_pages,
        )
        assert only.ttfts == plain.ttfts and only.queue_waits == plain.queue_waits
        assert one.hit_curve == plain.hit_curve


def test_bad_arguments_are_value_errors():
    reqs = tenants(k=2, rounds=1)
    cfg = ReplayConfig(page_size=PAGE, num_pages=POOL)
    with pytest.raises(ValueError, match="replicas must be an int >= 1, got 0"):
        replay_replicas(reqs, cfg, 0)
    with pytest.raises(ValueError, match=r"router must be one of .* got 'random'"):
        replay_replicas(reqs, cfg, 2, "random")
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="balance_threshold must be >= 0"):
            replay_replicas(reqs, cfg, 2, "prefix", bad)


def test_dropped_requests_count_nowhere():
    big = TraceRequest(0.0, np.arange(10_000, dtype=np.uint32), 4)  # more than the pool
    reqs = [big, *tenants(k=2, rounds=1)]
    res = replay_replicas(reqs, ReplayConfig(page_size=PAGE, num_pages=POOL), 2, "round-robin")
    assert isinstance(res, RoutedResult)
    assert res.dropped == 1 and res.requests == 2
    assert sum(res.assigned_tokens) == 2 * (PREFIX + SUFFIX)


# --- the command line, run as a user runs it ------------------------------------------------


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixkv", "replay", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tenant_trace(tmp_path):
    path = tmp_path / "tenants.jsonl"
    rows = [
        {"timestamp": r.arrival, "tokens": r.tokens.tolist(), "output_length": r.output_length}
        for r in tenants()
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_cli_prints_one_row_per_router(tenant_trace, tmp_path):
    proc = run_cli(
        str(tenant_trace), "--replicas", "4", "--page-size", "16", "--num-pages", str(POOL),
        "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "4 replicas, pool 0.00M tokens each" in out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.startswith(ROUTERS) and " lpm " in line
    }
    assert len(rows) == 3 and all(len(row) == 10 for row in rows.values())
    # Default with replicas: all three routers, the lpm policy.
    want_rate = (ROUNDS - 1) * PREFIX / (ROUNDS * (PREFIX + SUFFIX))
    assert rows["prefix"][1] == "lpm" and rows["prefix"][2] == f"{want_rate:.2%}"
    assert rows["round-robin"][2] == "0.00%" and rows["least-loaded"][2] == "0.00%"
    assert all(rows[r][-2] == "1.00x" for r in ROUTERS)
    assert "balance threshold: 131072 tokens" in out
    png = tmp_path / "replay_hit_rate.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    # One router, a threshold, two policies: one row each.
    proc = run_cli(
        str(tenant_trace), "--replicas", "2", "--router", "prefix", "--policy", "fcfs,lpm",
        "--balance-threshold", "inf", "--num-pages", str(POOL), "--no-chart",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("prefix  ")]
    assert [r[1] for r in rows] == ["fcfs", "lpm"]
    assert "round-robin" not in proc.stdout and "threshold: inf tokens" in proc.stdout


def test_cli_one_replica_keeps_the_policy_table(tenant_trace):
    proc = run_cli(str(tenant_trace), "--num-pages", str(4 * POOL), "--no-chart")
    assert proc.returncode == 0, proc.stderr
    heads = [line.split()[0] for line in proc.stdout.splitlines()[1:7]]
    assert heads[0] == "policy" and heads[1] == "%"  # the names, then their units
    assert heads[3:6] == ["fcfs", "lpm", "dfs-weight"]
    assert "router" not in proc.stdout and "replicas" not in proc.stdout


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--replicas", "0"], ["--replicas", "got 0"]),
        (["--replicas", "two"], ["--replicas", "'two'"]),
        (["--replicas", "2", "--router", "random"], ["unknown router 'random'"]),
        (["--router", "prefix,rr"], ["unknown router 'rr'"]),
        (["--replicas", "2", "--balance-threshold", "-1"], ["--balance-threshold", "got -1"]),
        (["--balance-threshold", "nan"], ["--balance-threshold", "got nan"]),
    ],
)
def test_cli_user_errors(tenant_trace, argv, needles):
    proc = run_cli(str(tenant_trace), "--no-chart", *argv)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixkv: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
