"""Failures while the engine packs a step or ends a request, and the no-progress guard.

Nothing reachable from the public API makes the cache calls of :mod:`radixkv.engine.batcher`
raise (the engine checks every argument first), so the failures are injected: the batcher's
cache and scheduler are wrapped in :class:`Faulty`, which delegates every call to the real Rust
object and raises a chosen exception on the calls a predicate picks. A genuinely stuck queue is
built through the public API: a request opened directly on the engine's cache pins the pool.

Checked: the request whose call raised ends with ``finish_reason="error"`` and that exception,
every other request's output equals a dense greedy recompute, ``cache.check()`` passes and every
page comes back; a bug (an unexpected exception) propagates and the next ``run()`` works.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable

import numpy as np
import pytest

import radixkv
from tiny_model import CACHES, dense_greedy, ids, tiny_model

pytestmark = pytest.mark.robust

MODEL = tiny_model(seed=11)
MAX_STEPS = 300  # every run here takes far fewer


class Faulty:
    """``real`` (a cache or scheduler) whose methods named in ``faults`` raise: ``faults`` maps
    a method name to ``(exception, when)``, and the call raises when ``when(call_number,
    *args)`` is true (call numbers count from 1, per method; ``when`` None: every call). Every
    other attribute and call goes to ``real``. The raising frame keeps no reference to the
    arguments (a request referenced by the exception's traceback would stay open)."""

    def __init__(self, real, **faults: tuple[Exception, Callable[..., bool] | None]) -> None:
        self._real, self._faults = real, faults
        self.calls = dict.fromkeys(faults, 0)
        self.raised = dict.fromkeys(faults, 0)

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self._faults:
            return attr
        exc, when = self._faults[name]

        def call(*args, **kwargs):
            self.calls[name] += 1
            if when is not None and not when(self.calls[name], *args):
                return attr(*args, **kwargs)
            del args, kwargs
            self.raised[name] += 1
            raise exc

        return call


def engine(make_cache=CACHES[0].values[0], tokens=2048, **kw) -> radixkv.Engine:
    eng = radixkv.Engine(MODEL, MODEL.make_kv_cache(make_cache(tokens)), **kw)
    step, count = eng.step, [0]

    def counted():
        count[0] += 1
        assert count[0] <= MAX_STEPS, f"run() did not return within {MAX_STEPS} steps"
        return step()

    eng.step = counted
    eng.steps_taken = count
    return eng


def inject(eng: radixkv.Engine, target: str, method: str, exc: Exception, when=None) -> Faulty:
    """Wraps the batcher's ``target`` (``"cache"`` or ``"scheduler"``) in a :class:`Faulty`
    whose ``method`` raises ``exc`` (on the calls ``when`` picks)."""
    faulty = Faulty(getattr(eng.batcher, target), **{method: (exc, when)})
    setattr(eng.batcher, target, faulty)
    return faulty


def holds(eng: radixkv.Engine, seq_id: int) -> Callable[..., bool]:
    """A predicate: the call's first argument is (or lists) the open request of ``seq_id``."""

    def pick(n, first, *rest) -> bool:
        req = eng.sequences[seq_id].req
        reqs = first if isinstance(first, list) else [first]
        return req is not None and any(r is req for r in reqs)

    return pick


def drained(eng: radixkv.Engine) -> None:
    gc.collect()  # a request whose abort failed is aborted when garbage-collected
    eng.cache.check()
    assert not eng.has_work and eng.cache.stats.used_pages == 0


def prompts(seed: int, k: int = 3, n: int = 30) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [ids(rng, n + 7 * i) for i in range(k)]


ERRORS = [
    radixkv.OutOfPages("injected: no pages"),
    radixkv.InvalidRequest("injected: closed request"),
    ValueError("injected: bad value"),
]


@pytest.mark.parametrize("exc", ERRORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("make_cache", CACHES)
def test_a_failing_extend_fails_that_request_alone(make_cache, exc):
    """``extend_many`` raises whenever it holds request 1's request (a prefill chunk or a
    decode): request 1 fails once it has generated 2 tokens, the others run on."""
    eng = engine(make_cache, token_budget=24, max_batch=4)
    ps = prompts(1)
    got = [eng.submit(p, max_new_tokens=6) for p in ps]
    victim = holds(eng, got[1])
    faulty = inject(
        eng,
        "cache",
        "extend_many",
        exc,
        lambda n, *a: len(eng.sequences[got[1]].output) >= 2 and victim(n, *a),
    )
    results = eng.run(got)
    # The batch call raised, then the one-by-one retry found request 1 at fault.
    assert faulty.raised == {"extend_many": 2}
    bad = results[1]
    assert bad.finish_reason == "error" and bad.error is exc
    assert bad.output == dense_greedy(MODEL, ps[1], 6)[:2]
    for r, p in zip(results, ps):
        if r is not bad:
            assert r.finish_reason == "length" and r.error is None
            assert r.output == dense_greedy(MODEL, p, 6)
    drained(eng)


def test_a_failing_extend_is_reported_by_the_step_that_met_it():
    eng = engine(token_budget=64)
    a, b = (eng.submit(p, max_new_tokens=4) for p in prompts(2, k=2))
    eng.step()  # both admitted and prefilled; b decodes next
    inject(eng, "cache", "extend_many", radixkv.InvalidRequest("injected"), holds(eng, b))
    out = eng.step()
    assert [(r.id, r.finish_reason) for r in out] == [(b, "error")]
    assert eng.sequences[b].req is None and eng.batcher.running == [eng.sequences[a]]
    assert eng.run([a])[0].finish_reason == "length"
    drained(eng)


@pytest.mark.parametrize("also_abort", [False, True], ids=["abort-works", "abort-fails-too"])
def test_a_failing_finish_aborts_the_request(also_abort):
    """``finish`` raises for request 0: it ends with ``"error"`` and that exception, its
    request aborted (if that abort raises too, the abort is made again before ``run()``
    returns); the other requests finish."""
    eng = engine(token_budget=64)
    ps = prompts(3)
    got = [eng.submit(p, max_new_tokens=3) for p in ps]
    exc = radixkv.InvalidRequest("injected: finish")
    faults = {"finish": (exc, holds(eng, got[0]))}
    if also_abort:
        faults["abort"] = (ValueError("injected: abort"), holds(eng, got[0]))
    faulty = eng.batcher.cache = Faulty(eng.batcher.cache, **faults)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        results = eng.run(got)
        gc.collect()
    assert faulty.raised == dict.fromkeys(faults, 1)
    # Closed by the engine, not left for the garbage collector to find open.
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert eng.cache.stats.used_pages == 0
    assert results[0].finish_reason == "error" and results[0].error is exc
    assert results[0].output == dense_greedy(MODEL, ps[0], 3)  # generated before finish
    assert [r.finish_reason for r in results[1:]] == ["length", "length"]
    for r, p in zip(results[1:], ps[1:]):
        assert r.output == dense_greedy(MODEL, p, 3)
    drained(eng)


def test_a_branch_the_scheduler_refuses_fails_alone():
    """``Scheduler.add`` raises when the second branch is queued (the context is computed and
    held): that branch fails, its siblings get their outputs."""
    eng = engine(token_budget=64)
    ctx = ids(np.random.default_rng(4), 40)
    tails = [[1, 2], [3, 4], [5]]
    exc = ValueError("injected: refused")
    faulty = inject(eng, "scheduler", "add", exc, lambda n, *a: n == 3)  # 1: context, 2-4: branches
    got = eng.branch(ctx, tails, max_new_tokens=3)
    results = eng.run(got)
    assert faulty.raised == {"add": 1}
    assert results[1].finish_reason == "error" and results[1].error is exc
    assert results[1].output == []
    for k in (0, 2):
        want = dense_greedy(MODEL, np.concatenate([ctx, np.asarray(tails[k], np.uint32)]), 3)
        assert results[k].output == want and results[k].finish_reason == "length"
    drained(eng)


def test_a_preempted_request_the_scheduler_refuses_fails_alone():
    """A pool so small that requests preempt each other; every re-queue of a preempted request
    is refused: those requests fail, the rest finish with the right outputs."""
    eng = engine(CACHES[0].values[0], tokens=90, token_budget=32)
    ps = prompts(5, k=4, n=20)
    got = [eng.submit(p, max_new_tokens=8) for p in ps]
    exc = radixkv.OutOfPages("injected: refused again")
    inject(eng, "scheduler", "add", exc)  # every later add: only re-queues
    results = eng.run(got)
    failed = [r for r in results if r.finish_reason == "error"]
    assert failed and all(r.error is exc and r.preemptions == 1 for r in failed)
    for r, p in zip(results, ps):
        want = dense_greedy(MODEL, p, 8)
        assert r.output == (want if r.finish_reason == "length" else want[: len(r.output)])
    assert any(r.finish_reason == "length" for r in results)
    drained(eng)


def test_a_failing_schedule_admits_nothing_then_the_guard_reports_it():
    """``Scheduler.schedule`` raising concerns no request: the running ones run on, the waiting
    ones wait; once nothing else runs, the no-progress guard fails them with a
    ``radixkv.Error`` naming them whose cause is the scheduler's exception."""
    eng = engine(token_budget=64, max_batch=1)
    eng.max_stalled_steps = 5
    ps = prompts(6)
    first = eng.submit(ps[0], max_new_tokens=3)
    eng.step()  # the first request is admitted
    exc = radixkv.InvalidRequest("injected: schedule")
    faulty = inject(eng, "scheduler", "schedule", exc)
    rest = [eng.submit(p, max_new_tokens=3) for p in ps[1:]]
    results = eng.run([first, *rest])
    assert results[0].finish_reason == "length" and faulty.raised["schedule"] > 0
    assert results[0].output == dense_greedy(MODEL, ps[0], 3)
    for r in results[1:]:
        assert r.finish_reason == "error" and isinstance(r.error, radixkv.Error)
        assert f"request {r.id} made no progress in 5 steps" in str(r.error)
        assert "waits for admission" in str(r.error) and "InvalidRequest" in str(r.error)
        assert r.error.__cause__ is exc
    drained(eng)
    eng.batcher.scheduler = faulty._real  # the scheduler works again: so does the engine
    (r,) = eng.generate([ps[1]], max_new_tokens=3)
    assert r.output == dense_greedy(MODEL, ps[1], 3)


@pytest.mark.parametrize(
    ("target", "method"), [("cache", "extend_many"), ("scheduler", "schedule")]
)
def test_a_bug_propagates_and_the_engine_stays_usable(target, method):
    """An unexpected exception while a step is packed propagates; what was packed is put
    back in the queue, and the next ``run()`` gives every request its right output."""
    eng = engine(token_budget=40)
    ps = prompts(7)
    got = [eng.submit(p, max_new_tokens=4) for p in ps]
    # The second call: a step that has packed running requests already.
    faulty = inject(eng, target, method, RuntimeError("injected bug"), lambda n, *a: n == 2)
    with pytest.raises(RuntimeError, match="injected bug"):
        eng.run(got)
    assert faulty.raised == {method: 1}
    if method == "schedule":  # raised after the running requests were extended: put back
        assert eng.batcher.preemptions == 2
    eng.cache.check()
    for seq in eng.batcher.running:  # nothing half-packed is left behind
        assert seq.num_tokens == seq.num_computed == seq.req.num_tokens < seq.target_len
    results = eng.run(got)
    for r, p in zip(results, ps):
        assert r.finish_reason == "length" and r.output == dense_greedy(MODEL, p, 4)
    drained(eng)


def test_a_bug_in_finish_propagates_and_ends_that_request():
    """``finish`` raising an unexpected exception for request 0: the step raises it after
    sampling every request of its batch; request 0 ended with it, the others run on."""
    eng = engine(token_budget=64)
    ps = prompts(12)
    got = [eng.submit(p, max_new_tokens=2) for p in ps]
    bug = RuntimeError("injected bug in finish")
    inject(eng, "cache", "finish", bug, holds(eng, got[0]))
    with pytest.raises(RuntimeError, match="injected bug in finish"):
        eng.run(got)
    r0 = eng.result(got[0])
    assert r0.finish_reason == "error" and r0.error is bug
    assert r0.output == dense_greedy(MODEL, ps[0], 2)
    eng.cache.check()
    results = eng.run(got)
    for r, p in zip(results[1:], ps[1:]):
        assert r.finish_reason == "length" and r.output == dense_greedy(MODEL, p, 2)
    drained(eng)


# ---- the no-progress guard through the public API ----------------------------------------------


@pytest.mark.parametrize("make_cache", CACHES)
def test_requests_stuck_behind_pages_pinned_outside_the_engine_fail(make_cache):
    """A request opened directly on the engine's cache pins most of the pool: nothing the
    engine queues can be admitted. ``run()`` returns after ``max_stalled_steps`` steps with
    the stuck requests failed and the reason named; once the pages are free, the engine
    serves again."""
    eng = engine(make_cache, tokens=96, token_budget=32)
    cache = eng.cache
    outsider = cache.admit(ids(np.random.default_rng(8), 80))
    ps = prompts(9, k=2, n=30)
    got = [eng.submit(p, max_new_tokens=3) for p in ps]
    results = eng.run(got)
    assert eng.steps_taken[0] == eng.max_stalled_steps
    for r in results:
        assert r.finish_reason == "error" and isinstance(r.error, radixkv.Error)
        msg = str(r.error)
        assert f"request {r.id} made no progress in {eng.max_stalled_steps} steps" in msg
        assert "waits for admission" in msg
        pinned = len(outsider.pages)
        assert f"{pinned} of its {pinned} used pages are pinned by requests this engine" in msg
        assert "pinned by requests this engine did not open" in msg
    cache.check()
    assert not eng.has_work and cache.stats.used_pages == len(outsider.pages)
    cache.abort(outsider)
    results = eng.generate(ps, max_new_tokens=3)
    assert [r.output for r in results] == [dense_greedy(MODEL, p, 3) for p in ps]
    drained(eng)


def test_a_running_engine_is_not_failed_by_a_short_stall():
    """The guard counts steps without progress in a row: a request that waits while others
    run is never failed, however long the wait."""
    eng = engine(tokens=64, token_budget=8, max_batch=1)
    eng.max_stalled_steps = 2
    ps = prompts(10, k=3, n=20)
    results = eng.generate(ps, max_new_tokens=5)
    assert [r.output for r in results] == [dense_greedy(MODEL, p, 5) for p in ps]
    drained(eng)
