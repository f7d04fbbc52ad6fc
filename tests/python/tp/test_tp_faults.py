"""Faults in tensor-parallel lockstep: 2 processes over gloo on CPU (the harness of
``test_tp.py``), each with its shard of the tiny model and its own cache. Whatever fails on one
rank (a forward pass, a step, the token check, a peer's process, a follow() after close), every
rank must raise a ``radixkv.Error`` naming the rank, promptly: never wait for the process
group's timeout, never surface gloo's ``RuntimeError``. And engines whose settings differ are
refused when built, naming the setting and each rank's value.

The process group's timeout here (:data:`PG_TIMEOUT_S`) is much longer than what every rank is
allowed to take (:data:`PROMPT_S`), so a rank released by the timeout fails the test.
"""

from __future__ import annotations

import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

import budget
import radixkv
from radixkv.engine.lockstep import DivergedError, LeaderClosedError, PeerLostError
from ranks import end_rank, join_gloo, run_ranks
from test_tp import drive, make_engine
from tiny_model import tiny_model

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

#: The process group's timeout: a rank released by it took this long.
PG_TIMEOUT_S = 60
#: What a rank may take from the fault to its error (a few steps of the tiny model).
PROMPT_S = 15
#: The harness's watchdog: past the group's timeout, so a hang shows as slow errors, not a kill.
WATCHDOG_S = 100

#: Where a fault is injected in a step.
POINTS = ["before_forward", "in_forward", "after_sampling", "token_check"]


class Injected(RuntimeError):
    """The injected fault."""


def fault_case(seed: int) -> dict:
    """The fault of case ``seed``: the point cycles through :data:`POINTS` (so that a few cases
    cover them all); the rank, the step, the layer (and whether the layer raises before or after
    its all-reduces) and ``check_tokens`` are drawn from ``seed``."""
    rng = random.Random(3 + seed)
    point = POINTS[seed % len(POINTS)]
    return {
        "point": point,
        "rank": rng.randrange(2),
        "step": rng.randint(2, 6),
        "layer": rng.randrange(2),
        "side": rng.choice(["before", "after"]),
        "check_tokens": point == "token_check" or rng.random() < 0.5,
    }


# ---- the processes -------------------------------------------------------------------------


def _worker(rank: int, port: int, out_dir: str, job: str, case: dict) -> None:
    report: dict = {}
    barrier = True
    try:
        group = join_gloo(rank, port, 2, PG_TIMEOUT_S)
        model = tiny_model(seed=3, dtype=torch.float32).shard(rank, 2, group)
        barrier = JOBS[job](rank, model, group, report, case, out_dir)
    except BaseException:  # the test reads it
        report["crash"] = traceback.format_exc()
    end_rank(rank, out_dir, report, barrier=barrier)


def _error(report: dict, e: BaseException, t0: float) -> None:
    report["error"] = f"{type(e).__name__}: {e}"
    report["classes"] = [c.__name__ for c in type(e).__mro__]
    report["seconds"] = time.perf_counter() - t0
    report["cause"] = repr(e.__cause__)


def _lead_or_follow(rank: int, eng: radixkv.Engine, report: dict) -> None:
    """Rank 0 drives and closes, rank 1 follows; the ``radixkv.Error`` either raises is
    reported, and so is what a later call of the engine raises."""
    t0 = time.perf_counter()
    try:
        if rank == 0:
            drive(eng)
            eng.close()
        else:
            eng.follow()
    except radixkv.Error as e:
        _error(report, e, t0)
    try:  # a broken engine refuses every later call, at once (no collective)
        eng.step() if rank == 0 else eng.follow()
    except radixkv.Error as e:
        report["again"] = str(e)


def _forward_raises_job(rank, model, group, report, case, out_dir) -> bool:
    """The forward pass of step 3 raises on ``case["rank"]`` once its all-reduces are done."""
    eng = make_engine("radix", "lpm", model, group=group, check_tokens=case["check_tokens"])
    if rank == case["rank"]:
        forward = model.forward

        def failing(step, *a, **kw):
            logits = forward(step, *a, **kw)
            if eng.lockstep.steps == 3:
                raise Injected("injected: the forward pass failed on this rank")
            return logits

        model.forward = failing
    _lead_or_follow(rank, eng, report)
    report["in_sync"] = eng.lockstep.in_sync
    return eng.lockstep.in_sync


