"""The scheduler under threads: no request parted from its namespace, no Python code run (or
object released) while a radixkv lock is held. Every scenario runs under a watchdog."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

import radixkv

pytestmark = pytest.mark.robust

WATCHDOG_S = 60


def run_isolated(code: str) -> str:
    """Runs ``code`` in a fresh interpreter under the watchdog: a deadlock there holds the GIL,
    so it could not be detected from a thread of this process."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=WATCHDOG_S,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_cancel_racing_schedule_never_parts_a_request_from_its_namespace() -> None:
    cache = radixkv.RadixCache(1 << 16, 1)
    sched = radixkv.Scheduler(cache, "fcfs", max_wait=0)
    n = 4000
    ids = [sched.add([i % 97 + 1, i % 89 + 2, 3], namespace=f"tenant-{i}") for i in range(n)]
    tenant = {id_: f"tenant-{i}" for i, id_ in enumerate(ids)}
    admitted: list[tuple[int, radixkv.Request]] = []
    cancelled: list[int] = []
    stop = threading.Event()

    def scheduler() -> None:
        while not stop.is_set() and len(sched):
            admitted.extend(sched.schedule(64, max_requests=16))

    def canceller() -> None:
        for id_ in reversed(ids):
            if sched.cancel(id_):
                cancelled.append(id_)

    threads = [threading.Thread(target=scheduler), threading.Thread(target=canceller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WATCHDOG_S)
    stop.set()
    assert not any(t.is_alive() for t in threads), "deadlock"
    wrong = [(id_, r.namespace) for id_, r in admitted if r.namespace != tenant[id_]]
    assert not wrong, f"{len(wrong)} requests came back with the wrong namespace: {wrong[:3]}"
    assert not set(cancelled) & {id_ for id_, _ in admitted}
    assert len(cancelled) + len(admitted) == n
    for _, r in admitted:
        cache.abort(r)
    cache.check()


def test_a_namespace_whose_del_calls_back_into_the_scheduler_does_not_hang() -> None:
    out = run_isolated(
        """
        import radixkv

        cache = radixkv.RadixCache(64, 1)
        sched = radixkv.Scheduler(cache)
        calls = []

        class Tenant(str):
            def __del__(self):
                # Re-enters the scheduler while the object is being released.
                calls.append((len(sched), sched.cancel(10**6), sched.waiting))

        a = sched.add([1, 2, 3], namespace=Tenant("a"))
        b = sched.add([4, 5, 6], namespace=Tenant("b"))
        c = sched.add([7, 8, 9], namespace=Tenant("c"))
        assert sched.cancel(a)            # the last reference goes inside cancel
        got = sched.schedule(100)         # b and c handed to their Requests
        assert [i for i, _ in got] == [b, c]
        for _, r in got:
            cache.abort(r)
        del got, r                        # released by the Requests
        sched.add([1], namespace=Tenant("d"))
        print(len(calls))
        """
    )
    assert out.split() == ["3"]


def test_shared_cache_and_scheduler_under_threads() -> None:
    cache = radixkv.BlockCache(512, 4)
    sched = radixkv.Scheduler(cache, "lpm")
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(300):
                sched.add([k, i % 7, i % 5, 1, 2, 3, 4, 5], namespace=("ab"[i % 2]) * k)
                for _, r in sched.schedule(32, 4):
                    cache.commit(r, r.num_tokens)
                    (cache.finish if i % 3 else cache.abort)(r)
                if i % 17 == 0:
                    waiting = sched.waiting  # one snapshot: other threads change the queue
                    sched.cancel(waiting[0] if waiting else 0)
                    cache.evict(3)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WATCHDOG_S)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors
    for _, r in sched.schedule(1 << 20):
        cache.abort(r)
    cache.check()
    assert cache.stats.used_pages == 0
