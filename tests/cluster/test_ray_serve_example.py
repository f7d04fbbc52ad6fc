"""examples/ray_serve_router.py end to end: radixkv Engines as Ray Serve replicas on a local Ray
instance, behind the example's prefix-aware request router and a round-robin one.

The prefix router must beat round robin's token hit rate by a clear margin, keep each tenant on
one replica, and every request's output must equal a single engine's greedy output for the same
prompt (same model and seed, no prefix caching). A bad size is refused before Ray starts, and
a run that fails midway still shuts down the Ray instance the example started."""

from __future__ import annotations

import faulthandler
import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve] (requirements-cluster.txt)")
torch = pytest.importorskip("torch", reason="needs torch (the example's engines run on it)")
import ray  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_serve_router.py"

#: The whole example (Ray start, four replicas, two streams, Ray stop) takes ~20 s on a quiet
#: 2-core machine; past this the test process dumps every thread's stack and exits.
WATCHDOG_S = 300

torch.set_num_threads(1)


@pytest.fixture
def example():
    """The example module; the watchdog armed; Ray shut down afterwards, whatever happened."""
    spec = importlib.util.spec_from_file_location("ray_serve_router", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        yield module
    finally:
        faulthandler.cancel_dump_traceback_later()
        if ray.is_initialized():
            from ray import serve

            serve.shutdown()
            ray.shutdown()
        sys.modules.pop(spec.name, None)


def test_prefix_routing_beats_round_robin_with_identical_outputs(example, tmp_path):
    tenants, rounds, page_size, prefix_pages, max_new = 3, 4, 16, 6, 3
    report = example.main(
        [
            f"--tenants={tenants}",
            f"--rounds={rounds}",
            f"--page-size={page_size}",
            f"--prefix-pages={prefix_pages}",
            "--suffix-len=10",
            f"--max-new-tokens={max_new}",
            "--seed=3",
            f"--json={tmp_path / 'report.json'}",
        ]
    )
    assert not ray.is_initialized()  # the example stops the Ray instance it started
    stream = report["stream"]
    prefix, rr = report["prefix"], report["round_robin"]
    assert len(stream) == tenants * rounds
    for arm in (prefix, rr):
        assert len(arm.outputs) == len(stream)
        assert sum(s.requests for s in arm.replicas.values()) == len(stream)

    # Round robin sends each tenant to both replicas in turn (an odd number of tenants), and a
    # replica's pool cannot hold every tenant's prefix; the prefix router keeps each tenant on
    # one replica, where its prefix stays cached after its first request.
    assert len(rr.replicas) == 2 and len(prefix.replicas) == 2

    def replicas_of(arm, t):
        return {arm.served_by[i] for i in range(t, len(stream), tenants)}

    assert all(len(replicas_of(prefix, t)) == 1 for t in range(tenants))
    assert any(len(replicas_of(rr, t)) == 2 for t in range(tenants))
    assert prefix.hit_rate > 0.5, prefix.hit_rate
    assert prefix.hit_rate >= rr.hit_rate + 0.3, (prefix.hit_rate, rr.hit_rate)

    # Every output equals one engine's greedy run of that prompt, computed from scratch.
    reference = example.make_engine(3, num_pages=64, page_size=page_size, prefix_caching=False)
    for i, prompt in enumerate(stream):
        rid = reference.submit(prompt, max_new)
        (expected,) = reference.run([rid], release=True)
        assert len(expected.output) == max_new
        assert prefix.outputs[i] == expected.output, f"prefix arm, request {i}"
        assert rr.outputs[i] == expected.output, f"round-robin arm, request {i}"
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["stream"] == stream
    for name, arm in (("prefix", prefix), ("round_robin", rr)):
        assert saved[name]["hit_rate"] == pytest.approx(arm.hit_rate)
        assert saved[name]["served_by"] == arm.served_by


def test_pool_too_small_is_refused_before_ray_starts(example):
    with pytest.raises(ValueError, match=r"--pool-pages 3 cannot hold one request \(7 pages"):
        example.main(["--prefix-pages=6", "--page-size=16", "--pool-pages=3"])
    assert not ray.is_initialized()


def test_ray_is_shut_down_when_a_run_fails(example, monkeypatch):
    def failing_run_arm(handle, stream, max_new_tokens, window):
        raise RuntimeError("injected failure after the first deployment")

    monkeypatch.setattr(example, "run_arm", failing_run_arm)
    with pytest.raises(RuntimeError, match="injected failure"):
        example.main(["--tenants=2", "--rounds=1", "--prefix-pages=2"])
    assert not ray.is_initialized()
    from ray import cloudpickle

    assert example.__name__ not in cloudpickle.list_registry_pickle_by_value()
