"""Finished engine requests can be released, so a long-running engine's memory stays flat:
``run``/``generate`` with ``release=True``, ``Engine.release(ids)`` and
``Engine.forget_finished()``; a metrics exporter still counts every released request."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import radixkv
from tiny_model import dense_greedy, ids, tiny_model

pytestmark = pytest.mark.robust

MODEL = tiny_model(seed=8)


def engine(tokens: int = 1024) -> radixkv.Engine:
    return radixkv.Engine(MODEL, MODEL.make_kv_cache(radixkv.RadixCache(tokens)))


def test_generate_and_run_with_release_keep_nothing():
    eng = engine()
    rng = np.random.default_rng(0)
    prompts = [ids(rng, 8) for _ in range(3)]
    got = eng.generate(prompts, max_new_tokens=3, release=True)
    assert [r.output for r in got] == [dense_greedy(MODEL, p, 3) for p in prompts]
    assert eng.sequences == {}
    with pytest.raises(KeyError, match=f"no request with id {got[0].id}"):
        eng.result(got[0].id)
    ctx = ids(rng, 12)
    branch_ids = eng.branch(ctx, [[1], [2, 3]], max_new_tokens=2)
    eng.run(branch_ids, release=True)
    # Only the branch context (finished, never asked for) is left; forget_finished drops it.
    assert [s.finish_reason for s in eng.sequences.values()] == ["context"]
    assert eng.forget_finished() == 1 and eng.sequences == {}
    assert eng.cache.stats.used_pages == 0


def test_release_refuses_unfinished_or_unknown_ids_and_releases_nothing():
    eng = engine()
    rng = np.random.default_rng(1)
    (done,) = eng.generate([ids(rng, 5)], max_new_tokens=1)
    waiting = eng.submit(ids(rng, 5), max_new_tokens=2)
    with pytest.raises(ValueError, match=f"request {waiting} has not finished"):
        eng.release([done.id, waiting])
    with pytest.raises(KeyError, match="no request with id 99"):
        eng.release([done.id, 99])
    assert set(eng.sequences) == {done.id, waiting}
    assert eng.forget_finished() == 1 and set(eng.sequences) == {waiting}
    eng.run(release=True)
    assert eng.sequences == {} and not eng.has_work


def test_many_requests_leave_no_sequence_behind():
    """Without a release every finished request stays; with one, none does and the released
    sequences are freed (no reference cycle through branch contexts keeps them)."""
    eng = engine()
    rng = np.random.default_rng(2)
    refs = []
    for _ in range(20):
        ctx = ids(rng, 6)
        got = eng.run(eng.branch(ctx, [[1], [2]], max_new_tokens=1))
        refs += [weakref.ref(eng.sequences[r.id]) for r in got]
        eng.generate([ids(rng, 4)], max_new_tokens=1, release=True)
    assert len(eng.sequences) == 20 * 3  # branches and their contexts
    eng.forget_finished()
    assert eng.sequences == {}
    gc.collect()
    assert all(r() is None for r in refs)


def test_metrics_count_released_requests():
    pytest.importorskip("prometheus_client")
    from radixkv.metrics import CacheCollector

    eng = engine()
    collector = CacheCollector(eng.cache, engine=eng)
    rng = np.random.default_rng(3)
    prompts = [ids(rng, 6) for _ in range(5)]
    eng.generate(prompts[:2], max_new_tokens=1, release=True)  # released before any scrape
    eng.generate(prompts[2:], max_new_tokens=1)
    fams = {f.name: f for f in collector.collect()}
    (total,) = [
        s.value for s in fams["radixkv_engine_requests"].samples if s.name.endswith("total")
    ]
    assert total == 5
