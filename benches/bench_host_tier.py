"""The host tier on the Mooncake trace: a device pool of D tokens with a host tier of 4D tokens,
set against device-only pools of D and of 5D tokens (the same total memory, all of it on the
device), for both caches.

Usage: .venv/bin/python benches/bench_host_tier.py [--quick] [--requests N] [--device-pages P]
[--page-size S] [--host-bandwidth GBPS] [--kv-bytes-per-token B] [--json PATH]
[--chart PATH | --no-chart]

Each setup is one ``radixkv replay`` simulation (``radixkv.apps.replay.simulate``, policy lpm, its
default batch and prefill rates) over the first N requests of the trace. Printed per setup: the
hit rate split by tier, the pages copied between the tiers, and the time-to-first-token model's
p50/p99 (with the host tier, each batch first waits for its loads at ``--host-bandwidth``).
Then the target: the tiered hit rate over the 5D device-only one (>= 0.9), and the TTFT ratios
against both device-only pools. The last column is the wall time of each simulation (the cache
core's work, not a figure of the model), with the tiered one's ratio to the D device-only one.

Defaults: the whole trace (12,031 requests), D = 262,144 pages of 16 tokens (4.19M tokens; host
16.8M, 5D 21.0M), about 15 s. ``--quick``: the first 2,000 requests, D = 32,768 pages (524k
tokens), a few seconds.

The chart (``--chart``, default ``out/host_tier.png``; needs matplotlib, skipped with a note
without it): the three setups' cumulative token hit rate over simulated time for the radix
cache, with the unbounded-cache bound; the legend gives each setup's final hit rate and, for the
tiered one, the part served from the host. The block cache's curves are drawn too if they differ
from the radix cache's; the title says when they are identical.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import MOONCAKE, ROOT, pin_one_core, table
from radixkv.apps.common.args import NO_CHART, have_matplotlib
from radixkv.apps.common.trace import read_trace
from radixkv.apps.replay.simulate import (
    DEFAULT_HOST_BANDWIDTH,
    DEFAULT_KV_BYTES_PER_TOKEN,
    ReplayConfig,
    ReplayResult,
    infinite_bound,
    replay,
)

CACHES = ("radix", "block")
HOST_FACTOR = 4  # host tier of 4D, compared with a device pool of (1 + 4)D
TARGET = 0.9  # tiered hit rate over the 5D device-only one
CHART = ROOT / "out" / "host_tier.png"  # out/ is git-ignored


def run_setup(requests, cache: str, device: int, host: int, args) -> tuple[ReplayResult, float]:
    """One replay: ``device`` pages on the device, ``host`` on the host; its wall seconds."""
    cfg = ReplayConfig(
        cache=cache,
        page_size=args.page_size,
        num_pages=device,
        policy="lpm",
        host_pages=host,
        host_bandwidth=args.host_bandwidth * 1e9,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )
    t0 = time.perf_counter()
    res = replay(requests, cfg)
    return res, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="2,000 requests, D = 32,768 pages (smoke run)"
    )
    ap.add_argument("--requests", type=int, default=None, help="first N requests (default: all)")
    ap.add_argument("--device-pages", type=int, default=None, help="D in pages (default: 262144)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    ap.add_argument(
        "--host-bandwidth",
        type=float,
        default=DEFAULT_HOST_BANDWIDTH / 1e9,
        help=f"GB/s each direction (default: {DEFAULT_HOST_BANDWIDTH / 1e9:g}, an assumption)",
    )
    ap.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=DEFAULT_KV_BYTES_PER_TOKEN,
        help=f"default: {DEFAULT_KV_BYTES_PER_TOKEN} (Llama-3-8B, bf16)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument(
        "--chart",
        type=Path,
        default=CHART,
        help="PNG of the hit rate over simulated time (default: out/host_tier.png)",
    )
    ap.add_argument("--no-chart", action="store_true", help="do not draw the chart")
    args = ap.parse_args()
    limit = args.requests or (2000 if args.quick else None)
    device = args.device_pages or (32_768 if args.quick else 262_144)
    if device < 1 or args.page_size < 1 or (limit is not None and limit < 1):
        ap.error("--requests, --device-pages and --page-size must be >= 1")
    if not 0 < args.host_bandwidth < float("inf") or args.kv_bytes_per_token < 1:
        ap.error("--host-bandwidth must be a finite number > 0, --kv-bytes-per-token >= 1")

    pinned = pin_one_core()
    requests = list(read_trace(MOONCAKE, limit=limit))
    prompt = sum(len(r.tokens) for r in requests)
    tok = device * args.page_size
    print(
        f"Mooncake conversation trace, first {len(requests)} requests ({prompt / 1e6:.1f}M "
        f"prompt tokens); D = {device} pages of {args.page_size} tokens ({tok / 1e6:.2f}M "
        f"tokens); loads at {args.host_bandwidth:g} GB/s, {args.kv_bytes_per_token} bytes/token; "
        f"{pinned}"
    )
    print()
    setups = [
        ("device D", device, 0),
        (f"device D + host {HOST_FACTOR}D", device, HOST_FACTOR * device),
        (f"device {HOST_FACTOR + 1}D", (HOST_FACTOR + 1) * device, 0),
    ]
    rows, out = [], []
    for cache in CACHES:
        got = {}
        for name, dev, host in setups:
            res, wall = run_setup(requests, cache, dev, host, args)
            got[name] = (res, wall)
            rows.append(
                [
                    f"{cache} {name}",
                    f"{dev * args.page_size / 1e6:.2f}M + {host * args.page_size / 1e6:.2f}M",
                    f"{res.hit_rate:.2%}",
                    f"{res.device_hit_rate:.2%}",
                    f"{res.host_hit_rate:.2%}",
                    str(res.loaded_pages),
                    str(res.offloaded_pages),
                    f"{res.percentile('ttfts', 50):.2f}s",
                    f"{res.percentile('ttfts', 99):.2f}s",
                    f"{res.load_seconds:.1f}s",
                    f"{wall:.2f}s",
                    str(res.dropped),
                ]
            )
        out.append((cache, got))
    table(
        [
            "setup",
            "device + host tokens",
            "hit rate",
            "device",
            "host",
            "loaded",
            "offloaded",
            "ttft p50",
            "ttft p99",
            "load time",
            "wall",
            "dropped",
        ],
        rows,
    )
    small, tiered, big = (name for name, _, _ in setups)
    figures = {}
    for cache, got in out:
        (t, tw), (s, sw), (b, _) = got[tiered], got[small], got[big]
        ratio = t.hit_rate / b.hit_rate if b.hit_rate else 0.0
        verdict = "PASS" if ratio >= TARGET else "FAIL"
        p50, p99 = t.percentile("ttfts", 50), t.percentile("ttfts", 99)
        print(
            f"{cache}: hit rate tiered / device-only {HOST_FACTOR + 1}D = {t.hit_rate:.2%} / "
            f"{b.hit_rate:.2%} = {ratio:.3f} (target >= {TARGET}: {verdict}); "
            f"tiered / device-only D = {t.hit_rate / s.hit_rate if s.hit_rate else 0:.2f}x"
        )
        print(
            f"{cache}: ttft p50 / p99 tiered {p50:.2f}s / {p99:.2f}s; "
            f"against device-only D {_x(p50, s, 50)} / {_x(p99, s, 99)}, "
            f"against device-only {HOST_FACTOR + 1}D {_x(p50, b, 50)} / {_x(p99, b, 99)}; "
            f"simulation wall time tiered / device-only D {tw / sw if sw else 0:.2f}x"
        )
        figures[cache] = {
            name: {
                "hit_rate": r.hit_rate,
                "device_hit_rate": r.device_hit_rate,
                "host_hit_rate": r.host_hit_rate,
                "loaded_pages": r.loaded_pages,
                "offloaded_pages": r.offloaded_pages,
                "ttft_p50": r.percentile("ttfts", 50),
                "ttft_p99": r.percentile("ttfts", 99),
                "load_seconds": r.load_seconds,
                "wall_seconds": w,
            }
            for name, (r, w) in got.items()
        }
        figures[cache]["hit_rate_ratio_tiered_over_5d"] = ratio
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if not args.no_chart:
        if have_matplotlib():
            bound = infinite_bound(requests, args.page_size)
            heading = (
                f"Mooncake trace, {len(requests)} requests, lpm; D = {tok / 1e6:.2f}M tokens "
                f"(pages of {args.page_size})"
            )
            path = chart(dict(out), [name for name, _, _ in setups], bound, args.chart, heading)
            print(f"chart: {path}")
        else:
            print(NO_CHART)
    return 0


def chart(
    got: dict[str, dict[str, tuple[ReplayResult, float]]],
    names: list[str],
    bound: float,
    path: Path,
    heading: str,
) -> Path:
    """Draws the setups' cumulative hit rate over simulated time to ``path``: the radix cache's
    three curves (the block cache's too where any of its curves differs from the radix one's)
    and the unbounded-cache bound; ``heading`` is the title's first line. The tiered curve is
    dashed and drawn on top, as it mostly lies on the device-only 5D one. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    same = all(got["radix"][n][0].hit_curve == got["block"][n][0].hit_curve for n in names)
    shown = ["radix"] if same else list(CACHES)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = ("tab:blue", "tab:orange", "tab:green")
    styles = {  # (line style, width, z-order) per setup: tiered on top, dashed
        names[0]: ("-", 1.5, 2),
        names[1]: ("--", 1.5, 3),
        names[2]: ("-", 3.0, 1),
    }
    for cache in shown:
        for name, color in zip(names, colors):
            r = got[cache][name][0]
            if not r.hit_curve:
                continue
            label = f"{name}: {r.hit_rate:.1%}"
            if r.host_hit_tokens:
                label += f" ({r.host_hit_rate:.1%} from host)"
            style, width, z = styles[name]
            t, h = zip(*r.hit_curve)
            ax.plot(
                [x / 60 for x in t],
                [100 * y for y in h],
                label=label if same else f"{cache} {label}",
                color=color,
                linestyle=style if cache == "radix" else ":",
                linewidth=width,
                zorder=z,
                alpha=0.6 if width > 2 else 1.0,
            )
    ax.axhline(
        100 * bound, color="gray", linestyle="--", lw=1, label=f"unbounded cache: {bound:.1%}"
    )
    top = max([bound] + [h for c in shown for n in names for _, h in got[c][n][0].hit_curve])
    ax.set_ylim(0, min(100.0, 100 * top * 1.12) or 1.0)
    ax.set_xlabel("simulated time (minutes)")
    ax.set_ylabel("cumulative token hit rate (%)")
    note = "block cache: identical curves" if same else "radix and block caches differ"
    ax.set_title(f"{heading}\n{'radix cache' if same else 'both caches'} ({note})")
    # Below the axes, so it never covers a curve whatever the pool size.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _x(value: float, base: ReplayResult, q: float) -> str:
    ref = base.percentile("ttfts", q)
    return f"{value / ref:.2f}x" if ref else "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
