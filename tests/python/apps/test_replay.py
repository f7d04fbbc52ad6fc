"""Trace parsing and replay: Mooncake expansion, radixkv JSONL, the simulation's bookkeeping."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from radixkv.apps.common.trace import TraceRequest, mooncake_tokens, read_trace
from radixkv.apps.replay.simulate import ReplayConfig, infinite_bound, replay

#: The Mooncake conversation trace as the project ships it (gzipped).
TRACE = Path(__file__).resolve().parents[3] / "benches/data/mooncake_conversation_trace.jsonl.gz"


def test_mooncake_blocks_expand_deterministically():
    t = mooncake_tokens([3, 0], 700)
    assert t.dtype == np.uint32 and len(t) == 700
    assert t[0] == 3 * 512 and t[511] == 3 * 512 + 511 and t[512] == 0 and t[699] == 187
    # Equal ids give equal blocks; different ids never collide.
    assert np.array_equal(mooncake_tokens([3], 512), t[:512])
    assert not np.intersect1d(mooncake_tokens([1], 512), mooncake_tokens([2], 512)).size
    with pytest.raises(ValueError, match="input_length 2000 exceeds 2 blocks"):
        mooncake_tokens([1, 2], 2000)


def test_radixkv_jsonl_tokens_and_text(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        json.dumps({"timestamp": 1.5, "tokens": [5, 6, 7], "output_length": 4, "namespace": "a"})
        + "\n\n"
        + json.dumps({"text": "hé"})
        + "\n"
    )
    a, b = read_trace(p)
    assert a.arrival == 1.5 and list(a.tokens) == [5, 6, 7] and a.output_length == 4
    assert a.namespace == "a"
    assert list(b.tokens) == list("hé".encode()) and b.arrival == 0.0
    p.write_text('{"tokens": [1]}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match="line 2: needs"):
        list(read_trace(p))
    p.write_text('{"tokens": [-1]}\n')
    with pytest.raises(ValueError, match="line 1: token ids"):
        list(read_trace(p))


def synthetic(sessions=6, turns=5, system=300, step=80):
    """Multi-turn sessions over one system prompt, arriving interleaved."""
    reqs = []
    rng = np.random.default_rng(1)
    for s in range(sessions):
        prompt = np.arange(system, dtype=np.uint32)
        for t in range(turns):
            prompt = np.concatenate([prompt, rng.integers(10_000, 1 << 30, step).astype(np.uint32)])
            reqs.append(
                TraceRequest(arrival=t * 2.0 + s * 0.01, tokens=prompt.copy(), output_length=8)
            )
    return reqs


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
@pytest.mark.parametrize("cache", ["radix", "block"])
def test_replay_accounts_for_every_token(policy, cache):
    reqs = synthetic()
    bound = infinite_bound(reqs, 16)
    big = replay(reqs, ReplayConfig(cache=cache, policy=policy, num_pages=4096, prefill_tps=1e5))
    assert big.requests == len(reqs) and big.dropped == 0
    assert (
        big.cached_tokens + big.computed_tokens
        == big.prompt_tokens
        == sum(len(r.tokens) for r in reqs)
    )
    # A pool that holds everything reaches the unbounded bound (block: full pages only).
    assert big.hit_rate == pytest.approx(bound, abs=0.02) and big.hit_rate > 0.5
    small = replay(reqs, ReplayConfig(cache=cache, policy=policy, num_pages=120, prefill_tps=1e5))
    assert small.evicted_pages > 0 and small.hit_rate < big.hit_rate
    assert all(w >= 0 for w in small.queue_waits) and len(small.ttfts) == small.requests


def test_gzipped_traces_read_like_plain_ones(tmp_path):
    lines = [json.dumps({"tokens": [i, i + 1], "output_length": i}) for i in range(5)]
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    packed = tmp_path / "t.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    renamed = tmp_path / "t.trace"  # no .gz suffix: found by gzip's magic bytes
    renamed.write_bytes(packed.read_bytes())
    want = [(list(r.tokens), r.output_length) for r in read_trace(plain)]
    assert len(want) == 5
    for path in (packed, renamed):
        assert [(list(r.tokens), r.output_length) for r in read_trace(path)] == want
    assert len(list(read_trace(packed, limit=2))) == 2


def test_prompts_larger_than_the_pool_are_dropped_not_hung():
    reqs = synthetic(sessions=1, turns=2)  # 380 and 460 prompt tokens, 8 output tokens
    res = replay(reqs, ReplayConfig(num_pages=20, page_size=16))
    assert res.dropped == 2 and res.requests == 0
    # 380 + 8 - 1 tokens fit 25 pages of 16, 460 + 8 - 1 do not.
    res = replay(reqs, ReplayConfig(num_pages=25, page_size=16))
    assert res.dropped == 1 and res.requests == 1 and len(res.ttfts) == 1


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_prompts_longer_than_the_budget_are_prefilled_in_chunks(policy):
    """Every prompt (380-700 tokens) exceeds the 128-token budget: admitted in part, extended
    over later batches; the accounting and the hit rate match a budget that never chunks."""
    reqs = synthetic()
    whole = replay(reqs, ReplayConfig(policy=policy, num_pages=4096, prefill_tps=1e5))
    cfg = ReplayConfig(policy=policy, num_pages=4096, prefill_tps=1e5, token_budget=128)
    chunked = replay(reqs, cfg)
    assert chunked.requests == len(reqs) == len(chunked.ttfts) and chunked.dropped == 0
    assert chunked.cached_tokens + chunked.computed_tokens == chunked.prompt_tokens
    assert chunked.hit_rate == pytest.approx(whole.hit_rate, abs=0.05)
    # Chunks interleave with other prompts: first tokens come later, never sooner.
    assert chunked.percentile("ttfts", 99) >= whole.percentile("ttfts", 99)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_a_chunk_the_pool_cannot_supply_waits_for_decodes(policy):
    """Prompts of 600 tokens with 300-token outputs in a pool of 960 tokens: one request decodes
    while the next one's prompt is computed in chunks until the pool runs short."""
    reqs = [
        TraceRequest(0.0, np.arange(i * 1000, i * 1000 + 600, dtype=np.uint32), 300)
        for i in range(4)
    ]
    cfg = ReplayConfig(num_pages=60, page_size=16, token_budget=256, policy=policy)
    res = replay(reqs, cfg)
    assert res.requests == 4 == len(res.ttfts) and res.dropped == 0
    assert res.computed_tokens == res.prompt_tokens == 2400
    # Each prompt's last chunk waits for the previous request's 6 s of decoding.
    assert sorted(res.ttfts)[-1] > 3 * 300 / cfg.decode_tps


