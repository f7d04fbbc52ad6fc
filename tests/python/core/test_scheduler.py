"""The Scheduler through its Python boundary: ids, namespaces handed back as given, errors."""

import numpy as np
import pytest
import torch

import radixkv


def warm(cache, tokens, namespace=None):
    req = cache.admit(tokens, namespace)
    cache.commit(req, req.num_tokens)
    cache.finish(req)


@pytest.mark.parametrize(
    "make", [lambda: radixkv.RadixCache(4096), lambda: radixkv.BlockCache(512)]
)
def test_lpm_order_and_returned_requests(make):
    cache = make()
    prefix = np.arange(0, 512, dtype=np.uint32)
    warm(cache, prefix)
    sched = radixkv.Scheduler(cache, "lpm")
    cold = sched.add(np.arange(10_000, 10_100))
    hot = sched.add(torch.cat([torch.from_numpy(prefix.astype(np.int64)), torch.tensor([7, 8])]))
    assert len(sched) == 2 and sched.waiting == [cold, hot]
    got = sched.schedule(token_budget=1_000)
    assert [i for i, _ in got] == [hot, cold]
    hot_req = got[0][1]
    # The warmed prefix (a whole number of pages for both caches) is served; the rest computed.
    assert hot_req.num_cached == len(prefix)
    assert hot_req.cache is not None and not hot_req.closed
    assert len(sched) == 0
    for _, r in got:
        cache.abort(r)
    cache.check()


def test_namespace_comes_back_as_given():
    cache = radixkv.RadixCache(1024)
    sched = radixkv.Scheduler(cache, "fcfs")
    a = sched.add([1, 2, 3], namespace=b"\xff-raw")
    b = sched.add([1, 2, 3], namespace="tenant")
    c = sched.add([1, 2, 3])
    got = dict(sched.schedule(100))
    assert got[a].namespace == b"\xff-raw"
    assert got[b].namespace == "tenant"
    assert got[c].namespace is None


def test_budget_counts_only_uncached_tokens():
    cache = radixkv.RadixCache(8192)
    prefix = list(range(2000))
    warm(cache, prefix)
    sched = radixkv.Scheduler(cache, "lpm")
    ids = [sched.add([*prefix, 50_000 + i]) for i in range(5)]
    # Each has 2,000 cached tokens and 1 to compute: a budget of 3 admits three of them.
    got = sched.schedule(token_budget=3)
    assert [i for i, _ in got] == ids[:3]
    assert [r.num_tokens - r.num_cached for _, r in got] == [1, 1, 1]


def test_cancel_and_bad_arguments():
    cache = radixkv.RadixCache(64)
    with pytest.raises(ValueError, match=r"policy.*lru"):
        radixkv.Scheduler(cache, "lru")
    with pytest.raises(ValueError, match=r"max_wait.*-1"):
        radixkv.Scheduler(cache, "lpm", max_wait=-1)
    sched = radixkv.Scheduler(cache, "dfs-weight")
    with pytest.raises(ValueError, match="empty"):
        sched.add([])
    with pytest.raises(ValueError, match=r"tokens\[1\] = -5"):
        sched.add([1, -5])
    with pytest.raises(ValueError, match=r"token_budget.*-3"):
        sched.schedule(-3)
    i = sched.add([1, 2])
    assert sched.cancel(i) and not sched.cancel(i)
    before = cache.stats
    assert sched.schedule(100) == []
    assert cache.stats == before
