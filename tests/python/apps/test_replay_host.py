"""Trace replay with a host tier (``host_pages > 0``): the hit rate split by tier, the copies
drained from the cache's log, the time to first token with the copies costed, and the
``--host-pages``/``--host-bandwidth``/``--kv-bytes-per-token`` options of ``radixkv replay``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import radixkv
from radixkv.apps import cli
from radixkv.apps.common.trace import TraceRequest, read_trace
from radixkv.apps.replay.simulate import (
    ReplayConfig,
    ReplayResult,
    infinite_bound,
    replay,
    replay_replicas,
)

TRACE = Path(__file__).resolve().parents[3] / "benches/data/mooncake_conversation_trace.jsonl.gz"


#: Pool of the Mooncake tests, in pages of 16 tokens: 524k tokens, about 2% of the prompt
#: tokens of their 2,000 requests (27.4M; the longest needs 123,783 tokens with its output).
#: Large enough that the pool is not what holds requests back (TTFT p50 about 2.5 s).
DEVICE = 32_768


@pytest.fixture(scope="module")
def mooncake() -> list[TraceRequest]:
    """The first 2,000 requests of the shipped Mooncake trace."""
    return list(read_trace(TRACE, limit=2000))


def replay_watched(requests, cfg: ReplayConfig) -> tuple[ReplayResult, object]:
    """``replay`` that also hands back the simulated server's cache, to read its own counters."""
    seen = []
    res = replay(requests, cfg, on_start=lambda cache, sched: seen.append(cache))
    return res, seen[0]


# --- a trace small enough to follow page by page ------------------------------------------

PAGE = 4


def three_requests() -> list[TraceRequest]:
    """A (40 tokens, 10 pages), then B (24 other tokens, 6 pages), then A again, each long after
    the one before; no outputs, so a request holds only its prompt's pages."""
    a = np.arange(40, dtype=np.uint32)
    b = np.arange(1000, 1024, dtype=np.uint32)
    return [TraceRequest(0.0, a, 0), TraceRequest(100.0, b, 0), TraceRequest(200.0, a.copy(), 0)]


def small_config(host_pages: int, bandwidth: float = 4000.0) -> ReplayConfig:
    """A pool of 10 pages of 4 tokens; 40 prompt tokens computed per second; a page of 4 tokens
    x 1,000 bytes copies in ``16,000 / bandwidth`` seconds (1 s at the default)."""
    return ReplayConfig(
        cache="radix",
        page_size=PAGE,
        num_pages=10,
        policy="fcfs",
        prefill_tps=40.0,
        host_pages=host_pages,
        host_bandwidth=bandwidth,
        kv_bytes_per_token=1000,
    )


def test_evicted_prefix_comes_back_from_the_host_and_its_copies_are_costed():
    # A fills the pool. B needs 6 pages: A's last 6 go down to the host (6 offloads). A again
    # matches 9 pages (all but its last: one token must be computed): 4 on the device, 5 on
    # the host; loading them and allocating its last page takes 6 pages, so B's 6 go down
    # (6 offloads) while A's 5 come back (5 loads). A batch waits for its loads, not for
    # offloads.
    reqs = three_requests()
    res, cache = replay_watched(reqs, small_config(host_pages=20))
    copy = small_config(20).page_load_seconds
    assert copy == pytest.approx(1.0)
    assert res.requests == 3 and res.prompt_tokens == 104
    assert res.cached_tokens == 36 and res.host_hit_tokens == 20
    assert res.device_hit_rate == pytest.approx(16 / 104)
    assert res.host_hit_rate == pytest.approx(20 / 104)
    assert res.loaded_pages == 5 and res.offloaded_pages == 12 and res.host_evicted_pages == 0
    stats = cache.stats
    assert (stats.loaded_pages, stats.offloaded_pages) == (res.loaded_pages, res.offloaded_pages)
    assert stats.host_hit_tokens == res.host_hit_tokens
    assert cache.drain_copies().shape == (0, 3)  # the replay drained every copy
    # TTFT: load time, then the batch's tokens at 40 per second.
    assert res.ttfts == pytest.approx([40 / 40, 24 / 40, 5 * copy + 4 / 40])
    assert res.load_seconds == pytest.approx(5 * copy)

    # Without the tier A's last 6 pages are dropped: A again finds only its first 4.
    flat = replay(reqs, small_config(host_pages=0))
    assert flat.cached_tokens == 16 and flat.host_hit_tokens == 0
    assert flat.loaded_pages == flat.offloaded_pages == 0 and flat.load_seconds == 0.0
    assert flat.ttfts == pytest.approx([1.0, 24 / 40, 24 / 40])
    assert res.hit_rate > flat.hit_rate

    # Ten times the bandwidth: the same loads, a tenth of the time.
    fast = replay(reqs, small_config(host_pages=20, bandwidth=40_000.0))
    assert fast.load_seconds == pytest.approx(res.load_seconds / 10)
    assert fast.ttfts == pytest.approx([1.0, 24 / 40, 0.5 + 4 / 40])


