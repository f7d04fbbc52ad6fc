"""Decode steps over fixed-address buffers (what CUDA graphs replay): the same greedy tokens as
eager steps as lengths grow, requests join and leave the batch across buckets, pages are
evicted and preempted, and the buffers grow; a stale step is refused before anything is
written. On the CPU the static-buffer steps run without capture (under Triton's interpreter);
on a GPU the same tests capture and replay graphs, and one checks that a replay never syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from radixkv.engine.graphs import buckets
from tiny_model import dense_greedy, ids, tiny_model
from triton_device import DEVICE

pytestmark = pytest.mark.cuda

MODEL = None


def model():
    global MODEL
    if MODEL is None:
        MODEL = tiny_model(seed=11, device=DEVICE)
    return MODEL


def engine(graphs, pages=1024, page_size=4, host_pages=0, **kw):
    cache = radixkv.RadixCache(pages, page_size=page_size, host_pages=host_pages)
    kv = model().make_kv_cache(cache, attention="triton")
    return radixkv.Engine(model(), kv, cuda_graphs=graphs, **kw)


def drive(eng, rng_seed=0):
    """Requests join while others decode and leave at different lengths; a branch; then the
    first prompt again, after all that (a hit on whatever of it is still cached)."""
    rng = np.random.default_rng(rng_seed)
    system = ids(rng, 30)
    prompts = [np.concatenate([system, ids(rng, n)]) for n in (3, 11, 1)]
    first = [eng.submit(p, max_new_tokens=m) for p, m in zip(prompts, (9, 4, 14))]
    for _ in range(4):
        eng.step()
    late = [eng.submit(ids(rng, n), max_new_tokens=m) for n, m in ((7, 6), (2, 11), (20, 3))]
    eng.step()
    context = np.concatenate([system, ids(rng, 4)])
    kids = eng.branch(context, [ids(rng, 2), ids(rng, 5)], max_new_tokens=5)
    eng.run()
    again = eng.submit(prompts[0], max_new_tokens=6)
    eng.run()
    return [eng.result(i).output for i in (*first, *late, *kids, again)]


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.parametrize("page_size", [1, 16])
def test_tokens_equal_eager_as_the_batch_changes(page_size):
    want = drive(engine(False, page_size=page_size, max_batch=8))
    eng = engine(True, page_size=page_size, max_batch=8)
    assert drive(eng) == want
    g = eng.graphs
    assert g.replays > 10 and g.eager > 0  # prefills stay eager
    assert len(g._steps) >= 3  # several buckets served
    # A graph replayed is counted apart from a step on the static buffers: on CUDA every step
    # after a bucket's capture replays; on the CPU nothing is captured and nothing replays.
    if DEVICE == "cuda":  # every bucket captured when the engine was made, none since
        assert g.failed is None and g.captures == len(g.buckets)
        assert g.graph_replays == g.replays > 0
    else:
        assert g.captures == 0 and g.graph_replays == 0
    eng.cache.check()


def test_tokens_equal_eager_under_eviction_and_preemption():
    """A pool too small for every request at once: pages are evicted and requests preempted
    between graph steps."""
    want = drive(engine(False, pages=24, page_size=4, max_batch=6), rng_seed=1)
    eng = engine(True, pages=24, page_size=4, max_batch=6)
    assert drive(eng, rng_seed=1) == want
    assert eng.batcher.preemptions > 0 or eng.cache.stats.evicted_pages > 0


def test_tokens_equal_eager_with_host_tier_loads():
    """A prompt's pages are offloaded to the host tier by two others, then loaded back for its
    follow-up, between graph steps."""

    def run(eng):
        rng = np.random.default_rng(7)
        a = ids(rng, 40)
        outs = [r.output for r in eng.generate([a], max_new_tokens=4)]
        outs += [r.output for r in eng.generate([ids(rng, 40), ids(rng, 36)], max_new_tokens=4)]
        outs += [
            r.output for r in eng.generate([np.concatenate([a, ids(rng, 3)])], max_new_tokens=6)
        ]
        return outs

    want = run(engine(False, pages=24, page_size=4, host_pages=64, max_batch=4))
    eng = engine(True, pages=24, page_size=4, host_pages=64, max_batch=4)
    assert run(eng) == want
    stats = eng.cache.stats
    assert stats.offloaded_pages > 0 and stats.loaded_pages > 0, stats
    assert eng.graphs.replays > 0


def test_buffers_are_sized_once_from_the_pool():
    """The buffers hold the longest request the pool allows from the start: a long request
    neither grows them nor (on CUDA) captures anything again."""
    from radixkv.engine.graphs import buffer_pages

    eng = engine(True, pages=256, page_size=1, max_batch=2)
    g = eng.graphs
    buffers, captures = g.buffers, g.captures
    assert buffers.max_pages == buffer_pages(eng.kv, model()) == 256
    rng = np.random.default_rng(2)
    prompt = ids(rng, 40)  # 40 pages of one slot
    out = eng.generate([prompt], max_new_tokens=4)[0].output
    assert out == dense_greedy(model(), prompt, 4)
    assert g.buffers is buffers and g.captures == captures and g.replays > 0


def test_buffer_pages_and_capture_order():
    from types import SimpleNamespace

    from radixkv.engine.graphs import buffer_pages, capture_order

    kv = SimpleNamespace(num_pages=10_000, page_size=16)
    assert buffer_pages(kv, object()) == 10_000  # no context known: the pool
    ctx = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))
    assert buffer_pages(kv, ctx) == 512  # the model's context, in pages
    ctx.config.max_position_embeddings = 8193
    assert buffer_pages(kv, ctx) == 513
    kv.num_pages = 100
    assert buffer_pages(kv, ctx) == 100  # the pool, when smaller
    assert capture_order(buckets(20)) == [20, 16, 8, 4, 2, 1]


def test_a_graph_step_builds_no_device_plan():
    """A decode step through the graphs reads its plan from the fixed buffers: the planned
    step's own device tensors and backend groups are never built. A step longer than the
    buffers, or past the largest bucket, runs eagerly instead."""
    from radixkv.engine.graphs import DecodeGraphs

    m = model()
    cache = radixkv.RadixCache(64, page_size=4)
    kv = m.make_kv_cache(cache, attention="triton")
    graphs = DecodeGraphs(m, kv, max_batch=2)
    rng = np.random.default_rng(6)
    reqs = [cache.admit(ids(rng, n)) for n in (5, 9)]
    step = kv.plan(reqs)
    m(step)
    kv.commit(step)
    for r in reqs:
        cache.extend(r, [5])
    step = kv.plan(reqs)
    assert graphs.fits(step)
    graphs.run(step)
    assert not step.built
    kv.commit(step)
    for r in reqs:
        cache.extend(r, [6])
    step = kv.plan(reqs)
    graphs.buffers.max_pages = step.max_pages - 1  # as if the buffers were narrower
    assert not graphs.fits(step) and graphs.eager == 1
    three = kv.plan([*reqs, cache.admit(ids(rng, 1))])
    assert not graphs.fits(three) and graphs.eager == 2  # a prefill in it, past the bucket


def test_a_stale_step_is_refused_before_anything_is_written():
    from radixkv.engine.graphs import DecodeGraphs

    m = model()
    cache = radixkv.RadixCache(64, page_size=4)
    kv = m.make_kv_cache(cache, attention="triton")
    graphs = DecodeGraphs(m, kv, max_batch=2)
    r = cache.admit(ids(np.random.default_rng(3), 9))
    step = kv.plan([r])
    m(step)
    kv.commit(step)
    cache.extend(r, [5])
    step = kv.plan([r])
    assert step.is_decode
    graphs.run(step)  # a bucket made, buffers filled
    fields = graphs.buffers.host.clone()
    pools = [t.clone() for t in kv.k]
    cache.extend(r, [6])  # the step is stale now
    with pytest.raises(radixkv.StaleStepError):
        graphs.run(step)
    assert torch.equal(graphs.buffers.host, fields)
    assert all(torch.equal(p, t) for p, t in zip(pools, kv.k))


def test_hf_model_through_the_static_steps():
    pytest.importorskip("transformers")
    import radixkv.hf
    from hf_models import build_model

    hf = build_model("llama", seed=5).eval().to(DEVICE)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).astype(np.uint32) for n in (19, 6, 3)]
    outs = {}
    for graphs in (False, True):
        eng = radixkv.hf.engine(
            hf, radixkv.RadixCache(256, page_size=4), token_budget=32, attention="triton",
            cuda_graphs=graphs,
        )  # fmt: skip
        outs[graphs] = [r.output for r in eng.generate(prompts, max_new_tokens=5)]
    assert outs[True] == outs[False]
    assert eng.graphs is not None and eng.graphs.replays > 0


def test_where_graphs_cannot_run_it_says_why():
    m = model()
    sdpa = m.make_kv_cache(radixkv.RadixCache(64, page_size=4), attention="sdpa")
    with pytest.raises(ValueError, match="its attention is 'sdpa'"):
        radixkv.Engine(m, sdpa, cuda_graphs=True)
    assert radixkv.Engine(m, sdpa).graphs is None  # default: off where they cannot run
    with pytest.raises(ValueError, match="cuda_graphs must be None, True or False"):
        radixkv.Engine(m, sdpa, cuda_graphs="yes")
    triton = m.make_kv_cache(radixkv.RadixCache(64, page_size=4), attention="triton")
    default = radixkv.Engine(m, triton)
    assert (default.graphs is not None) == (DEVICE == "cuda")


@pytest.mark.skipif(DEVICE != "cuda", reason="captures CUDA graphs")
def test_cuda_replays_never_sync():
    eng = engine(True, max_batch=4)
    rng = np.random.default_rng(4)
    reqs = [eng.submit(ids(rng, n), max_new_tokens=20) for n in (5, 9, 2)]
    for _ in range(4):  # prefill, then decode steps that capture the bucket
        eng.step()
    assert eng.graphs.captures >= 1
    seqs = [eng._get(i) for i in reqs]
    step = eng.kv.plan([s.req for s in seqs])
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = eng.graphs.run(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eng.kv.commit(step)
    assert logits.shape[0] == 3


@pytest.mark.skipif(DEVICE != "cuda", reason="counts CUDA synchronizations")
def test_a_graph_decode_step_waits_for_the_device_once():
    """A whole engine decode step through a graph: plan, one copy in, replay, sampling, commit,
    with one synchronizing operation (the tokens and NaN flags coming back)."""
    import warnings

    eng = engine(True, max_batch=4)
    rng = np.random.default_rng(5)
    for n in (5, 9, 2):
        eng.submit(ids(rng, n), max_new_tokens=20)
    for _ in range(4):  # prefill, then decode steps that capture the bucket
        eng.step()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.skipif(DEVICE != "cuda", reason="captures CUDA graphs")
def test_every_bucket_is_captured_when_the_engine_is_made():
    eng = engine(True, max_batch=20)
    g = eng.graphs
    assert g.failed is None and g.capture_failures == 0
    assert sorted(g._graphs) == g.buckets == [1, 2, 4, 8, 16, 20]
    assert g.captures == len(g.buckets) and g.replays == 0


class SyncingModel:
    """The tiny model with a host sync in its forward: what the warm-up must catch."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, step, *args, **kw):
        torch.cuda.synchronize()
        return self.inner(step, *args, **kw)


@pytest.mark.skipif(DEVICE != "cuda", reason="captures CUDA graphs")
def test_a_failed_capture_is_counted_and_decodes_eagerly():
    m = SyncingModel(model())
    kv = model().make_kv_cache(radixkv.RadixCache(256, page_size=4), attention="triton")
    with pytest.warns(RuntimeWarning, match="decode graphs were not captured"):
        eng = radixkv.Engine(m, kv, cuda_graphs=True, max_batch=4)
    g = eng.graphs
    assert g.capture_failures == len(g.buckets) == len(g.failures) and g.captures == 0
    assert "bucket 4" in g.failed
    prompt = ids(np.random.default_rng(8), 7)
    assert eng.generate([prompt], max_new_tokens=5)[0].output == dense_greedy(model(), prompt, 5)
    assert g.graph_replays == 0 and g.eager > 0
