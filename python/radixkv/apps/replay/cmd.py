"""``radixkv replay TRACE``: a trace through a cache, once per policy: a table and a chart.
Without TRACE it replays the sample shipped in the package
(:data:`radixkv.apps.common.trace.SAMPLE_TRACE`).

With ``--replicas K`` (K > 1) the trace goes through K simulated servers, each with its own cache
of ``--num-pages`` pages, behind a router (``--router``: round-robin, prefix, least-loaded, a
comma list, or all three by default), once per router: a table with one row per router (hit
rate, time to first token, how evenly the replicas were loaded) and a chart with one line per
router. ``--router`` with one replica prints the same table (every router alike: a baseline
for a sweep over K). ``--metrics-port`` then serves the first replica's metrics.

With ``--host-pages N`` each cache has a host tier of N pages: a second table splits the hit
rate by tier (device hits, host hits loaded back) and counts the copies, and the time to first
token includes the loads, at ``--host-bandwidth`` GB/s with ``--kv-bytes-per-token`` bytes per
token (see :mod:`radixkv.apps.replay.simulate`). Without it the output is as it always was.

With ``--workload agent`` the requests are a synthetic agent workload (``--sessions``, ``--seed``;
:mod:`radixkv.apps.replay.agent_workload`) instead of a trace, and the pool defaults to a third of
the live sessions' histories; ``--bound belady`` adds offline rows, Belady's optimum and today's LRU
served one request at a time with the same pool (:mod:`radixkv.apps.replay.offline`).
"""

from __future__ import annotations

import argparse
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

from radixkv.apps.common import metrics_server
from radixkv.apps.common.args import (
    NO_CHART,
    UsageError,
    have_matplotlib,
    nonnegative_int,
    output_dir,
    positive_float,
    positive_int,
    table_header,
)
from radixkv.apps.common.trace import (
    MOONCAKE_TRACE_URL,
    SAMPLE_TRACE,
    TraceRequest,
    emptiness,
    input_problem,
    read_trace,
)
from radixkv.apps.replay import offline as replay_offline
from radixkv.apps.replay.simulate import (
    DEFAULT_BALANCE_THRESHOLD,
    DEFAULT_DISK_BANDWIDTH,
    DEFAULT_HOST_BANDWIDTH,
    DEFAULT_KV_BYTES_PER_TOKEN,
    ROUTERS,
    ReplayConfig,
    ReplayResult,
    RoutedResult,
    infinite_bound,
    replay,
    replay_replicas,
)

POLICIES = ("fcfs", "lpm", "dfs-weight")
#: The admission policy replayed with ``--replicas`` > 1 when ``--policy`` is not given.
REPLICAS_POLICY = "lpm"


