"""Retention above the core: ``Session(keep_alive=...)`` keeps an agent's history cached while
it waits on a tool and unrelated requests go through, ``close()`` gives it back to LRU, and the
tokens are what a dense recompute gives either way (tiny built-in model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import radixkv
from tiny_model import dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=5)
PAGE = 4


def engine(num_pages: int, cache_cls=radixkv.RadixCache) -> radixkv.Engine:
    cache = cache_cls(num_pages, page_size=PAGE)
    return radixkv.Engine(MODEL, MODEL.make_kv_cache(cache), token_budget=256)


def agent_then_traffic(
    keep_alive: float, cache_cls=radixkv.RadixCache
) -> tuple[radixkv.Session, radixkv.Result]:
    """An agent's turn, then unrelated one-shot requests that fill the pool, then its next
    turn; returns the session and that turn's result."""
    rng = np.random.default_rng(3)
    eng = engine(num_pages=40, cache_cls=cache_cls)
    agent = radixkv.Session(eng, system=ids(rng, 60), keep_alive=keep_alive)
    agent.send(ids(rng, 8), max_new_tokens=4)
    for _ in range(6):  # the agent waits on its tool meanwhile
        eng.generate([ids(rng, 50)], max_new_tokens=2, release=True)
    history = agent.history.copy()
    tool = ids(rng, 8)
    result = agent.send(tool, max_new_tokens=4)
    want = dense_greedy(MODEL, np.concatenate([history, tool]), 4)
    assert result.output == want, "retention must never change the tokens"
    return agent, result


@pytest.mark.parametrize("cache_cls", [radixkv.RadixCache, radixkv.BlockCache])
def test_a_paused_agent_keeps_its_history_with_keep_alive(cache_cls):
    _, plain = agent_then_traffic(keep_alive=0.0, cache_cls=cache_cls)
    agent, kept = agent_then_traffic(keep_alive=math.inf, cache_cls=cache_cls)
    assert plain.cached_tokens < 16, "without retention the traffic evicts the history"
    assert kept.cached_tokens >= len(agent.history) - 4 - 8 - PAGE, kept
    stats = agent.engine.cache.stats
    assert stats.forced_evictions == 0 and stats.retentions == 1
    assert agent.retention == kept.retention is not None
    agent.close()
    assert agent.engine.cache.stats.retentions == 0 and agent.retention is None
    agent.engine.cache.check()


def test_each_turn_takes_over_the_last_ones_retention():
    rng = np.random.default_rng(1)
    eng = engine(num_pages=64)
    s = radixkv.Session(eng, system=ids(rng, 20), keep_alive=600.0, cache_priority=1)
    first = s.send(ids(rng, 4), max_new_tokens=2).retention
    second = s.send(ids(rng, 4), max_new_tokens=2).retention
    assert first is not None and second is not None and first != second
    assert eng.cache.stats.retentions == 1, "the first turn's was released"
    assert not eng.cache.release_retention(first)
    branches = s.branch([ids(rng, 3), ids(rng, 3)], max_new_tokens=2)
    assert all(b.retention is None for b in branches), "sub-agents are not retained"
    s.close()
    eng.cache.check()


def test_retention_arguments_are_checked_up_front():
    eng = engine(num_pages=32)
    for bad, match in (
        (dict(retain=-1.0), "retain must be seconds"),
        (dict(retain="soon"), "retain must be seconds"),
        (dict(cache_priority=radixkv.EVICTION_CLASSES), "cache_priority must be an eviction"),
        (dict(cache_priority=True), "cache_priority"),
    ):
        with pytest.raises(ValueError, match=match):
            eng.submit([1, 2, 3], **bad)
    assert not eng.has_work
    with pytest.raises(ValueError, match=r"keep_alive|retain"):
        radixkv.Session(eng, keep_alive=-5)


def test_retain_prefix_holds_exactly_a_prefix_through_traffic():
    """``Engine.retain_prefix``: a prefix shorter than the request that computed it (a cache
    breakpoint inside a prompt) stays cached through traffic that evicts everything else,
    the request's tail past it does not; releasing it gives it back to LRU."""
    rng = np.random.default_rng(7)
    eng = radixkv.Engine(MODEL, MODEL.make_kv_cache(radixkv.RadixCache(100)), token_budget=256)
    prompt = ids(rng, 61)
    eng.generate([prompt], max_new_tokens=2, release=True)
    cut = 37  # any token, not a page boundary of anything
    counted = lambda s: (s.queries, s.query_tokens, s.hit_tokens)  # noqa: E731
    before = counted(eng.cache.stats)
    retention, held = eng.retain_prefix(prompt[:cut], 600.0)
    assert retention is not None and held == cut
    assert counted(eng.cache.stats) == before, "a retention is no admission: no query, no hit"
    for _ in range(6):
        eng.generate([ids(rng, 60)], max_new_tokens=2, release=True)
    assert eng.cache.match_prefix(prompt, None) == cut, "the prefix, and not a token more"
    assert eng.cache.stats.forced_evictions == 0
    [again] = eng.generate([prompt], max_new_tokens=2, release=True)
    assert again.output == dense_greedy(MODEL, prompt, 2), "the retained KV is the prompt's"
    assert eng.release_retention(retention)
    for _ in range(6):
        eng.generate([ids(rng, 60)], max_new_tokens=2, release=True)
    assert eng.cache.match_prefix(prompt, None) < cut, "released, LRU evicts it"
    assert eng.retain_prefix(ids(rng, 5), 600.0) == (None, 0), "nothing cached: no retention"
    eng.cache.check()


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((["a", "b"], 5.0), "tokens must be a 1-D sequence of ints"),
        (([[1, 2]], 5.0), r"tokens must be a 1-D sequence of ints, got shape \(1, 2\)"),
        (([-1, 3], 5.0), "tokens holds token id -1, outside the vocabulary"),
        (([1, 10**6], 5.0), "tokens holds token id 1000000, outside the vocabulary"),
        (([1, 2], 5.0, 3), "namespace must be None, a str or bytes, got 3"),
        (([1, 2], -1.0), r"seconds must be seconds >= 0 \(or math.inf\), got -1.0"),
        (([1, 2], "5"), r"seconds must be seconds \(a number >= 0\), got '5'"),
        (([1, 2], 5.0, None, 99), r"cache_priority must be an eviction class in \[0, 3\]"),
    ],
)
def test_retain_prefix_refuses_bad_arguments_by_name_and_changes_nothing(args, match):
    rng = np.random.default_rng(8)
    eng = radixkv.Engine(MODEL, MODEL.make_kv_cache(radixkv.RadixCache(100)), token_budget=256)
    prompt = ids(rng, 30)
    eng.generate([prompt], max_new_tokens=2, release=True)
    before = (eng.cache.state_digest(), eng.cache.stats.used_pages, eng.cache.stats.retentions)
    with pytest.raises(ValueError, match=match):
        eng.retain_prefix(*args)
    after = (eng.cache.state_digest(), eng.cache.stats.used_pages, eng.cache.stats.retentions)
    assert after == before and after[1] == 0, "nothing pinned, nothing changed"
    eng.cache.check()
