"""Eviction classes and retention from Python: ``finish(req, retain=..., priority=...)``,
``advance(now)``, ``release_retention``, and the stats that count them.

The exact eviction orders are tested in the core (tests/rust/retain.rs); here, the boundary's
arguments and errors, and a random walk against a twin cache without retention: retention
never changes whether an admission fits (it changes only what is evicted), and ``check()``,
which recomputes every retention count from scratch, holds after every step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import radixkv


def served(cache, tokens, **kw):
    req = cache.admit(np.asarray(tokens, dtype=np.uint32))
    cache.commit(req, req.num_tokens)
    return cache.finish(req, **kw)


CACHES = [radixkv.RadixCache, radixkv.BlockCache]


@pytest.mark.parametrize("cls", CACHES)
def test_finish_returns_a_retention_only_when_asked(cls):
    c = cls(16, page_size=1)
    assert served(c, [1, 2, 3]) is None
    assert served(c, [4, 5, 6], priority=2) is None
    rid = served(c, [7, 8, 9], retain=30.0)
    assert isinstance(rid, int) and rid > 0
    assert c.stats.retentions == 1
    assert "retentions=1" in repr(c.stats) and c.stats.as_dict()["retentions"] == 1
    assert c.release_retention(rid) is True
    assert c.release_retention(rid) is False
    assert c.stats.retentions == 0
    c.check()


@pytest.mark.parametrize("cls", CACHES)
def test_retained_pages_outlive_newer_ones_until_their_time_is_up(cls):
    c = cls(9, page_size=1)
    agent = [1, 2, 3, 4]
    c.advance(100.0)
    served(c, agent, retain=60.0)  # paused on a tool until t=160
    for k in range(3):  # unrelated one-shot traffic fills the pool
        served(c, [50 + 10 * k, 51 + 10 * k, 52 + 10 * k])
    assert c.match_prefix(agent) == 3, "the paused agent's history is still cached"
    assert c.stats.forced_evictions == 0
    assert c.advance(159.0) == 0 and c.advance(160.0) == 1
    assert c.now == 160.0 and c.stats.expired_retentions == 1
    served(c, [90, 91, 92, 93])  # plain LRU again: the agent, oldest, goes first
    assert c.match_prefix(agent) < 3
    c.check()


@pytest.mark.parametrize("cls", CACHES)
def test_bad_arguments_name_the_value_and_change_nothing(cls):
    c = cls(8, page_size=1)
    req = c.admit([1, 2, 3])
    c.commit(req, 3)
    top = radixkv.EVICTION_CLASSES - 1
    with pytest.raises(ValueError, match=rf"priority.*from 0 to {top}\b.*got 9$"):
        c.finish(req, priority=9)
    # The value given, not a clamped one; a negative one too.
    with pytest.raises(ValueError, match=rf"from 0 to {top}\b.*got 300$"):
        c.finish(req, priority=300)
    with pytest.raises(ValueError, match=rf"from 0 to {top}\b.*got -1$"):
        c.finish(req, priority=-1)
    with pytest.raises(ValueError, match=r"got 18446744073709551616$"):
        c.finish(req, priority=2**64)
    with pytest.raises(TypeError, match="priority must be an int"):
        c.finish(req, priority="high")
    # A bool is neither a class nor seconds (as the engine refuses retain=True).
    with pytest.raises(TypeError, match="priority must be an int, got bool"):
        c.finish(req, priority=True)
    with pytest.raises(TypeError, match=r"retain must be seconds.*got bool"):
        c.finish(req, retain=True)
    with pytest.raises(TypeError, match=r"retain must be seconds.*got str"):
        c.finish(req, retain="1")
    with pytest.raises(ValueError, match=r"retain.*got -1"):
        c.finish(req, retain=-1.0)
    with pytest.raises(ValueError, match="retain"):
        c.finish(req, retain=math.nan)
    assert not req.closed, "a refused finish leaves the request open"
    assert c.finish(req, retain=math.inf) is not None
    c.advance(5.0)
    with pytest.raises(ValueError, match=r"clock is at 5.*got 1"):
        c.advance(1.0)
    assert c.now == 5.0
    c.check()


@pytest.mark.parametrize("cls", CACHES)
def test_retain_prefix_holds_a_cached_prefix_without_an_admission(cls):
    """``retain_prefix``: the whole pages of a breakpoint inside a cached prompt are retained
    as ``finish(retain=...)`` retains a request's pages, with no admission: the counters and
    page states are unchanged, and the prefix alone outlives traffic until its time is up."""
    c = cls(24, page_size=4)
    prompt = list(range(1, 25))  # six pages
    served(c, prompt)
    before = c.stats
    rid, held = c.retain_prefix(np.asarray(prompt[:10], dtype=np.int64), retain=30.0)
    assert isinstance(rid, int) and held == 8, "the two whole pages of 10 tokens"
    after = c.stats
    for name in ("queries", "query_tokens", "hit_tokens", "free_pages", "evictable_pages"):
        assert getattr(after, name) == getattr(before, name), name
    assert after.retentions == 1
    assert c.retain_prefix([90, 91, 92, 93, 94], retain=30.0) == (None, 0), "nothing cached"
    assert c.retain_prefix(prompt, "another namespace", retain=30.0) == (None, 0)
    assert c.retain_prefix(prompt) == (None, 0), "nothing asked for"
    for k in range(6):  # traffic of as many pages as the pool
        served(c, [100 * (k + 1) + i for i in range(16)])
    assert c.match_prefix(prompt) == 8 and c.stats.forced_evictions == 0
    c.advance(30.0)
    assert c.stats.retentions == 0 and c.stats.expired_retentions == 1
    for bad, err in (
        (dict(retain=-1.0), ValueError),
        (dict(retain=True), TypeError),
        (dict(retain=1.0, priority=radixkv.EVICTION_CLASSES), ValueError),
    ):
        with pytest.raises(err, match=r"retain|priority"):
            c.retain_prefix(prompt, **bad)
    with pytest.raises(ValueError, match="tokens"):
        c.retain_prefix([], retain=1.0)
    c.check()


@pytest.mark.parametrize("cls", CACHES)
@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["serve", "serve", "serve", "tick", "release", "evict"]),
            st.integers(0, 5),  # which prompt family
            st.integers(1, 9),  # length
            st.integers(0, radixkv.EVICTION_CLASSES - 1),
            st.sampled_from([0.0, 0.0, 1.0, 5.0, math.inf]),
        ),
        max_size=40,
    )
)
def test_retention_never_changes_whether_an_admission_fits(cls, ops):
    """Retained pages (and pages of a higher class) stay evictable: at every moment an admission
    fits exactly when the pages it needs are at most free + evictable, an ``evict(n)`` takes
    ``min(n, evictable)`` pages, and with nothing live every page is free or evictable. (Two
    caches driven alike, one retaining, may hold different pages later, since retention and
    classes change which pages go; the rule holds of each at each moment.)"""
    c = cls(12, page_size=1)
    now, rids = 0.0, []
    for op, fam, n, klass, retain in ops:
        if op == "tick":
            now += retain if math.isfinite(retain) else 2.0
            c.advance(now)
        elif op == "release" and rids:
            c.release_retention(rids.pop(0))
        elif op == "evict":
            before = c.stats.evictable_pages
            assert c.evict(n) == min(n, before)
        elif op == "serve":
            tokens = [100 * fam + i for i in range(n)]
            s = c.stats
            needed = n - c.match_prefix(tokens)
            fits = needed <= s.free_pages + s.evictable_pages
            try:
                req = c.admit(tokens)
            except radixkv.OutOfPages:
                req = None
            assert (req is not None) == fits, (needed, s)
            if req is not None:
                c.commit(req, n)
                rid = c.finish(req, retain=retain, priority=klass)
                if rid is not None:
                    rids.append(rid)
        c.check()
        s = c.stats
        assert s.used_pages == 0 and s.free_pages + s.evictable_pages == s.num_pages


def test_metrics_export_the_retention_counters():
    prometheus_client = pytest.importorskip("prometheus_client")
    from radixkv.metrics import CacheCollector

    c = radixkv.RadixCache(4, page_size=1)
    served(c, [1, 2, 3], retain=math.inf)
    served(c, [7, 8, 9, 10])  # needs the whole pool: the retained pages go
    registry = prometheus_client.CollectorRegistry()
    registry.register(CacheCollector(c))
    text = prometheus_client.generate_latest(registry).decode()
    assert "radixkv_retained_evicted_pages_total 3.0" in text, text
    assert "radixkv_retentions 0.0" in text
    assert "radixkv_retentions_expired_total 0.0" in text