def nonnegative_float(text: str) -> float:
    """An argparse ``type``: a float ``>= 0``, ``inf`` included (NaN refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``radixkv replay``: each one's help says its default."""
    p.add_argument(
        "trace",
        nargs="?",
        default=None,
        help="JSONL trace, plain or gzipped: Mooncake (hash_ids) or radixkv (tokens/text) "
        "(default: the sample shipped with radixkv, the first 1,000 requests of Mooncake's "
        "conversation trace)",
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
        default=None,
        help="pool size in pages, per replica with --replicas (default: "
        f"{replay_offline.TRACE_NUM_PAGES}; with --workload agent, a third of the live "
        "sessions' histories)",
    )
    p.add_argument(
        "--host-pages",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="host tier size in pages of --page-size tokens, like --num-pages (per replica with "
        "--replicas): pages the pool evicts go there and come back on a hit (default: 0, none)",
    )
    p.add_argument(
        "--host-bandwidth",
        type=positive_float,
        default=DEFAULT_HOST_BANDWIDTH / 1e9,
        metavar="GBPS",
        help="with --host-pages: GB/s (10^9 bytes/s) of loads from the host tier; a batch waits "
        "for its loads before computing (default: "
        f"{DEFAULT_HOST_BANDWIDTH / 1e9:g}, an assumption: about what host-to-device copies "
        "from pinned memory sustain on PCIe 4.0 x16, nominally 31.5 GB/s per direction)",
    )
    p.add_argument(
        "--disk-pages",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="disk tier size in pages, behind --host-pages (per replica with --replicas): pages "
        "the host tier drops go there and are read back when a request that needs them arrives "
        "(default: 0, none)",
    )
    p.add_argument(
        "--window",
        type=nonnegative_int,
        default=0,
        metavar="TOKENS",
        help="a window group for a model with sliding-window layers of this many tokens, with "
        "--window-pages pages: a hit also needs its last window's window pages (default: 0, "
        "none)",
    )
    p.add_argument(
        "--window-pages",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="pages of the window group's pool (with --window; default: 0)",
    )
    p.add_argument(
        "--window-host-pages",
        type=nonnegative_int,
        default=None,
        metavar="N",
        help="pages of the window group's host tier (with --window and --host-pages; default: "
        "--host-pages)",
    )
    p.add_argument(
        "--disk-bandwidth",
        type=positive_float,
        default=DEFAULT_DISK_BANDWIDTH / 1e9,
        metavar="GBPS",
        help="with --disk-pages: GB/s of reads from the disk tier; a batch waits for its "
        f"reads (default: {DEFAULT_DISK_BANDWIDTH / 1e9:g}, an assumption: one PCIe 4.0 NVMe "
        "drive's sequential reads)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=positive_int,
        default=DEFAULT_KV_BYTES_PER_TOKEN,
        metavar="BYTES",
        help="with --host-pages: KV bytes of one token, to cost the loads (default: "
        f"{DEFAULT_KV_BYTES_PER_TOKEN}, Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 dims "
        "x 2 (K, V) x 2 bytes)",
    )
    p.add_argument(
        "--policy",
        default=None,
        help="admission policies to replay, one run each: fcfs, lpm, dfs-weight, a comma list, "
        f"or 'all' (default: all; {REPLICAS_POLICY} with --replicas > 1)",
    )
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        metavar="K",
        help="simulated servers, each with its own cache of --num-pages pages, behind a router "
        "(default: 1)",
    )
    p.add_argument(
        "--router",
        default=None,
        help="how requests are spread over the replicas, one run each: round-robin (in "
        "arrival order), least-loaded (fewest outstanding tokens: prompt tokens routed to a "
        "replica whose first token has not come yet), prefix (longest cached prefix unless "
        "its load exceeds the least-loaded's by more than --balance-threshold, then the "
        "least-loaded; ties: lower load, lower index), a comma list, or 'all' "
        "(default: all with --replicas > 1)",
    )
    p.add_argument(
        "--balance-threshold",
        type=nonnegative_float,
        default=DEFAULT_BALANCE_THRESHOLD,
        metavar="TOKENS",
        help="outstanding tokens the prefix router tolerates on the replica with the longest "
        "prefix beyond the least-loaded one; 'inf': never rebalance (default: "
        f"{DEFAULT_BALANCE_THRESHOLD:.0f}, one batch at the default --token-budget)",
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
    replay_offline.add_arguments(p)
    metrics_server.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Runs ``radixkv replay`` with parsed ``args``; every user error (options, the trace, the
    chart folder, the metrics endpoint) is found before the replay starts."""
    routed = args.replicas > 1 or args.router is not None
    policy = args.policy or (REPLICAS_POLICY if routed else "all")
    policies = _choices(policy, POLICIES, "policy")
    routers = _choices(args.router or "all", ROUTERS, "router") if routed else ()
    replay_offline.check(args, routed)
    agent = replay_offline.agent_requests(args) if args.workload == "agent" else None
    if args.num_pages is None:
        args.num_pages = (
            replay_offline.TRACE_NUM_PAGES
            if agent is None
            else replay_offline.agent_pool_pages(agent, args.page_size)
        )
    if args.num_pages + args.host_pages >= 2**31:
        raise UsageError(
            f"replay: --num-pages {args.num_pages} plus --host-pages {args.host_pages} must "
            f"stay below 2**31 pages, got {args.num_pages + args.host_pages}"
        )
    metrics_server.check("replay", args)
    chart = not args.no_chart and have_matplotlib()
    if chart:
        output_dir(args.out, "replay")
    if agent is not None:
        print(replay_offline.describe(agent, args))
        requests: list[TraceRequest] = list(agent)
        source = "the agent workload"
    else:
        if args.trace is None:
            args.trace = str(SAMPLE_TRACE)
            print(
                f"trace: the sample shipped with radixkv ({SAMPLE_TRACE.name}; another: radixkv "
                "replay TRACE)"
            )
        requests = _read(args.trace, args.limit)
        source = args.trace
    pool = args.num_pages * args.page_size
    shortest = min(len(r.tokens) + max(r.output_length, 1) - 1 for r in requests)
    if -(-shortest // args.page_size) > args.num_pages:
        raise UsageError(
            f"replay: the pool of {args.num_pages} pages of {args.page_size} tokens ({pool} "
            f"tokens) cannot hold any request of {source} (the smallest needs {shortest} "
            "tokens with its output); raise --num-pages"
        )
    prompt = sum(len(r.tokens) for r in requests)
    replicas = f"{args.replicas} replicas, " if routed else ""
    each = " each" if routed else ""
    print(
        f"{len(requests)} requests, {prompt / 1e6:.1f}M prompt tokens, {replicas}pool "
        f"{pool / 1e6:.2f}M tokens{each} ({args.cache}, page {args.page_size})"
    )
    if args.host_pages:
        print(host_line(_config(args, policies[0]), each))
    bound = infinite_bound(requests, args.page_size)
    endpoint = metrics_server.start("replay", args)
    if routed:
        return _run_routed(args, requests, policies, routers, bound, endpoint)
    results = []
    for pol in policies:
        cfg = _config(args, pol)
        follow = None
        if endpoint is not None:

            def follow(cache, scheduler, pol=pol, ep=endpoint):
                ep.follow(cache, scheduler, policy=pol)

        results.append(replay(requests, cfg, progress=True, on_start=follow))
    offline = []
    if args.bound is not None:
        offline = replay_offline.offline_rows(
            requests, args.num_pages, args.page_size, args.prefill_tps, args.token_budget
        )
    print(format_table(results, bound, offline))
    if args.host_pages:
        print(format_host_table(results, [r.config.policy for r in results]))
    _note_dropped(results, len(requests), pool)
    if chart:
        path = draw_chart(results, bound, Path(args.out) / "replay_hit_rate.png")
        print(f"chart: {path}")
    elif not args.no_chart:
        print(NO_CHART)
    metrics_server.keep_serving(args)
    return 0


def _run_routed(
    args: argparse.Namespace,
    requests: list[TraceRequest],
    policies: tuple[str, ...],
    routers: tuple[str, ...],
    bound: float,
    endpoint: metrics_server.MetricsServer | None,
) -> int:
    """``--replicas``/``--router``: one replay per (policy, router), a table and a chart."""
    results = []
    for pol in policies:
        for router in routers:
            follow = None
            if endpoint is not None:

                def follow(cache, scheduler, pol=pol, router=router, ep=endpoint):
                    ep.follow(cache, scheduler, policy=pol, router=router, replica="0")

            results.append(
                replay_replicas(
                    requests,
                    _config(args, pol),
                    args.replicas,
                    router,
                    args.balance_threshold,
                    progress=True,
                    on_start=follow,
                )
            )
    print(format_router_table(results, bound))
    if args.host_pages:
        print(format_host_table(results, [f"{r.router}/{r.config.policy}" for r in results]))
    _note_dropped(results, len(requests), args.num_pages * args.page_size)
    if not args.no_chart and have_matplotlib():
        labels = [
            r.router if len(policies) == 1 else f"{r.router}/{r.config.policy}" for r in results
        ]
        path = draw_chart(
            results,
            bound,
            Path(args.out) / "replay_hit_rate.png",
            labels=labels,
            title=f"{args.replicas} replicas, {_pool_title(results[0].config)} each",
        )
        print(f"chart: {path}")
    elif not args.no_chart:
        print(NO_CHART)
    metrics_server.keep_serving(args)
    return 0


def _choices(text: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    """``text`` (``all``, or one name or a comma list of ``known``) as a tuple of names; a
    :class:`UsageError` naming the first unknown one."""
    names = known if text == "all" else tuple(text.split(","))
    for name in names:
        if name not in known:
            choices = ", ".join(known)
            raise UsageError(
                f"replay: unknown {what} {name!r} (choose from {choices}, a comma list of them, "
                "or all)"
            )
    return names


def _config(args: argparse.Namespace, policy: str) -> ReplayConfig:
    return ReplayConfig(
        cache=args.cache,
        page_size=args.page_size,
        num_pages=args.num_pages,
        policy=policy,
        max_wait=args.max_wait,
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        token_budget=args.token_budget,
        max_running=args.max_running,
        host_pages=args.host_pages,
        host_bandwidth=args.host_bandwidth * 1e9,
        kv_bytes_per_token=args.kv_bytes_per_token,
        disk_pages=args.disk_pages,
        disk_bandwidth=args.disk_bandwidth * 1e9,
        window=args.window,
        window_pages=args.window_pages,
        window_host_pages=args.window_host_pages,
    )


def _note_dropped(results: Sequence[ReplayResult | RoutedResult], total: int, pool: int) -> None:
    dropped = max(r.dropped for r in results)
    if dropped:
        print(
            f"note: {dropped} of {total} requests need more than the pool's {pool} "
            "tokens and were dropped; raise --num-pages to replay them"
        )


def _read(path: str, limit: int | None) -> list[TraceRequest]:
    """The requests of the trace at ``path``; a :class:`UsageError` for a file that is missing,
    unreadable, malformed (naming the line and the field) or empty."""
    problem = input_problem(path)
    if problem is not None:
        hint = ""
        if problem == "does not exist":
            hint = (
                "; radixkv replay without TRACE replays the sample shipped with radixkv, and "
                f"the whole Mooncake trace is at {MOONCAKE_TRACE_URL}"
            )
        raise UsageError(f"replay: trace file {path!r} {problem}{hint}")
    try:
        requests = list(read_trace(path, limit=limit))
    except (OSError, UnicodeDecodeError, EOFError, zlib.error) as e:
        raise UsageError(f"replay: cannot read trace {path!r}: {e}") from None
    except ValueError as e:  # a TraceError: the line, the field and the bad value
        raise UsageError(f"replay: {path}: {e}") from None
    if not requests:
        raise UsageError(f"replay: no requests in {path}: {emptiness(path)}")
    return requests


def format_table(
    results: list[ReplayResult],
    bound: float,
    offline: Sequence[replay_offline.OfflineRow] = (),
) -> str:
    """One row per policy: hit rate against the unbounded-cache bound, work and waits; then
    the ``offline`` rows (``--bound``) and their footnote, when there are any."""
    rows = table_header(
        [
            ("policy", "", -11),
            ("hit rate", "%", 8),
            ("of bound", "%", 8),
            ("computed", "tokens", 10),
            ("evicted", "pages", 9),
            ("wait p50", "s", 8),
            ("wait p99", "s", 8),
            ("ttft p50", "s", 8),
            ("ttft p99", "s", 8),
            ("dropped", "requests", 8),
        ]
    )
    for r in results:
        rows.append(
            f"{r.config.policy:<11} {r.hit_rate:>8.2%} {r.hit_rate / bound if bound else 0:>8.2%} "
            f"{r.computed_tokens / 1e6:>9.2f}M {r.evicted_pages:>9} "
            f"{r.percentile('queue_waits', 50):>7.2f}s {r.percentile('queue_waits', 99):>7.2f}s "
            f"{r.percentile('ttfts', 50):>7.2f}s {r.percentile('ttfts', 99):>7.2f}s {r.dropped:>8}"
        )
    if offline:
        rows.extend(replay_offline.format_rows(offline, bound))
    rows.append(f"unbounded-cache bound at this page size: {bound:.2%}")
    return "\n".join(rows)


def format_router_table(results: list[RoutedResult], bound: float) -> str:
    """One row per (policy, router): hit rate against the unbounded-cache bound, work, time to
    first token, and the load spread (most over fewest prompt tokens routed to a replica)."""
    rows = table_header(
        [
            ("router", "", -12),
            ("policy", "", -10),
            ("hit rate", "%", 8),
            ("of bound", "%", 8),
            ("computed", "tokens", 10),
            ("evicted", "pages", 9),
            ("ttft p50", "s", 8),
            ("ttft p99", "s", 8),
            ("load max/min", "ratio", 12),
            ("dropped", "requests", 8),
        ]
    )
    for r in results:
        spread = "inf" if math.isinf(r.load_spread) else f"{r.load_spread:.2f}x"
        rows.append(
            f"{r.router:<12} {r.config.policy:<10} {r.hit_rate:>8.2%} "
            f"{r.hit_rate / bound if bound else 0:>8.2%} {r.computed_tokens / 1e6:>9.2f}M "
            f"{r.evicted_pages:>9} {r.percentile('ttfts', 50):>7.2f}s "
            f"{r.percentile('ttfts', 99):>7.2f}s {spread:>12} {r.dropped:>8}"
        )
    rows.append(f"unbounded-cache bound at this page size (one cache for all): {bound:.2%}")
    if any(r.router == "prefix" for r in results):
        rows.append(f"prefix router balance threshold: {results[0].balance_threshold:g} tokens")
    return "\n".join(rows)


def host_line(cfg: ReplayConfig, each: str = "") -> str:
    """One line on the host tier of ``cfg``: its size and what a page costs to load and to
    compute again."""
    tokens = cfg.host_pages * cfg.page_size
    page_bytes = cfg.page_size * cfg.kv_bytes_per_token
    return (
        f"host tier {cfg.host_pages} pages ({tokens / 1e6:.2f}M tokens){each}; loads at "
        f"{cfg.host_bandwidth / 1e9:g} GB/s, {cfg.kv_bytes_per_token} bytes/token: a page "
        f"({page_bytes / 2**10:g} KiB) loads in {cfg.page_load_seconds * 1e6:.1f} us, "
        f"{cfg.page_size / cfg.prefill_tps * 1e6:.1f} us to compute again"
    )


def format_host_table(results: Sequence[ReplayResult | RoutedResult], labels: Sequence[str]) -> str:
    """One row per result (named by ``labels``): the hit rate split by tier, the copies, and
    the time batches waited for loads."""
    rows = table_header(
        [
            ("host tier", "", -24),
            ("hit rate", "%", 8),
            ("device", "%", 8),
            ("host", "%", 8),
            ("loaded", "pages", 10),
            ("offloaded", "pages", 10),
            ("host evict", "pages", 10),
            ("load time", "s", 10),
        ]
    )
    for label, r in zip(labels, results):
        rows.append(
            f"{label:<24} {r.hit_rate:>8.2%} {r.device_hit_rate:>8.2%} {r.host_hit_rate:>8.2%} "
            f"{r.loaded_pages:>10} {r.offloaded_pages:>10} {r.host_evicted_pages:>10} "
            f"{r.load_seconds:>9.2f}s"
        )
    if any(getattr(r, "disk_read_pages", 0) or r.disk_hit_tokens for r in results):
        rows.append("")
        rows += table_header(
            [
                ("disk tier", "", -24),
                ("disk hits", "%", 9),
                ("read", "pages", 10),
                ("written", "pages", 10),
                ("read time", "s", 10),
            ]
        )
        for label, r in zip(labels, results):
            rows.append(
                f"{label:<24} {r.disk_hit_rate:>9.2%} {_sum_of(r, 'disk_read_pages'):>10} "
                f"{_sum_of(r, 'disk_written_pages'):>10} {_sum_of(r, 'read_seconds'):>9.2f}s"
            )
        rows.append("hit rate = device + host + disk hits; ttft includes load and read time")
    else:
        rows.append("hit rate = device + host; the ttft columns above include the load time")
    return "\n".join(rows)


def _sum_of(r: ReplayResult | RoutedResult, name: str):
    """A result's counter, or the sum over a routed result's replicas."""
    if isinstance(r, ReplayResult):
        return getattr(r, name)
    return sum(getattr(x, name) for x in r.replicas)


def _pool_title(cfg: ReplayConfig) -> str:
    return f"{cfg.cache} cache, {cfg.num_pages * cfg.page_size / 1e6:.2f}M-token pool"


#: Line styles of successive curves: (style, width, z-order, alpha). Each later curve is
#: thinner, dashed or dotted, and drawn above the earlier ones, so that a curve equal to an
#: earlier one (lpm and dfs-weight often are) shows as a dashed line on a wide pale one instead
#: of hiding it, as in ``benches/bench_host_tier.py``'s chart.
CURVE_STYLES = (
    ("-", 3.5, 1, 0.55),
    ("--", 2.0, 2, 1.0),
    (":", 2.0, 3, 1.0),
    ("-.", 1.2, 4, 1.0),
)


def draw_chart(
    results: Sequence[ReplayResult | RoutedResult],
    bound: float,
    path: Path,
    labels: list[str] | None = None,
    title: str | None = None,
) -> Path:
    """Cumulative hit rate over simulated time, one line per result (labelled by ``labels``,
    default: each one's policy, with its final hit rate), and the bound; ``title`` defaults to
    the cache and pool. Overlapping curves stay visible (:data:`CURVE_STYLES`), and a curve equal
    to an earlier one says so in the legend (``= lpm``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = labels if labels is not None else [r.config.policy for r in results]
    drawn: list[tuple[list, str]] = []
    for i, (r, name) in enumerate(zip(results, names)):
        if not r.hit_curve:
            continue
        same = next((other for curve, other in drawn if curve == r.hit_curve), None)
        label = f"{name}: {r.hit_rate:.2%}" + (f" (= {same})" if same else "")
        style, width, z, alpha = CURVE_STYLES[i % len(CURVE_STYLES)]
        t, h = zip(*r.hit_curve)
        ax.plot(
            [x / 60 for x in t],
            [100 * y for y in h],
            label=label,
            linestyle=style,
            linewidth=width,
            zorder=z + i // len(CURVE_STYLES) * len(CURVE_STYLES),
            alpha=alpha,
        )
        drawn.append((r.hit_curve, name))
    ax.axhline(
        100 * bound, color="gray", linestyle="--", lw=1, label=f"unbounded cache: {bound:.2%}"
    )
    ax.set_xlabel("simulated time (minutes)")
    ax.set_ylabel("cumulative token hit rate (%)")
    ax.set_title(title if title is not None else _pool_title(results[0].config))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