def test_cli_replays_the_shipped_trace(tmp_path, capsys):
    from radixkv.apps import cli

    rc = cli.main(
        [
            "replay",
            str(TRACE),
            "--limit",
            "150",
            "--num-pages",
            "65536",
            "--policy",
            "fcfs,lpm",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "lpm" in out and "unbounded-cache bound" in out
    png = tmp_path / "replay_hit_rate.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def shared_prefix_trace(n: int = 12) -> list[TraceRequest]:
    """Requests sharing a 300-token prefix, so that every policy hits and lpm ties dfs-weight."""
    return [
        TraceRequest(0.01 * i, np.concatenate([np.arange(300), np.full(40, 1000 + i)]), 4)
        for i in range(n)
    ]


def test_replay_tables_give_every_column_a_unit():
    from radixkv.apps.replay.cmd import format_host_table, format_router_table, format_table
    from radixkv.apps.replay.simulate import replay_replicas

    reqs = shared_prefix_trace()
    cfg = ReplayConfig(num_pages=64, host_pages=32)
    one = replay(reqs, cfg)
    routed = replay_replicas(reqs, cfg, 2, "prefix")
    # (table, its units under the names, left to right; the label columns have none)
    cases = [
        (format_table([one], 0.5), ["%", "%", "tokens", "pages", "s", "s", "s", "s", "requests"]),
        (
            format_router_table([routed], 0.5),
            ["%", "%", "tokens", "pages", "s", "s", "ratio", "requests"],
        ),
        (format_host_table([one], ["lpm"]), ["%", "%", "%", "pages", "pages", "pages", "s"]),
    ]
    for table, units in cases:
        names, unit_line, rule = table.splitlines()[:3]
        assert unit_line.split() == units, table
        assert set(rule) == {"-"} and len(rule) == len(names)


def test_replay_chart_keeps_equal_curves_visible(tmp_path, monkeypatch):
    """lpm and dfs-weight often replay alike: the later curve is drawn dashed and narrower
    above the earlier one (both stay visible), and the legend says it equals it."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from radixkv.apps.replay.cmd import draw_chart

    reqs = shared_prefix_trace()
    results = [replay(reqs, ReplayConfig(num_pages=64, policy=p)) for p in ("lpm", "dfs-weight")]
    assert results[0].hit_curve == results[1].hit_curve and results[0].hit_rate > 0
    figures = []
    save = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    path = draw_chart(results, infinite_bound(reqs, 16), tmp_path / "chart.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    (ax,) = figures[0].axes
    lpm, dfs = (line for line in ax.get_lines() if not line.get_label().startswith("unbounded"))
    assert dfs.get_zorder() > lpm.get_zorder()
    assert dfs.get_linewidth() < lpm.get_linewidth() and dfs.get_linestyle() != lpm.get_linestyle()
    assert lpm.get_label().startswith("lpm: ") and dfs.get_label().endswith("(= lpm)")
