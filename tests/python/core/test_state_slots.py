"""State slots through the bindings: ``state_slots=`` on both caches, ``take_state``,
``release_state``, ``evict_state``, ``drain_freed_states``, ``Request.kv_matched`` /
``state_slot``, the stats that count snapshots, and which snapshot goes first.

The core's own tests (tests/rust/states.rs) run random sequences against the hit rule; here,
the same rules seen from Python, with the cache's ``check()`` after each step.
"""

from __future__ import annotations

import numpy as np
import pytest

import radixkv

# (class, page size): token-exact on the radix tree, block boundaries on the block index.
CACHES = [(radixkv.RadixCache, 1), (radixkv.BlockCache, 4)]


def toks(n, seed):
    return np.arange(n, dtype=np.uint32) * 7 + seed * 1000 + 1


def served(cache, tokens, at=(), namespace=None):
    """Admits ``tokens``, snapshots at each of ``at``, computes all of it and finishes."""
    req = cache.admit(tokens, namespace=namespace)
    slots = [cache.take_state(req, pos) for pos in at]
    cache.commit(req, req.num_tokens)
    cache.finish(req)
    cache.check()
    return slots


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_a_hit_ends_at_the_last_snapshot(cls, p):
    c = cls(256, page_size=p, state_slots=4)
    t = toks(40, 0)
    (slot,) = served(c, t, at=[3 * p])
    longer = np.concatenate([t, toks(8, 9)])
    assert c.match_prefix(longer) == 3 * p
    req = c.admit(longer)
    assert (req.num_cached, req.kv_matched, req.state_slot) == (3 * p, 40 // p * p, slot)
    assert c.stats.state_hit_tokens == c.stats.hit_tokens == 3 * p
    assert c.stats.state_pinned_slots == 1
    assert c.release_state(req) is True and req.state_slot is None
    assert c.stats.state_pinned_slots == 0
    c.abort(req)
    c.check()


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_after_a_snapshot_is_evicted_the_hit_falls_back_to_an_earlier_one(cls, p):
    c = cls(256, page_size=p, state_slots=2)
    t = toks(40, 1)
    early, late = served(c, t, at=[2 * p, 6 * p])
    # Two other snapshots take both slots: the one at 2 pages goes first, then the one at 6.
    req = c.admit(t)
    assert req.state_slot == late
    c.abort(req)  # unpinned: the hit refreshed the snapshot at 6 pages, and only it
    other = served(c, toks(8 * p, 2), at=[7 * p])
    assert other == [early]
    assert c.match_prefix(t) == 6 * p
    # Of the two left, the one at 6 pages saves less than other's (7 pages), and goes.
    served(c, toks(12, 3), at=[p])
    assert c.match_prefix(t) == 0
    assert c.stats.evicted_states == 2
    # The pages stayed: a new snapshot at 4 pages is hit without recomputing the KV.
    req = c.admit(t)
    assert req.kv_matched == 39 // p * p
    assert c.take_state(req, 4 * p) is not None
    c.commit(req, req.num_tokens)
    c.finish(req)
    assert c.match_prefix(t) == 4 * p
    c.check()


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_evicting_pages_evicts_the_snapshots_that_need_them(cls, p):
    c = cls(64, page_size=p, state_slots=4)
    t = toks(10 * p, 4)
    s2, s5, s10 = served(c, t, at=[2 * p, 5 * p, 10 * p])
    assert c.stats.state_free_slots == 1
    assert c.evict(5) == 5
    c.check()
    assert c.drain_freed_states() == [s10]
    assert c.evict(1) == 1
    assert c.drain_freed_states() == [s5]
    assert c.match_prefix(t) == 2 * p
    c.reset()
    assert c.drain_freed_states() == [s2]
    assert c.match_prefix(t) == 0
    assert c.stats.state_free_slots == 4 and c.stats.evicted_states == 3
    c.check()


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_a_pinned_snapshot_and_its_pages_stay(cls, p):
    c = cls(32, page_size=p, state_slots=1)
    t = toks(8 * p, 5)
    (slot,) = served(c, t, at=[4 * p])
    req = c.admit(t)
    assert req.state_slot == slot
    other = c.admit(toks(3 * p, 6))
    assert c.take_state(other, p) is None, "the only slot is pinned"
    c.evict(1000)
    c.reset()
    assert c.drain_freed_states() == []
    assert c.match_prefix(t) == 4 * p
    c.check()
    c.finish(req)  # unpins it
    assert c.take_state(other, p) == slot
    c.abort(other)
    assert c.drain_freed_states() == [slot]
    c.check()


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_superseded_snapshots_are_evicted_before_the_least_recently_used(cls, p):
    c = cls(256, page_size=p, state_slots=4)
    other = toks(4 * p, 20)
    served(c, other, at=[p])  # the least recently used from here on
    # A session's turn: snapshots at its prompt's end (3 pages) and its last token (6).
    turn1 = toks(6 * p, 21)
    prompt_end, turn_end = served(c, turn1, at=[3 * p, 6 * p])
    # The next turn continues from the first's end (a hit) and publishes its own end.
    turn2 = np.concatenate([turn1, toks(4 * p, 22)])
    req = c.admit(turn2)
    assert req.state_slot == turn_end
    c.release_state(req)
    assert c.take_state(req, 10 * p) is not None
    c.commit(req, req.num_tokens)
    c.finish(req)
    c.check()
    # Both of turn 1's snapshots are superseded: they go before the other session's.
    taken = served(c, toks(2 * p, 23), at=[p]) + served(c, toks(2 * p, 24), at=[p])
    assert taken == [prompt_end, turn_end]
    assert c.match_prefix(other) == p
    assert c.match_prefix(np.concatenate([turn2, toks(p, 25)])) == 10 * p
    assert c.match_prefix(np.concatenate([turn1, toks(p, 25)])) == 0


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_of_the_warm_snapshots_the_one_saving_least_goes_first(cls, p):
    c = cls(256, page_size=p, state_slots=3)
    t = toks(12 * p, 30)
    served(c, t)
    # A junction at 8 pages (another request's KV ran there), then a turn one page past it.
    req = c.admit(np.concatenate([t[: 8 * p], toks(8, 31)]))
    assert req.kv_matched == 8 * p
    junction = c.take_state(req, 8 * p)
    c.commit(req, 8 * p)
    c.finish(req)
    turn = np.concatenate([t[: 8 * p], toks(2 * p, 32)])
    req = c.admit(turn)
    assert req.state_slot == junction
    c.release_state(req)
    past = c.take_state(req, 9 * p)
    c.commit(req, req.num_tokens)
    c.finish(req)
    (small,) = served(c, toks(3 * p, 33), at=[3 * p])
    # The turn's snapshot saves 1 page past the junction, the junction 8, the last one 3:
    # the turn's goes, though it was used after the junction.
    assert served(c, toks(2 * p, 34), at=[2 * p]) == [past]
    assert c.match_prefix(np.concatenate([turn, toks(1, 35)])) == 8 * p
    assert c.match_prefix(np.concatenate([toks(3 * p, 33), toks(1, 35)])) == 3 * p
    assert small != past
    c.check()


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_evict_state_evicts_one_snapshot_and_keeps_its_pages(cls, p):
    c = cls(256, page_size=p, state_slots=2)
    t = toks(8 * p, 26)
    early, late = served(c, t, at=[2 * p, 6 * p])
    assert c.evict_state(late) is True
    assert c.drain_freed_states() == [late] and c.stats.evicted_states == 1
    assert c.evict_state(late) is False, "free already"
    req = c.admit(t)
    assert (req.num_cached, req.kv_matched) == (2 * p, 7 * p)
    assert c.evict_state(early) is False, "pinned by the hit"
    c.release_state(req)
    assert c.evict_state(early) is True
    c.abort(req)
    c.check()
    digest = c.state_digest()
    with pytest.raises(ValueError, match=r"slot.*2"):
        c.evict_state(2)
    with pytest.raises((ValueError, TypeError), match="slot"):
        c.evict_state(-1)
    assert c.state_digest() == digest


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_namespaces_never_share_snapshots(cls, p):
    c = cls(128, page_size=p, state_slots=4)
    t = toks(10 * p, 7)
    served(c, t, at=[5 * p], namespace="tenant-a")
    assert c.match_prefix(t, namespace="tenant-a") == 5 * p
    assert c.match_prefix(t) == 0
    assert c.match_prefix(t, namespace=b"tenant-a") == 5 * p  # str is its utf-8 bytes
    assert c.match_prefix(t, namespace="tenant-b") == 0
    req = c.admit(t, namespace="tenant-b")
    assert req.state_slot is None and req.num_cached == 0
    c.abort(req)


@pytest.mark.parametrize(("cls", "p"), CACHES)
def test_bad_arguments_are_named_and_change_nothing(cls, p):
    with pytest.raises(ValueError, match="state_slots"):
        cls(16, page_size=p, state_slots=-1)
    with pytest.raises(ValueError, match="disk tier"):
        cls(16, page_size=p, host_pages=8, disk_pages=8, state_slots=2)
    c = cls(64, page_size=p, state_slots=2)
    req = c.admit(toks(10 * p, 8))
    digest = c.state_digest()
    for pos in (0, 11 * p, -1):
        with pytest.raises(ValueError, match=rf"pos.*{pos}|{pos}.*pos"):
            c.take_state(req, pos)
    if p > 1:
        with pytest.raises(ValueError, match="multiple of page_size"):
            c.take_state(req, p + 1)
    assert c.state_digest() == digest
    c.abort(req)
    with pytest.raises(radixkv.Error):
        c.take_state(req, p)
    plain = cls(16, page_size=p)
    r = plain.admit(toks(2 * p, 9))
    with pytest.raises(ValueError, match="state_slots=0"):
        plain.take_state(r, p)
    assert plain.stats.state_slots == 0 and plain.release_state(r) is False
    plain.abort(r)


def test_stats_name_the_state_counters():
    c = radixkv.RadixCache(32, state_slots=3)
    served(c, toks(9, 10), at=[4, 8])
    d = c.stats.as_dict()
    assert d["state_slots"] == 3 and d["state_free_slots"] == 1
    assert d["taken_states"] == 2 and d["evicted_states"] == 0
    assert d["state_hit_tokens"] == 0 and d["state_pinned_slots"] == 0