# --- the Mooncake trace ------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["radix", "block"])
def test_host_tier_raises_the_hit_rate_of_the_same_device_pool(mooncake, cache):
    device = DEVICE
    base = ReplayConfig(cache=cache, num_pages=device, policy="lpm")
    flat = replay(mooncake, base)
    tiered, seen = replay_watched(
        mooncake, ReplayConfig(cache=cache, num_pages=device, policy="lpm", host_pages=4 * device)
    )
    big = replay(mooncake, ReplayConfig(cache=cache, num_pages=5 * device, policy="lpm"))
    bound = infinite_bound(mooncake, 16)
    assert flat.dropped == tiered.dropped == big.dropped == 0
    assert flat.evicted_pages > 0 and tiered.offloaded_pages > 0 and tiered.loaded_pages > 0
    # The host tier brings back what the device pool alone had lost; never past the bound.
    assert flat.hit_rate + 0.05 < tiered.hit_rate <= bound + 1e-9
    assert tiered.hit_rate >= 0.9 * big.hit_rate
    # The split adds up, and every token is cached on one tier or computed.
    assert 0 < tiered.host_hit_tokens <= tiered.cached_tokens
    assert tiered.device_hit_rate + tiered.host_hit_rate == pytest.approx(tiered.hit_rate)
    assert tiered.cached_tokens + tiered.computed_tokens == tiered.prompt_tokens
    # The replay counted the cache's copies, one by one, from its log.
    stats = seen.stats
    assert tiered.loaded_pages == stats.loaded_pages and tiered.loaded_pages > 0
    assert tiered.offloaded_pages == stats.offloaded_pages
    assert tiered.host_evicted_pages == stats.host_evicted_pages
    assert stats.host_hit_tokens == tiered.host_hit_tokens
    # Batches waited for every load, at 2 MiB per page over 25 GB/s.
    assert tiered.load_seconds == pytest.approx(tiered.loaded_pages * 16 * 131072 / 25e9)
    # Without a tier there is nothing to split or copy.
    assert flat.host_hit_tokens == flat.loaded_pages == flat.offloaded_pages == 0
    assert flat.load_seconds == 0.0 and flat.device_hit_rate == flat.hit_rate


