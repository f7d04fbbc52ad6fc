"""What the GPU benches print about CUDA graphs (``benches/graph_counters.py``), read from real
engines: the counters, and the rule that a failed capture fails a bench's target line on any
device. On the CPU nothing is captured, and a capture tried there fails for real (no CUDA
stream), which is the failure counted; on a GPU a forward that syncs makes the capture fail."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import radixkv
from tiny_model import ids, tiny_model
from triton_device import DEVICE

pytestmark = pytest.mark.cuda

_PATH = Path(__file__).resolve().parents[2] / "benches" / "graph_counters.py"
_SPEC = importlib.util.spec_from_file_location("graph_counters", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
graph_counters = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(graph_counters)

MODEL = None


def model():
    global MODEL
    if MODEL is None:
        MODEL = tiny_model(seed=11, device=DEVICE)
    return MODEL


class SyncingModel:
    """The tiny model with a host sync in its forward: a capture of it fails."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, step, *args, **kw):
        torch.cuda.synchronize()
        return self.inner(step, *args, **kw)


def engine(m=None):
    kv = model().make_kv_cache(radixkv.RadixCache(256, page_size=4), attention="triton")
    return radixkv.Engine(m or model(), kv, cuda_graphs=True, max_batch=4)


def decode(eng, n=2):
    rng = np.random.default_rng(3)
    eng.generate([ids(rng, 6) for _ in range(n)], max_new_tokens=4)


def failed_engine():
    """An engine whose every bucket's capture failed, for real."""
    with pytest.warns(RuntimeWarning, match="decode graphs were not captured"):
        if DEVICE == "cuda":
            return engine(SyncingModel(model()))
        eng = engine()
        eng.graphs.capture_all()  # a CPU has no CUDA stream to capture on
        return eng


def test_the_counters_are_the_engines_own():
    eng = engine()
    decode(eng)
    g = eng.graphs
    c = graph_counters.counters([eng, object()])  # an engine without graphs adds nothing
    assert c["on"] == 1 and c["failed"] == 0 and c["reasons"] == []
    assert (c["captured"], c["replayed"], c["static"], c["eager"]) == (
        g.captures,
        g.graph_replays,
        g.replays,
        g.eager,
    )
    assert c["static"] > 0  # the decode steps ran on the graph buffers
    assert graph_counters.ok(c, DEVICE)
    line = graph_counters.line(c, DEVICE, "(test)")
    assert line.startswith("graphs (test): captured ") and "failed 0," in line
    assert "NOT captured" not in line
    if DEVICE != "cuda":  # nothing captured: not a figure a GPU bench may print as graphs
        assert not graph_counters.ok(c, "cuda")
        assert "NOT captured" in graph_counters.line(c, "cuda")


def test_a_failed_capture_fails_the_target_line_on_any_device():
    eng = failed_engine()
    decode(eng)
    g = eng.graphs
    c = graph_counters.counters([eng])
    assert c["failed"] == g.capture_failures == len(g.buckets) > 0
    assert c["reasons"] == g.failures and c["captured"] == 0
    assert not graph_counters.ok(c, DEVICE) and not graph_counters.ok(c, "cuda")
    line = graph_counters.line(c, DEVICE)
    assert f"failed {len(g.buckets)}," in line and "NOT captured" in line
    assert f"bucket {max(g.buckets)}" in line  # the first failure's reason, largest first
    # Summed with a clean engine's counters, the failure still fails the line.
    clean = engine()
    decode(clean)
    both = graph_counters.total([c, graph_counters.counters([clean])])
    assert both["failed"] == c["failed"] and both["on"] == 2
    assert not graph_counters.ok(both, DEVICE)