def _follow_after_close_job(rank, model, group, report, case, out_dir) -> bool:
    eng = make_engine("block", "fcfs", model, group=group)
    if rank == 0:
        drive(eng)
        eng.close()
        return True  # alive in the barrier while rank 1 calls follow() again
    report["steps"] = eng.follow()
    t0 = time.perf_counter()
    try:
        eng.follow()
    except radixkv.Error as e:
        _error(report, e, t0)
    return True


def _peer_dies_job(rank, model, group, report, case, out_dir) -> bool:
    """Rank ``case["dead"]``'s process exits at step 3, in the middle of the lockstep."""
    eng = make_engine("radix", "fcfs", model, group=group, check_tokens=case["check_tokens"])
    if rank == case["dead"]:
        check_step = eng.lockstep.check_step

        def dying(*a, **kw):
            if eng.lockstep.steps == 2:  # the third step's check
                report["died"] = True
                end_rank(rank, out_dir, report, barrier=False)
            return check_step(*a, **kw)

        eng.lockstep.check_step = dying
    _lead_or_follow(rank, eng, report)
    return False


def _fault_job(rank, model, group, report, case, out_dir) -> bool:
    """Injects ``case``'s fault (see :func:`fault_case`) on its rank, at its step."""
    eng = make_engine("radix", "dfs-weight", model, group=group, check_tokens=case["check_tokens"])
    lock = eng.lockstep

    def due() -> bool:
        if lock.steps != case["step"] or report.get("fired"):
            return False
        report["fired"] = True
        return True

    def fault(where: str) -> Injected:
        return Injected(f"injected {where} at step {lock.steps}")

    if rank == case["rank"]:
        point = case["point"]
        if point == "before_forward":
            plan = eng.kv.plan

            def failing_plan(*a, **kw):
                if due():
                    raise fault("before the forward pass")
                return plan(*a, **kw)

            eng.kv.plan = failing_plan
        elif point == "in_forward":
            layer = model.layers[case["layer"]]
            forward = layer.forward

            def failing_layer(*a, **kw):
                if case["side"] == "before" and due():
                    raise fault(f"in layer {case['layer']}, before its all-reduces")
                out = forward(*a, **kw)
                if case["side"] == "after" and due():
                    raise fault(f"in layer {case['layer']}, after its all-reduces")
                return out

            layer.forward = failing_layer
        elif point == "after_sampling":
            sample = eng._sample

            def failing_sample(*a, **kw):
                out = sample(*a, **kw)
                if due():
                    raise fault("after sampling")
                return out

            eng._sample = failing_sample
        else:
            check_sampled = lock.check_sampled

            def failing_check(*a, **kw):
                if due():
                    raise fault("in the token check")
                return check_sampled(*a, **kw)

            lock.check_sampled = failing_check
    _lead_or_follow(rank, eng, report)
    report["in_sync"] = lock.in_sync
    return lock.in_sync


def _config_job(rank, model, group, report, case, out_dir) -> bool:
    """Ranks whose caches or engines differ in one setting each: refused on both ranks."""

    def build(name: str, cache, dtype=None, **kw) -> None:
        try:
            radixkv.Engine(model, model.make_kv_cache(cache, dtype=dtype), group=group, **kw)
            report[name] = "built"
        except ValueError as e:
            report[name] = str(e)

    build("host_pages", radixkv.RadixCache(16, page_size=4, host_pages=8 * rank))
    build("kind", radixkv.RadixCache(16, page_size=4) if rank else radixkv.BlockCache(16, 4))
    build("dtype", radixkv.BlockCache(8, 8), dtype=torch.float16 if rank else None)
    build("max_wait", radixkv.BlockCache(8, 8), max_wait=256 + rank)
    warm = radixkv.RadixCache(16, page_size=4)
    if rank == 1:  # a request outside any engine: rank 1's cache holds pages rank 0's lacks
        r = warm.admit(np.arange(9, dtype=np.uint32))
        warm.commit(r, 9)
        warm.finish(r)
    build("contents", warm)
    build("equal", radixkv.RadixCache(16, page_size=4, host_pages=8))
    return True


JOBS = {
    "forward_raises": _forward_raises_job,
    "follow_after_close": _follow_after_close_job,
    "peer_dies": _peer_dies_job,
    "fault": _fault_job,
    "config": _config_job,
}


def ranks_of(tmp_path: Path, job: str, case: dict | None = None) -> list[dict]:
    return run_ranks(
        _worker,
        (str(tmp_path), job, case or {}),
        tmp_path,
        2,
        f"the ranks of job {job!r} {case or ''}",
        watchdog_s=WATCHDOG_S,
    )


