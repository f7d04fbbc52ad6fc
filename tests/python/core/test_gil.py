"""Long native calls release the GIL: another Python thread makes progress while one runs.

A thread that holds the GIL for a whole call lets no other Python thread run until it returns,
so a counter thread's ticks would all fall outside the call. Each test times one long call in
the main thread and asserts that the counter thread ticked well inside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

import radixkv


def ticks_inside(call: Callable[[], object]) -> tuple[int, float]:
    """Runs ``call`` while a second thread ticks; returns the ticks that fell in the middle 60%
    of the call, and the call's duration in seconds."""
    ticks: list[float] = []
    stop = threading.Event()
    started = threading.Event()

    def counter() -> None:
        started.set()
        while not stop.is_set():
            ticks.append(time.perf_counter())

    t = threading.Thread(target=counter)
    t.start()
    started.wait()
    time.sleep(0.01)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    t.join()
    lo, hi = t0 + 0.2 * (t1 - t0), t1 - 0.2 * (t1 - t0)
    return sum(lo < x < hi for x in ticks), t1 - t0


def long_enough(duration: float) -> None:
    """The call must outlast several GIL switch intervals for the test to mean anything."""
    assert duration > 10 * 0.005, f"the native call took only {duration * 1e3:.1f} ms"


# A RadixCache admits a page in about a nanosecond (pages come off the free set a word at a time),
# so it gets a prompt long enough to outlast the switch intervals; a BlockCache's page records
# cost more memory, and its admission more time a page.
@pytest.mark.parametrize(
    ("kind", "n"), [(radixkv.RadixCache, 1 << 25), (radixkv.BlockCache, 1 << 23)]
)
def test_a_long_admission_lets_other_threads_run(kind, n):
    cache = kind(n + 1, 1)
    tokens = np.arange(n, dtype=np.uint32)
    inside, duration = ticks_inside(lambda: cache.admit(tokens))
    long_enough(duration)
    assert inside > 0, "no other thread ran during admit: the GIL was held"


def test_block_hashes_of_a_long_prompt_let_other_threads_run():
    tokens = np.arange(1 << 24, dtype=np.uint32)  # ~0.2 s of hashing
    inside, duration = ticks_inside(lambda: radixkv.block_hashes(tokens, 16))
    long_enough(duration)
    assert inside > 0, "no other thread ran during block_hashes: the GIL was held"


def test_the_probe_sees_a_call_that_holds_the_gil():
    """The probe itself can fail: ``sum(range(n))`` is one C call that never releases the GIL,
    so the counter thread cannot tick inside it."""
    inside, duration = ticks_inside(lambda: sum(range(20_000_000)))
    long_enough(duration)
    assert inside == 0
