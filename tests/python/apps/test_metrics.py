"""`radixkv.metrics`: a real cache, scheduler and engine scraped over HTTP on 127.0.0.1; the
values are the cache's own counters at scrape time."""

import json
import re
import urllib.request

import numpy as np
import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import radixkv
from radixkv.apps import cli
from radixkv.apps.common import metrics_server
from radixkv.metrics import CacheCollector, serve


def scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                if s.labels
                else ""
            )
            samples[key] = s.value
    return text, samples


def workload(cache, n=6):
    system = np.arange(100, 612, dtype=np.uint32)
    for i in range(n):
        req = cache.admit(np.concatenate([system, np.full(40, 1000 + i, np.uint32)]))
        cache.commit(req, req.num_tokens)
        cache.finish(req)
    return cache.admit(system[:300])  # one live request pins its pages


@pytest.mark.parametrize("kind", ["radix", "block"])
def test_scrape_over_http_matches_the_cache(kind):
    cache = radixkv.RadixCache(4096, 1) if kind == "radix" else radixkv.BlockCache(400, 16)
    sched = radixkv.Scheduler(cache, "lpm")
    server = serve(CacheCollector(cache, scheduler=sched, labels={"worker": "w0"}), 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        _, before = scrape(url)
        assert before["radixkv_prefix_cache_queries_total{worker=w0}"] == 0
        live = workload(cache)
        cache.evict(3)
        for i in range(5):
            sched.add(np.arange(50 + i, dtype=np.uint32) + 7)
        sched.schedule(60, 1)  # admits one; the rest wait through this call
        sched.schedule(10_000)
        sched.add(np.arange(5, dtype=np.uint32))
        text, m = scrape(url)
        s = cache.stats
        # vLLM's meaning: queries and hits in tokens; admissions under their own name.
        assert m["radixkv_prefix_cache_queries_total{worker=w0}"] == s.query_tokens > 12
        assert m["radixkv_prefix_cache_hits_total{worker=w0}"] == s.hit_tokens > 0
        assert m["radixkv_prefix_cache_requests_total{worker=w0}"] == s.queries == 7 + 5
        assert m["radixkv_prefix_cache_query_tokens_total{worker=w0}"] == s.query_tokens
        assert m["radixkv_prefix_cache_hit_tokens_total{worker=w0}"] == s.hit_tokens
        usage = m["radixkv_kv_cache_usage_perc{worker=w0}"]
        assert usage == s.used_pages / s.num_pages and 0 < usage < 1
        assert m["radixkv_evicted_pages_total{worker=w0}"] == s.evicted_pages >= 3
        for state in ("free", "evictable", "used"):
            assert m[f"radixkv_kv_pages{{state={state},worker=w0}}"] == getattr(s, f"{state}_pages")
        assert s.used_pages > 0 and live.num_tokens == 300
        assert m["radixkv_scheduler_waiting{worker=w0}"] == 1
        # One admitted at once, four after one call passed them over.
        assert m["radixkv_scheduler_wait_calls_count{worker=w0}"] == 5
        assert m["radixkv_scheduler_wait_calls_bucket{le=0.0,worker=w0}"] == 1
        assert m["radixkv_scheduler_wait_calls_bucket{le=1.0,worker=w0}"] == 5
        assert m["radixkv_scheduler_wait_calls_sum{worker=w0}"] == 4
        assert "# TYPE radixkv_kv_pages gauge" in text
    finally:
        server.shutdown()
        server.server_close()


def test_collector_registers_and_checks_its_arguments():
    cache = radixkv.RadixCache(64)
    reg = CollectorRegistry()
    reg.register(CacheCollector(cache))
    assert b"radixkv_prefix_cache_hit_tokens_total 0.0" in generate_latest(reg)
    with pytest.raises(TypeError, match="cache must be a radixkv RadixCache or BlockCache"):
        CacheCollector(object())
    with pytest.raises(ValueError, match="'state' is not a usable label name"):
        CacheCollector(cache, labels={"state": "x"})
    with pytest.raises(ValueError, match="'9a' is not a usable label name"):
        CacheCollector(cache, labels={"9a": "x"})
    with pytest.raises(ValueError, match="port must be an int"):
        serve(None, 70000)


def test_engine_ttft_and_tokens():
    torch = pytest.importorskip("torch")
    from tiny_model import tiny_model

    model = tiny_model(seed=3)
    cache = radixkv.RadixCache(2048)
    engine = radixkv.Engine(model, model.make_kv_cache(cache), token_budget=256)
    reg = CollectorRegistry()
    reg.register(CacheCollector(cache, engine=engine))
    prompt = list(range(1, 200))
    results = engine.generate([prompt, [*prompt, 7, 8]], max_new_tokens=2)
    assert torch is not None
    text = generate_latest(reg).decode()
    m = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if not s.labels
    }
    assert m["radixkv_engine_requests_total"] == 2
    assert m["radixkv_engine_prompt_tokens_total"] == sum(r.prompt_tokens for r in results)
    assert m["radixkv_engine_cached_tokens_total"] == sum(r.cached_tokens for r in results)
    assert m["radixkv_engine_computed_tokens_total"] == sum(r.computed_tokens for r in results)
    assert m["radixkv_engine_time_to_first_token_seconds_count"] == 2
    assert m["radixkv_engine_time_to_first_token_seconds_sum"] == pytest.approx(
        sum(r.ttft_s for r in results)
    )
    assert m["radixkv_scheduler_waiting"] == 0  # the engine's own scheduler
    # A second scrape does not count the same requests twice.
    text2 = generate_latest(reg).decode()
    assert "radixkv_engine_requests_total 2.0" in text2


