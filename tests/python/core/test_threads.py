"""One cache shared by several Python threads: calls are serialized inside, long ones release
the GIL, and nothing is lost or corrupted."""

import threading

import numpy as np
import pytest

import radixkv

CACHES = [lambda: radixkv.RadixCache(1 << 16), lambda: radixkv.BlockCache(4096)]


@pytest.mark.parametrize("make", CACHES)
def test_threads_share_one_cache(make):
    cache = make()
    system = np.arange(6000, dtype=np.uint32)  # long enough that admit releases the GIL
    errors: list[BaseException] = []
    cached: list[int] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for turn in range(25):
                n = int(rng.integers(1, 200))
                tail = rng.integers(1 << 20, 1 << 30, size=n, dtype=np.uint32)
                req = cache.admit(np.concatenate([system, tail]), namespace=f"t{seed % 2}")
                cache.commit(req, req.num_tokens)
                if turn % 5 == 4:
                    cache.fork(req)  # left open: its pins must survive the other threads
                cached.append(req.num_cached)
                cache.finish(req)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cache.check()
    s = cache.stats
    assert s.queries == 6 * 25 + 6 * 5
    # After the first admission in each namespace, the system prompt is found.
    assert sum(c >= 5984 for c in cached) >= len(cached) - 2 * 6
    assert s.free_pages + s.evictable_pages + s.used_pages == s.num_pages
