"""Memory comes back: a namespace costs nothing once nothing of it is left, in a cache (its
radix root) and in the scheduler (its waiting-trie root)."""

from __future__ import annotations

import gc
import warnings

import pytest

import radixkv

pytestmark = pytest.mark.robust


def test_an_empty_namespace_root_is_released() -> None:
    c = radixkv.RadixCache(64, 1)
    warm = c.admit([1, 2, 3], namespace="t-0")
    c.abort(warm)
    baseline = c.metadata_bytes
    for i in range(5000):
        r = c.admit([1, 2, 3], namespace=f"t-{i}")
        if i % 2:
            c.abort(r)
        else:
            c.commit(r, 3)
            c.finish(r)
            c.evict(64)
    c.check()
    assert c.metadata_bytes <= baseline + 512, (baseline, c.metadata_bytes)
    # A namespace whose pages were all evicted is gone too, with reset or without.
    r = c.admit([5, 6, 7], namespace=b"kept")
    c.commit(r, 3)
    c.finish(r)
    assert c.match_prefix([5, 6, 7, 8], namespace="kept") == 3
    assert c.evict(100) == 3
    c.check()
    assert c.metadata_bytes <= baseline + 512


def test_the_scheduler_forgets_namespaces_no_request_uses() -> None:
    c = radixkv.RadixCache(1 << 16, 1)
    s = radixkv.Scheduler(c, "lpm")
    for i in range(20_000):
        j = s.add([1, 2, 3, i % 1000], namespace=f"tenant-{i}")
        if i % 2:
            assert s.cancel(j)
    assert s.num_namespaces == 10_000
    for _, r in s.schedule(1 << 20):
        c.abort(r)
    assert s.num_namespaces == 0 and len(s) == 0
    s.add([1, 2, 3], namespace="last")
    assert s.num_namespaces == 1
    (got,) = s.schedule(16)
    assert got[1].namespace == "last"
    assert s.num_namespaces == 0
    c.abort(got[1])
    c.check()


# The last case raises the warning as an error inside a collection: reported as unraisable.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_request_collected_while_open_is_aborted_with_a_resource_warning() -> None:
    for cls in (radixkv.RadixCache, radixkv.BlockCache):
        c = cls(8, 1)
        r = c.admit([1, 2, 3, 4])
        c.commit(r, 2)
        gc.collect()  # what earlier tests left in cycles is collected outside the record
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del r  # the last reference: collected right here
        assert [w.category for w in caught] == [ResourceWarning]
        assert "garbage-collected while open" in str(caught[0].message)
        assert c.stats.used_pages == 0
        c.check()
        # Closed requests go quietly; so does a request whose finish comes first.
        r = c.admit([1, 2, 3, 4])
        c.finish(r)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del r
        assert caught == []
        # An error raised by the warning itself (-W error) does not escape the collection.
        r = c.admit([5, 6, 7])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            del r
        assert c.stats.used_pages == 0
        c.check()


def test_a_request_collected_while_its_cache_is_busy_is_aborted_by_the_next_call() -> None:
    import threading
    import time

    c = radixkv.RadixCache(1 << 26)
    r = c.admit(list(range(100)))
    busy = threading.Thread(target=c.check)  # holds the cache's lock, the GIL released
    busy.start()
    time.sleep(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        del r  # never waits for the lock: aborted now, or by the next call that takes it
    busy.join(60)
    assert not busy.is_alive()
    assert c.stats.used_pages == 0
    c.check()