def test_replay_serves_metrics_per_policy(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": i * 0.1, "tokens": list(range(300)) + [1000 + i] * 20} for i in range(20)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    try:
        code = cli.main(
            ["replay", str(trace), "--policy", "fcfs,lpm", "--no-chart", "--metrics-port", "0"]
        )
        assert code == 0
        out = capsys.readouterr().out
        url = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", out).group(1)
        _, m = scrape(url)
        # The endpoint follows the last run: lpm, with its own counters.
        assert m["radixkv_prefix_cache_requests_total{policy=lpm}"] == 20
        assert m["radixkv_prefix_cache_queries_total{policy=lpm}"] == 20 * 320  # tokens
        assert m["radixkv_prefix_cache_hit_tokens_total{policy=lpm}"] > 0
        assert not any("policy=fcfs" in k for k in m)
    finally:
        for ep in list(metrics_server.RUNNING):
            ep.close()


def test_demo_serves_engine_metrics(tmp_path, capsys):
    pytest.importorskip("torch")
    try:
        code = cli.main(
            ["demo", "--quick", "--random", "--metrics-port", "0", "--out", str(tmp_path)]
        )
        assert code == 0
        out = capsys.readouterr().out
        url = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", out).group(1)
        _, m = scrape(url)
        # The endpoint follows the last run (caching off): every request finished, none hit.
        n = m["radixkv_engine_requests_total{run=no-cache}"]
        assert n >= 4
        assert m["radixkv_engine_time_to_first_token_seconds_count{run=no-cache}"] == n
        assert m["radixkv_engine_cached_tokens_total{run=no-cache}"] == 0
        assert m["radixkv_prefix_cache_hit_tokens_total{run=no-cache}"] == 0
        assert m["radixkv_engine_prompt_tokens_total{run=no-cache}"] > 0
    finally:
        for ep in list(metrics_server.RUNNING):
            ep.close()


def test_missing_extra_is_named(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import radixkv\n"
        "from radixkv.apps import cli\n"
        "try:\n"
        "    import radixkv.metrics\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        f"sys.exit(cli.main(['replay', {str(tmp_path / 'none.jsonl')!r}, '--no-chart', "
        "'--metrics-port', '0']))\n"
    )
    (tmp_path / "none.jsonl").write_text('{"tokens": [1, 2, 3]}\n')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "radixkv.metrics needs prometheus_client: pip install 'radixkv[metrics]'" in out.stdout
    # A user error: one line, exit status 2.
    err = out.stderr.strip().splitlines()
    assert len(err) == 1, out.stderr
    assert err[0].startswith(
        "radixkv: error: replay: --metrics-port: radixkv.metrics needs prometheus_client"
    )
    assert out.returncode == 2


# ---- the host tier --------------------------------------------------------------------------

#: The families a cache exports with no scheduler and no engine (the same with or without a
#: host tier), and those only a cache with a host tier adds.
BASE_FAMILIES = {
    "radixkv_prefix_cache_queries",
    "radixkv_prefix_cache_hits",
    "radixkv_prefix_cache_requests",
    "radixkv_kv_cache_usage_perc",
    "radixkv_prefix_cache_query_tokens",
    "radixkv_prefix_cache_hit_tokens",
    "radixkv_evicted_pages",
    "radixkv_kv_page_size_tokens",
    "radixkv_kv_pages",
    "radixkv_retentions",
    "radixkv_retained_evicted_pages",
    "radixkv_retentions_expired",
}
HOST_FAMILIES = {
    "radixkv_prefix_cache_host_hit_tokens",
    "radixkv_kv_host_pages",
    "radixkv_kv_offloaded_pages",
    "radixkv_kv_loaded_pages",
    "radixkv_kv_host_evicted_pages",
}

#: (kind, factory, prompt length): a small device pool under a smaller host tier, so pages go
#: down, come back and get dropped from the host.
TIERED = [
    pytest.param(lambda: radixkv.RadixCache(64, 1, host_pages=48), 40, id="radix"),
    pytest.param(lambda: radixkv.BlockCache(8, 16, host_pages=6), 48, id="block"),
]


def host_samples(m, labels="worker=w0"):
    """The host tier's samples of a scrape, by the stats field each must equal."""
    return {
        "host_hit_tokens": m[f"radixkv_prefix_cache_host_hit_tokens_total{{{labels}}}"],
        "host_free_pages": m[f"radixkv_kv_host_pages{{state=free,{labels}}}"],
        "host_cached_pages": m[f"radixkv_kv_host_pages{{state=cached,{labels}}}"],
        "offloaded_pages": m[f"radixkv_kv_offloaded_pages_total{{{labels}}}"],
        "loaded_pages": m[f"radixkv_kv_loaded_pages_total{{{labels}}}"],
        "host_evicted_pages": m[f"radixkv_kv_host_evicted_pages_total{{{labels}}}"],
    }


def host_stats(s):
    return {
        "host_hit_tokens": s.host_hit_tokens,
        "host_free_pages": s.host_free_pages,
        "host_cached_pages": s.host_pages - s.host_free_pages,
        "offloaded_pages": s.offloaded_pages,
        "loaded_pages": s.loaded_pages,
        "host_evicted_pages": s.host_evicted_pages,
    }


@pytest.mark.parametrize(("make", "length"), TIERED)
def test_host_tier_samples_match_the_cache(make, length):
    cache = make()
    server = serve(CacheCollector(cache, labels={"worker": "w0"}), 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        _, m = scrape(url)
        assert host_samples(m) == host_stats(cache.stats)
        assert m["radixkv_kv_host_pages{state=free,worker=w0}"] == cache.host_pages
        # Six distinct prompts through a pool that holds fewer: the older ones go to the host,
        # and the host tier, full, drops its least recently used pages.
        prompts = [np.arange(length, dtype=np.uint32) + 1000 * (i + 1) for i in range(6)]
        for p in prompts:
            req = cache.admit(p)
            cache.commit(req, req.num_tokens)
            cache.finish(req)
        # The oldest prompt still cached is on the host: a host hit, its pages loaded back.
        again = next(p for p in prompts if cache.match_prefix(p) > 0)
        live = cache.admit(again)
        assert len(cache.drain_copies()) > 0  # the owner of the tensors would copy these
        text, m = scrape(url)
        s = cache.stats
        assert host_samples(m) == host_stats(s)
        assert s.host_hit_tokens > 0 and s.loaded_pages > 0 and s.host_evicted_pages > 0
        assert s.offloaded_pages > s.loaded_pages and 0 < s.host_free_pages < s.host_pages
        assert m["radixkv_prefix_cache_hit_tokens_total{worker=w0}"] == s.hit_tokens
        assert m["radixkv_evicted_pages_total{worker=w0}"] == s.evicted_pages
        for state in ("free", "evictable", "used"):
            assert m[f"radixkv_kv_pages{{state={state},worker=w0}}"] == getattr(s, f"{state}_pages")
        assert live.num_tokens == length and s.used_pages > 0
        types = {f.name: f.type for f in text_string_to_metric_families(text)}
        assert {types[n] for n in HOST_FAMILIES - {"radixkv_kv_host_pages"}} == {"counter"}
        assert types["radixkv_kv_host_pages"] == "gauge"
        # reset empties the host tier: every host page was dropped.
        cache.finish(live)
        evicted_before = s.host_evicted_pages
        cache.reset()
        _, m = scrape(url)
        assert host_samples(m) == host_stats(cache.stats)
        assert m["radixkv_kv_host_pages{state=cached,worker=w0}"] == 0
        assert m["radixkv_kv_host_evicted_pages_total{worker=w0}"] > evicted_before
    finally:
        server.shutdown()
        server.server_close()


DISK_FAMILIES = {
    "radixkv_kv_disk_pages",
    "radixkv_kv_disk_written_pages",
    "radixkv_kv_disk_fetched_pages",
    "radixkv_kv_disk_evicted_pages",
    "radixkv_kv_disk_bad_pages",
}


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: radixkv.RadixCache(8, 4, 4, 32), id="radix"),
        pytest.param(lambda: radixkv.BlockCache(8, 4, 4, 32), id="block"),
    ],
)
def test_disk_tier_samples_match_the_cache(make):
    cache = make()
    collector = CacheCollector(cache, labels={"worker": "w0"})
    assert DISK_FAMILIES <= family_names(collector)
    assert not DISK_FAMILIES & family_names(CacheCollector(radixkv.RadixCache(8, 4, 4)))
    prompts = [np.arange(25, dtype=np.uint32) + 1000 * (i + 1) for i in range(4)]
    for p in prompts:  # through a pool and a host tier that hold one: the rest goes to disk
        req = cache.admit(p)
        cache.commit(req, req.num_tokens)
        cache.finish(req)
    cache.drain_copies()
    fetch = cache.disk_prefetch(prompts[0])
    assert fetch is not None
    cache.disk_confirm(fetch[0], 1, bad=True)
    s = cache.stats
    assert s.disk_written_pages > 0 and s.disk_fetched_pages == 1 and s.disk_bad_pages == 1
    text = generate_latest_of(collector)
    m = {
        (f.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    w = (("worker", "w0"),)
    assert m[("radixkv_kv_disk_pages", (("state", "free"), *w))] == s.disk_free_pages
    assert m[("radixkv_kv_disk_pages", (("state", "cached"), *w))] == (
        s.disk_pages - s.disk_free_pages
    )
    for field in ("written", "fetched", "evicted", "bad"):
        assert m[(f"radixkv_kv_disk_{field}_pages", w)] == getattr(s, f"disk_{field}_pages")


def generate_latest_of(collector):
    """The text exposition of a registry holding ``collector``."""
    reg = CollectorRegistry()
    reg.register(collector)
    return generate_latest(reg).decode()


def family_names(collector):
    """The families a registry holding ``collector`` exposes, by their exposed name."""
    return {f.name for f in text_string_to_metric_families(generate_latest_of(collector))}


@pytest.mark.parametrize("kind", ["radix", "block"])
def test_host_families_only_with_a_tier(kind):
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    plain = [cls(32, 4), cls(32, 4, host_pages=0)]
    for cache in plain:
        c = CacheCollector(cache)
        assert family_names(c) == BASE_FAMILIES
        assert {f.name for f in c.describe()} == BASE_FAMILIES
        text = generate_latest_of(c)
        assert not any(w in text for w in ("host", "offloaded", "loaded"))
    tiered = CacheCollector(cls(32, 4, host_pages=16))
    assert family_names(tiered) == BASE_FAMILIES | HOST_FAMILIES
    # describe() (used at registration, without a snapshot) names what collect() emits.
    assert {f.name for f in tiered.describe()} == BASE_FAMILIES | HOST_FAMILIES


def test_dashboard_and_alerts_query_exported_names():
    """Every radixkv series the Grafana dashboard and the alert rules query is one a collector
    with a host tier, a scheduler and an engine exports."""
    pytest.importorskip("torch")
    yaml = pytest.importorskip("yaml")
    from pathlib import Path

    from tiny_model import tiny_model

    model = tiny_model(seed=3)
    cache = radixkv.RadixCache(256, host_pages=64)
    engine = radixkv.Engine(model, model.make_kv_cache(cache), token_budget=64)
    text = generate_latest_of(CacheCollector(cache, engine=engine))
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    root = Path(__file__).resolve().parents[3] / "docs" / "grafana"
    board = json.loads((root / "radixkv.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    rules = yaml.safe_load((root / "alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    queried = {n for e in exprs for n in re.findall(r"\bradixkv_[a-z_]+", e)}
    assert "radixkv_kv_loaded_pages_total" in queried  # the host tier is on the dashboard
    assert queried <= exported, sorted(queried - exported)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_vllm_names_count_what_vllm_counts():
    """``hits / queries`` ported from a vLLM dashboard is the token hit rate, and the engine's
    running and waiting requests, preemptions, generated tokens, end-to-end latency and time
    per output token are there under vLLM's names, equal to what the engine reports."""
    pytest.importorskip("torch")
    from tiny_model import tiny_model

    model = tiny_model(seed=3)
    cache = radixkv.RadixCache(160)
    engine = radixkv.Engine(model, model.make_kv_cache(cache), token_budget=40)
    reg = CollectorRegistry()
    reg.register(CacheCollector(cache, engine=engine))

    def scrape_now():
        text = generate_latest(reg).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    rng = np.random.default_rng(8)
    sizes = (90, 30, 70, 12, 55)  # a pool of 160 tokens: decodes preempt one another
    ids_ = [engine.submit(rng.integers(1, 500, n).astype(np.uint32), 12) for n in sizes]
    m = scrape_now()
    assert (m["radixkv_num_requests_waiting"], m["radixkv_num_requests_running"]) == (5, 0)
    assert m["radixkv_generation_tokens_total"] == 0
    for _ in range(4):
        engine.step()
    m = scrape_now()
    running = len(engine.batcher.running)
    assert m["radixkv_num_requests_running"] == running > 0
    waiting = sum(engine.sequences[i].status.value == "waiting" for i in ids_)
    assert m["radixkv_num_requests_waiting"] == waiting == 5 - running
    live = sum(len(engine.sequences[i].output) for i in ids_)
    assert m["radixkv_generation_tokens_total"] == live > 0  # counted before requests finish
    results = engine.run(ids_)
    m = scrape_now()
    s = cache.stats
    assert m["radixkv_prefix_cache_hits_total"] / m["radixkv_prefix_cache_queries_total"] == (
        pytest.approx(s.hit_rate)
    )
    assert m["radixkv_num_preemptions_total"] == engine.stats.preemptions > 0  # a tiny pool
    assert m["radixkv_num_requests_running"] == m["radixkv_num_requests_waiting"] == 0
    assert m["radixkv_generation_tokens_total"] == sum(len(r.output) for r in results) == 60
    assert m["radixkv_e2e_request_latency_seconds_count"] == 5
    assert m["radixkv_e2e_request_latency_seconds_sum"] == pytest.approx(
        sum(r.latency_s for r in results)
    )
    tpot = [(r.latency_s - r.ttft_s) / (len(r.output) - 1) for r in results]
    assert m["radixkv_request_time_per_output_token_seconds_count"] == 5
    assert m["radixkv_request_time_per_output_token_seconds_sum"] == pytest.approx(sum(tpot))
    types = {f.name: f.type for f in text_string_to_metric_families(generate_latest(reg).decode())}
    assert types["radixkv_num_requests_running"] == types["radixkv_kv_cache_usage_perc"] == "gauge"
    assert types["radixkv_num_preemptions"] == types["radixkv_generation_tokens"] == "counter"
    assert types["radixkv_e2e_request_latency_seconds"] == "histogram"


def test_replay_keep_serving_serves_the_final_metrics_until_interrupted(tmp_path):
    """``--keep-serving``: the endpoint outlives the run (its last figures readable), and Ctrl-C
    (SIGINT) ends the command cleanly with exit status 0."""
    import signal
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": i * 0.1, "tokens": list(range(300)) + [1000 + i] * 20} for i in range(8)]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    argv = ["replay", str(trace), "--policy", "lpm", "--no-chart", "--metrics-port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv", *argv, "--keep-serving"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = []
        for line in proc.stdout:  # the run's output, then the line saying it keeps serving
            out.append(line)
            if "still serving" in line:
                break
        text = "".join(out)
        assert "still serving" in text and "hit rate" in text, text
        url = re.search(r"still serving (http://127\.0\.0\.1:\d+/metrics)", text).group(1)
        _, m = scrape(url)  # after the run: its final figures
        assert m["radixkv_prefix_cache_requests_total{policy=lpm}"] == 8
        assert m["radixkv_prefix_cache_queries_total{policy=lpm}"] == 8 * 320
        assert proc.poll() is None  # still serving
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


WINDOW_FAMILIES = {
    "radixkv_kv_window_pages",
    "radixkv_prefix_cache_window_cut_hits",
    "radixkv_prefix_cache_window_cut_tokens",
    "radixkv_kv_window_evicted_pages",
}
WINDOW_HOST_FAMILIES = {
    "radixkv_kv_window_host_used_pages",
    "radixkv_kv_window_offloaded_pages",
    "radixkv_kv_window_loaded_pages",
}


@pytest.mark.parametrize("kind", ["radix", "block"])
def test_window_group_samples_match_the_cache(kind):
    """A window group's families, only with one (its host tier's only with that), and their
    values the cache's after traffic that cuts hits and moves window pages to the host and
    back."""
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    assert not family_names(CacheCollector(cls(64, 4))) & (WINDOW_FAMILIES | WINDOW_HOST_FAMILIES)
    plain = CacheCollector(cls(64, 4, window=8, window_pages=16))
    assert family_names(plain) & (WINDOW_FAMILIES | WINDOW_HOST_FAMILIES) == WINDOW_FAMILIES
    for host in (0, 8):
        cache = cls(64, 4, host_pages=host, window=8, window_pages=16)
        collector = CacheCollector(cache, labels={"worker": "w0"})
        want = WINDOW_FAMILIES | (WINDOW_HOST_FAMILIES if host else set())
        assert family_names(collector) & (WINDOW_FAMILIES | WINDOW_HOST_FAMILIES) == want
        assert {f.name for f in collector.describe()} >= want
        prompts = [np.arange(30, dtype=np.uint32) + 1000 * (i + 1) for i in range(4)]
        for p in [*prompts, prompts[0]]:  # the first one's window is pushed out, then asked for
            req = cache.admit(np.concatenate([p, [7]]))
            cache.commit(req, req.num_tokens)
            cache.finish(req)
        cache.drain_copies()
        live = cache.admit(prompts[1][:20])
        s = cache.stats
        m = {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for f in text_string_to_metric_families(generate_latest_of(collector))
            for x in f.samples
        }
        w = (("worker", "w0"),)
        pages = {
            st: m[("radixkv_kv_window_pages", (("state", st), *w))]
            for st in ("free", "evictable", "used")
        }
        assert pages == {
            "free": s.window_free_pages,
            "evictable": s.window_evictable_pages,
            "used": s.window_pages - s.window_free_pages - s.window_evictable_pages,
        }
        assert pages["used"] > 0
        assert m[("radixkv_prefix_cache_window_cut_hits_total", w)] == s.window_cut_hits
        assert m[("radixkv_prefix_cache_window_cut_tokens_total", w)] == s.window_cut_tokens
        assert m[("radixkv_kv_window_evicted_pages_total", w)] == s.window_evicted_pages
        if host:
            assert s.window_loaded_pages > 0 and s.window_cut_hits == 0, s
            assert m[("radixkv_kv_window_host_used_pages", w)] == s.window_host_used_pages
            assert m[("radixkv_kv_window_offloaded_pages_total", w)] == s.window_offloaded_pages
            assert m[("radixkv_kv_window_loaded_pages_total", w)] == s.window_loaded_pages
        else:
            assert s.window_cut_hits > 0, s
        cache.abort(live)


def test_inter_token_latency_queue_time_and_a_model_name_label_as_vllm():
    """vLLM's ``inter_token_latency_seconds`` (one sample per gap between two tokens) and
    ``request_queue_time_seconds`` (submission to first admission), with its ``model_name``
    label on every sample."""
    pytest.importorskip("torch")
    from tiny_model import tiny_model

    model = tiny_model(seed=3)
    cache = radixkv.RadixCache(512)
    engine = radixkv.Engine(model, model.make_kv_cache(cache), token_budget=64, max_batch=2)
    reg = CollectorRegistry()
    reg.register(CacheCollector(cache, engine=engine, labels={"model_name": "tiny"}))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 500, n).astype(np.uint32) for n in (40, 30, 20)]
    results = engine.generate(prompts, max_new_tokens=5)  # max_batch 2: the third one waits
    samples = [
        s for f in text_string_to_metric_families(generate_latest(reg).decode()) for s in f.samples
    ]
    assert all(s.labels.get("model_name") == "tiny" for s in samples)
    m = {s.name: s.value for s in samples if "le" not in s.labels}
    assert m["radixkv_inter_token_latency_seconds_count"] == sum(len(r.output) - 1 for r in results)
    gaps = sum(r.latency_s - r.ttft_s for r in results)
    assert 0 < m["radixkv_inter_token_latency_seconds_sum"] <= gaps
    assert m["radixkv_request_queue_time_seconds_count"] == 3
    queued = [r.queue_s for r in results]
    assert all(0 <= q <= r.ttft_s for q, r in zip(queued, results))
    assert m["radixkv_request_queue_time_seconds_sum"] == pytest.approx(sum(queued))
    assert queued[2] > queued[0]  # admitted once a slot freed


STATE_FAMILIES = {
    "radixkv_state_slots",
    "radixkv_prefix_cache_state_hit_tokens",
    "radixkv_taken_states",
    "radixkv_evicted_states",
}


@pytest.mark.parametrize("kind", ["radix", "block"])
def test_state_slot_samples_match_the_cache(kind):
    """The state slots' families, only with state slots, and their values the cache's after
    traffic that takes snapshots, hits one (pinned while restoring) and evicts others."""
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    assert not family_names(CacheCollector(cls(64, 4))) & STATE_FAMILIES
    cache = cls(64, 4, state_slots=3)
    collector = CacheCollector(cache, labels={"worker": "w0"})
    assert family_names(collector) & STATE_FAMILIES == STATE_FAMILIES
    assert {f.name for f in collector.describe()} >= STATE_FAMILIES
    prompts = [np.arange(16, dtype=np.uint32) + 100 * (i + 1) for i in range(4)]
    for p in prompts:  # four snapshots into three slots: one is evicted
        req = cache.admit(p)
        assert cache.take_state(req, 16) is not None
        cache.commit(req, 16)
        cache.finish(req)
    live = cache.admit(np.concatenate([prompts[3], [7, 8, 9, 10]]))  # a hit, pinned
    assert live.state_slot is not None and live.num_cached == 16
    s = cache.stats
    assert s.evicted_states > 0 and s.state_pinned_slots == 1
    m = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(generate_latest_of(collector))
        for x in f.samples
    }
    w = (("worker", "w0"),)
    slots = {
        st: m[("radixkv_state_slots", (("state", st), *w))] for st in ("free", "pinned", "held")
    }
    assert slots == {
        "free": s.state_free_slots,
        "pinned": s.state_pinned_slots,
        "held": s.state_slots - s.state_free_slots - s.state_pinned_slots,
    }
    assert slots["pinned"] == 1 and slots["held"] == 2
    assert m[("radixkv_prefix_cache_state_hit_tokens_total", w)] == s.state_hit_tokens == 16
    assert m[("radixkv_taken_states_total", w)] == s.taken_states == 4
    assert m[("radixkv_evicted_states_total", w)] == s.evicted_states
    cache.abort(live)
