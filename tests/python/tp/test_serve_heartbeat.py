"""The server's engine thread over a tensor-parallel engine (``EngineLoop``, what ``radixkv serve
--tensor-parallel-size`` runs on rank 0) keeps the other ranks alive while idle: they wait for
rank 0's next step in a collective, which times out after the group's timeout. Two ranks of the
tiny model over gloo with a 2 s timeout, idle for 5 s, then a request: with the heartbeat the
request is served and both ranks close cleanly; without it (``heartbeat_s=None``) rank 1 times
out and the request fails, which is what the heartbeat is there for; the engine thread then ends,
and a call handed to it fails with the error that parted the ranks."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

pytest.importorskip("fastapi", reason="the engine loop is radixkv serve's (radixkv[serve])")
torch = pytest.importorskip("torch")

import radixkv  # noqa: E402
from ranks import end_rank, join_gloo, run_ranks  # noqa: E402
from tiny_model import tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

TIMEOUT_S = 2.0
IDLE_S = 5.0


def _worker(rank: int, port: int, out_dir: str, heartbeat_s: float | None) -> None:
    report: dict = {}
    try:
        group = join_gloo(rank, port, 2, TIMEOUT_S)
        model = tiny_model(seed=3, dtype=torch.float32).shard(rank, 2, group)
        kv = model.make_kv_cache(radixkv.RadixCache(64, page_size=4))
        eng = radixkv.Engine(model, kv, token_budget=32, max_batch=2, group=group)
        if rank == 0:
            _lead(eng, heartbeat_s, report)
        else:
            try:
                report["steps"] = eng.follow()
            except radixkv.Error as e:
                report["follow"] = type(e).__name__
    except BaseException:  # the test reads it
        report["crash"] = traceback.format_exc()
    end_rank(rank, out_dir, report, barrier=False)


def _lead(eng: radixkv.Engine, heartbeat_s: float | None, report: dict) -> None:
    from radixkv.apps.serve.app import EngineLoop

    loop = EngineLoop(eng, heartbeat_s=heartbeat_s)
    loop.start()
    time.sleep(IDLE_S)  # nothing asked
    done = threading.Event()
    events: list = []

    def on_token(event) -> None:
        events.append(event)
        if event.finish_reason is not None:
            done.set()

    loop.call_blocking(lambda: eng.submit([5, 6, 7, 8, 9], max_new_tokens=4, on_token=on_token))
    deadline = time.monotonic() + 30
    while not done.wait(0.1) and loop.error is None and time.monotonic() < deadline:
        pass
    report["finish_reason"] = events[-1].finish_reason if events else None
    report["loop_error"] = type(loop.error).__name__ if loop.error is not None else None
    if loop.error is not None:  # the thread ended: a call fails with its error, never waits
        try:
            loop.call_blocking(lambda: None, timeout=10)
        except Exception as e:
            report["call_after"] = type(e).__name__
    loop.stop()
    try:
        eng.close()
    except radixkv.Error as e:
        report["close"] = type(e).__name__


def _run(tmp_path, heartbeat_s: float | None) -> list[dict]:
    return run_ranks(_worker, (str(tmp_path), heartbeat_s), tmp_path, 2, "heartbeat ranks")


def test_idle_rank_zero_steps_so_the_other_ranks_never_time_out(tmp_path):
    lead, follow = _run(tmp_path, 0.5)
    assert lead == {"finish_reason": "length", "loop_error": None}, lead
    assert follow["steps"] > IDLE_S / 0.5 / 2, follow  # empty steps while idle, then the request
    assert "follow" not in follow


def test_without_the_heartbeat_the_other_rank_times_out(tmp_path):
    """And once the ranks parted, a call handed to the engine thread fails with their error (a
    request arriving then got no answer at all, and kept the server from stopping)."""
    lead, follow = _run(tmp_path, None)
    assert follow.get("follow") == "PeerLostError", follow
    assert lead["finish_reason"] != "length" or lead["loop_error"] is not None, lead
    assert lead["call_after"] == "PeerLostError", lead