def test_host_tier_with_replicas_sums_over_them(mooncake):
    reqs = mooncake[:400]
    cfg = ReplayConfig(num_pages=8192, policy="lpm", host_pages=4 * 8192)
    res = replay_replicas(reqs, cfg, 2, "round-robin")
    assert res.loaded_pages == sum(r.loaded_pages for r in res.replicas) > 0
    assert res.host_hit_tokens == sum(r.host_hit_tokens for r in res.replicas)
    assert res.device_hit_rate + res.host_hit_rate == pytest.approx(res.hit_rate)
    assert res.load_seconds == pytest.approx(sum(r.load_seconds for r in res.replicas))


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("host_pages", -1, "host_pages must be an int >= 0, got -1"),
        ("host_pages", 2.0, "host_pages must be an int >= 0, got 2.0"),
        ("host_pages", True, "host_pages must be an int >= 0, got True"),
        ("host_bandwidth", 0.0, "host_bandwidth must be a finite number > 0, got 0.0"),
        ("host_bandwidth", math.nan, "host_bandwidth must be a finite number > 0, got nan"),
        ("host_bandwidth", math.inf, "host_bandwidth must be a finite number > 0, got inf"),
        ("kv_bytes_per_token", 0, "kv_bytes_per_token must be an int >= 1, got 0"),
        ("kv_bytes_per_token", 1.5, "kv_bytes_per_token must be an int >= 1, got 1.5"),
    ],
)
def test_bad_host_settings_are_value_errors(field, value, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        ReplayConfig(**{field: value})


def test_a_tier_too_large_for_page_ids_is_refused_by_the_cache():
    cfg = ReplayConfig(num_pages=16, host_pages=2**31 - 16)
    with pytest.raises(ValueError, match="host_pages"):
        replay(three_requests(), cfg)


# --- the command line --------------------------------------------------------------------


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = cli.main(["replay", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def host_rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("host tier  "))
    rows = {}
    for line in lines[start + 3 :]:  # past the names, the units and the rule
        if line.startswith("hit rate = "):
            break
        rows[line.split()[0]] = line.split()
    return rows


def pct(text: str) -> float:
    return float(text.rstrip("%"))


def test_cli_host_pages_splits_the_hit_rate(capsys):
    common = [str(TRACE), "--limit", "1000", "--num-pages", "16384", "--no-chart"]
    rc, flat_out, _ = run([*common, "--policy", "lpm"], capsys)
    assert rc == 0
    rc, zero_out, _ = run([*common, "--policy", "lpm", "--host-pages", "0"], capsys)
    assert rc == 0
    # --host-pages 0 is the default: the output of the command without it, byte for byte.
    assert zero_out == flat_out and "host tier" not in flat_out
    rc, out, _ = run([*common, "--policy", "fcfs,lpm", "--host-pages", "65536"], capsys)
    assert rc == 0, out
    assert "host tier 65536 pages (1.05M tokens); loads at 25 GB/s, 131072 bytes/token" in out
    assert "a page (2048 KiB) loads in 83.9 us, 320.0 us to compute again" in out
    rows = host_rows(out)
    assert sorted(rows) == ["fcfs", "lpm"]
    policy_table = out.split("\nhost tier  ")[0].splitlines()
    policy_rows = {line.split()[0]: line.split() for line in policy_table if line.strip()}
    flat_rate = pct(next(line.split()[1] for line in flat_out.splitlines() if line[:4] == "lpm "))
    for name, (_, hit, dev, host, loaded, offloaded, _evicted, load) in rows.items():
        assert policy_rows[name][1] == hit  # the same hit rate as the policy table's
        assert pct(dev) + pct(host) == pytest.approx(pct(hit), abs=0.011)
        assert pct(host) > 0 and int(loaded) > 0 and int(offloaded) > 0
        assert float(load.rstrip("s")) > 0
    assert pct(rows["lpm"][1]) > flat_rate


def test_cli_host_pages_with_replicas(capsys):
    rc, out, _ = run(
        [str(TRACE), "--limit", "120", "--num-pages", "8192", "--no-chart",
         "--replicas", "2", "--router", "prefix", "--host-pages", "16384",
         "--host-bandwidth", "12.5", "--kv-bytes-per-token", "65536"],
        capsys,
    )  # fmt: skip
    assert rc == 0, out
    assert "host tier 16384 pages (0.26M tokens) each; loads at 12.5 GB/s, 65536" in out
    assert list(host_rows(out)) == ["prefix/lpm"]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--host-pages", "-1"], ["--host-pages", "got -1"]),
        (["--host-pages", "lots"], ["--host-pages", "'lots'"]),
        (["--host-pages", "1.5"], ["--host-pages", "'1.5'"]),
        (["--host-bandwidth", "0"], ["--host-bandwidth", "got 0"]),
        (["--host-bandwidth", "-25"], ["--host-bandwidth", "got -25"]),
        (["--host-bandwidth", "fast"], ["--host-bandwidth", "'fast'"]),
        (["--host-bandwidth", "nan"], ["--host-bandwidth", "got nan"]),
        (["--kv-bytes-per-token", "0"], ["--kv-bytes-per-token", "got 0"]),
        (["--kv-bytes-per-token", "128k"], ["--kv-bytes-per-token", "'128k'"]),
        (
            ["--num-pages", "1024", "--host-pages", str(2**31 - 1024)],
            ["--num-pages 1024 plus --host-pages 2147482624", "below 2**31"],
        ),
    ],
)
def test_cli_bad_host_flags_exit_2(argv, needles, capsys):
    rc, out, err = run([str(TRACE), "--limit", "5", "--no-chart", *argv], capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixkv: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_copy_kinds_are_the_documented_constants():
    # The replay tells loads from offloads by these; the log's rows are (kind, src, dst).
    assert (radixkv.COPY_OFFLOAD, radixkv.COPY_LOAD) == (0, 1)


# --- a window group with its host tier ----------------------------------------------------


def window_config(window_host: int) -> ReplayConfig:
    """``small_config``'s timing, a roomy full pool, and a window pool of 6 pages (two chunks'
    worth for an 8-token window) that B's prompt pushes A's window out of."""
    cfg = small_config(host_pages=20)
    cfg.num_pages, cfg.window, cfg.window_pages = 40, 8, 6
    cfg.window_host_pages = window_host
    return cfg


def test_a_window_pushed_out_comes_back_from_the_window_host_tier():
    reqs = three_requests()
    res, cache = replay_watched(reqs, window_config(window_host=10))
    # A again: every full page is on the device (40 pages), and its last window (pages 7-8 of
    # the 9 it can hit) came back from the window host tier.
    assert res.cached_tokens == 36, res
    stats = cache.stats
    assert stats.window_loaded_pages == 2 and stats.window_offloaded_pages > 0
    assert stats.window_cut_hits == 0
    # The loads were costed (as whole pages); nothing went to disk.
    assert res.load_seconds == pytest.approx(2 * small_config(20).page_load_seconds)
    assert res.disk_written_pages == 0 and res.loaded_pages == 0
    cache.check()
    # Without the window host tier the window is gone: the hit is cut, and the cut counted.
    flat, flat_cache = replay_watched(reqs, window_config(window_host=0))
    assert flat.cached_tokens < 36 and flat_cache.stats.window_cut_hits == 1
    assert flat.load_seconds == 0.0


def test_cli_window_host_pages(capsys):
    common = [str(TRACE), "--limit", "200", "--num-pages", "8192", "--no-chart"]
    args = [*common, "--window", "1024", "--window-pages", "512", "--host-pages", "4096"]
    rc, out, _ = run([*args, "--window-host-pages", "0"], capsys)
    assert rc == 0, out
    rc, out_host, _ = run([*args, "--window-host-pages", "4096"], capsys)
    assert rc == 0, out_host
    rc, out_default, _ = run(args, capsys)
    assert out_default == out_host  # the default is --host-pages
    lpm = lambda text: pct(next(ln.split()[1] for ln in text.splitlines() if ln[:4] == "lpm "))  # noqa: E731
    assert lpm(out_host) > lpm(out)