def assert_prompt_lockstep_error(rep: dict, r: int, cls: type = DivergedError) -> None:
    assert "error" in rep, f"rank {r} raised no radixkv.Error: {rep}"
    assert cls.__name__ in rep["classes"] and "Error" in rep["classes"], f"rank {r}: {rep}"
    assert "RuntimeError" not in rep["classes"], f"rank {r}: {rep}"
    assert rep["seconds"] < PROMPT_S, f"rank {r} waited {rep['seconds']:.1f} s: {rep}"


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failing", "check_tokens"), [(0, True), (1, True), (0, False)], ids=["0", "1", "0-no-tokens"]
)
def test_a_forward_that_raises_on_one_rank_raises_on_every_rank(tmp_path, failing, check_tokens):
    """With ``check_tokens`` the token check reports it, else the next step's check."""
    case = {"rank": failing, "check_tokens": check_tokens}
    reports = ranks_of(tmp_path, "forward_raises", case)
    for r, rep in enumerate(reports):
        assert_prompt_lockstep_error(rep, r)
        assert f"rank {failing}" in rep["error"] and "injected" in rep["error"], rep["error"]
        assert "step 3" in rep["error"], rep["error"]
        assert rep["again"] == rep["error"].split(": ", 1)[1], rep
        # The forward pass had done its all-reduces: the ranks raised at the same collective,
        # so the group is still usable (the harness's barrier ran).
        assert rep["in_sync"], rep
    assert "Injected" in reports[failing]["cause"], reports[failing]


def test_follow_after_the_leader_closed_raises_at_once(tmp_path):
    _, rank1 = ranks_of(tmp_path, "follow_after_close")
    assert rank1["steps"] > 10
    assert_prompt_lockstep_error(rank1, 1, LeaderClosedError)
    assert rank1["seconds"] < 1, rank1
    assert "rank 0 closed" in rank1["error"], rank1["error"]


@pytest.mark.parametrize("dead", [0, 1])
def test_a_dead_peer_raises_a_radixkv_error_naming_it(tmp_path, dead):
    reports = ranks_of(tmp_path, "peer_dies", {"dead": dead, "check_tokens": bool(dead)})
    assert reports[dead].get("died"), reports[dead]
    alive = reports[1 - dead]
    assert_prompt_lockstep_error(alive, 1 - dead, PeerLostError)
    assert f"rank {dead}" in alive["error"], alive["error"]
    assert alive["again"] == alive["error"].split(": ", 1)[1], alive


#: ``make test``: the first 4 cases (one at each point of :data:`POINTS`); ``make test-long``: 12.
@pytest.mark.parametrize(
    "seed", range(budget.examples(12, 4)), ids=lambda s: f"{s}-{fault_case(s)['point']}"
)
def test_a_fault_anywhere_in_a_step_raises_on_every_rank(tmp_path, seed):
    case = fault_case(seed)
    reports = ranks_of(tmp_path, "fault", case)
    failing = case["rank"]
    assert reports[failing].get("fired"), f"the fault never fired: {case} {reports}"
    for r, rep in enumerate(reports):
        assert_prompt_lockstep_error(rep, r)
        assert f"rank {failing}" in rep["error"], (case, rep["error"])
        assert rep["again"] == rep["error"].split(": ", 1)[1], rep
    # The failing rank says what it raised, and chains it.
    assert "injected" in reports[failing]["error"], (case, reports[failing])
    assert "Injected" in reports[failing]["cause"], (case, reports[failing])
    if case["point"] in ("after_sampling", "token_check"):
        # Outside the forward pass the failing rank announces its failure in the collective
        # the others wait in: everyone raises together, the group stays usable.
        for r, rep in enumerate(reports):
            assert rep["in_sync"], (case, r, rep)
            assert "injected" in rep["error"], (case, r, rep["error"])


def test_ranks_whose_settings_differ_are_refused_naming_the_setting(tmp_path):
    reports = ranks_of(tmp_path, "config")
    for rep in reports:
        assert "host_pages must be the same on every rank" in rep["host_pages"], rep
        assert "rank 0 has 0" in rep["host_pages"] and "rank 1 has 8" in rep["host_pages"]
        assert "cache kind must be the same" in rep["kind"], rep
        assert "'BlockCache'" in rep["kind"] and "'RadixCache'" in rep["kind"], rep
        assert "KV dtype must be the same" in rep["dtype"], rep
        assert "'torch.float32'" in rep["dtype"] and "'torch.float16'" in rep["dtype"], rep
        assert "max_wait" in rep["max_wait"] and "rank 1 has 257" in rep["max_wait"], rep
        assert "cache state digest must be the same" in rep["contents"], rep
        assert rep["equal"] == "built", rep


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
