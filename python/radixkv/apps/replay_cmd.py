"""``radixkv replay TRACE``: a trace through a cache, once per policy: a table and a chart."""

from __future__ import annotations

import argparse
from pathlib import Path

from radixkv.apps import metrics_server
from radixkv.apps.args import (
    NO_CHART,
    UsageError,
    have_matplotlib,
    nonnegative_int,
    positive_float,
    positive_int,
)
from radixkv.apps.replay import ReplayConfig, ReplayResult, infinite_bound, replay
from radixkv.apps.trace import TraceRequest, read_trace

POLICIES = ("fcfs", "lpm", "dfs-weight")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``radixkv replay``: each one's help says its default."""
    p.add_argument(
        "trace", help="JSONL trace, plain or gzipped: Mooncake (hash_ids) or radixkv (tokens/text)"
    )
    p.add_argument(
        "--cache",
        choices=("radix", "block"),
        default="radix",
        help="index: radix tree or chained block hashes (default: radix)",
    )
    p.add_argument(
        "--page-size", type=positive_int, default=16, help="tokens per page (default: 16)"
    )
    p.add_argument(
        "--num-pages",
        type=positive_int,
        default=262_144,
        help="pool size in pages (default: 262144)",
    )
    p.add_argument(
        "--policy",
        default="all",
        help="admission policies to replay, one run each: fcfs, lpm, dfs-weight, a comma list, "
        "or 'all' (default: all)",
    )
    p.add_argument(
        "--max-wait",
        type=nonnegative_int,
        default=256,
        help="starvation bound in schedule calls, 0: none (default: 256)",
    )
    p.add_argument(
        "--prefill-tps",
        type=positive_float,
        default=50_000.0,
        help="simulated prefill tokens per second (default: 50000)",
    )
    p.add_argument(
        "--decode-tps",
        type=positive_float,
        default=50.0,
        help="simulated decode tokens per second per request (default: 50)",
    )
    p.add_argument(
        "--token-budget",
        type=positive_int,
        default=131_072,
        help="tokens computed per batch; a longer prompt is prefilled in chunks (default: 131072)",
    )
    p.add_argument(
        "--max-running",
        type=positive_int,
        default=64,
        help="requests prefilling or decoding at once at most (default: 64)",
    )
    p.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help="replay only the first N requests (default: all)",
    )
    p.add_argument("--out", default="out", help="folder for the PNG chart (default: ./out)")
    p.add_argument(
        "--no-chart", action="store_true", help="do not draw the chart (default: draw it)"
    )
    metrics_server.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Runs ``radixkv replay`` with parsed ``args``."""
    policies = POLICIES if args.policy == "all" else tuple(args.policy.split(","))
    for pol in policies:
        if pol not in POLICIES:
            raise UsageError(f"replay: unknown policy {pol!r} (choose from {POLICIES})")
    requests = _read(args.trace, args.limit)
    pool = args.num_pages * args.page_size
    shortest = min(len(r.tokens) + max(r.output_length, 1) - 1 for r in requests)
    if -(-shortest // args.page_size) > args.num_pages:
        raise UsageError(
            f"replay: the pool of {args.num_pages} pages of {args.page_size} tokens ({pool} "
            f"tokens) cannot hold any request of {args.trace} (the smallest needs {shortest} "
            "tokens with its output); raise --num-pages"
        )
    prompt = sum(len(r.tokens) for r in requests)
    print(
        f"{len(requests)} requests, {prompt / 1e6:.1f}M prompt tokens, pool "
        f"{pool / 1e6:.2f}M tokens ({args.cache}, page {args.page_size})"
    )
    bound = infinite_bound(requests, args.page_size)
    endpoint = metrics_server.start("replay", args)
    results = []
    for pol in policies:
        cfg = ReplayConfig(
            cache=args.cache,
            page_size=args.page_size,
            num_pages=args.num_pages,
            policy=pol,
            max_wait=args.max_wait,
            prefill_tps=args.prefill_tps,
            decode_tps=args.decode_tps,
            token_budget=args.token_budget,
            max_running=args.max_running,
        )
        follow = None
        if endpoint is not None:

            def follow(cache, scheduler, pol=pol, ep=endpoint):
                ep.follow(cache, scheduler, policy=pol)

        results.append(replay(requests, cfg, progress=True, on_start=follow))
    print(format_table(results, bound))
    dropped = max(r.dropped for r in results)
    if dropped:
        print(
            f"note: {dropped} of {len(requests)} requests need more than the pool's {pool} "
            "tokens and were dropped; raise --num-pages to replay them"
        )
    if not args.no_chart:
        if have_matplotlib():
            path = draw_chart(results, bound, Path(args.out) / "replay_hit_rate.png")
            print(f"chart: {path}")
        else:
            print(NO_CHART)
    return 0


def _read(path: str, limit: int | None) -> list[TraceRequest]:
    """The requests of the trace at ``path``; a :class:`UsageError` for a file that is missing,
    unreadable, malformed or empty."""
    if not Path(path).is_file():
        what = "is a directory" if Path(path).is_dir() else "does not exist"
        raise UsageError(f"replay: trace file {path!r} {what}")
    try:
        requests = list(read_trace(path, limit=limit))
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise UsageError(f"replay: cannot read trace {path!r}: {e}") from None
    except ValueError as e:
        raise UsageError(f"replay: {path}: {e}") from None
    if not requests:
        raise UsageError(f"replay: no requests in {path}")
    return requests


def format_table(results: list[ReplayResult], bound: float) -> str:
    """One row per policy: hit rate against the unbounded-cache bound, work and waits."""
    head = (
        f"{'policy':<11} {'hit rate':>8} {'of bound':>8} {'computed':>10} {'evicted':>9} "
        f"{'wait p50':>8} {'wait p99':>8} {'ttft p50':>8} {'ttft p99':>8} {'dropped':>7}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r.config.policy:<11} {r.hit_rate:>8.2%} {r.hit_rate / bound if bound else 0:>8.2%} "
            f"{r.computed_tokens / 1e6:>9.2f}M {r.evicted_pages:>9} "
            f"{r.percentile('queue_waits', 50):>7.2f}s {r.percentile('queue_waits', 99):>7.2f}s "
            f"{r.percentile('ttfts', 50):>7.2f}s {r.percentile('ttfts', 99):>7.2f}s {r.dropped:>7}"
        )
    rows.append(f"unbounded-cache bound at this page size: {bound:.2%}")
    return "\n".join(rows)


def draw_chart(results: list[ReplayResult], bound: float, path: Path) -> Path:
    """Cumulative hit rate over simulated time, one line per policy, and the bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        if r.hit_curve:
            t, h = zip(*r.hit_curve)
            ax.plot([x / 60 for x in t], [100 * y for y in h], label=r.config.policy)
    ax.axhline(100 * bound, color="gray", linestyle="--", label="unbounded cache")
    ax.set_xlabel("simulated time (minutes)")
    ax.set_ylabel("cumulative token hit rate (%)")
    cfg = results[0].config
    ax.set_title(f"{cfg.cache} cache, {cfg.num_pages * cfg.page_size / 1e6:.2f}M-token pool")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
