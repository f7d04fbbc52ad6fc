"""The engine's step packer: chunked admission through the scheduler under every policy, the
sequence's own copy of its request's counts, and a fixed number of calls into Rust per step."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import radixkv
from tiny_model import CACHES, dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=23)
POLICIES = ["fcfs", "lpm", "dfs-weight"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("make_cache", CACHES)
def test_prompts_longer_than_the_budget_are_admitted_in_part(make_cache, policy, engine):
    rng = np.random.default_rng(5)
    shared = ids(rng, 70)
    prompts = [
        ids(rng, 150),
        np.concatenate([shared, ids(rng, 60)]),
        np.concatenate([shared, ids(rng, 45)]),
        ids(rng, 9),
    ]
    runs = {}
    for caching in (True, False):
        eng = engine(
            make_cache, token_budget=48, max_batch=3, prefix_caching=caching, policy=policy
        )
        ids_ = [eng.submit(p, max_new_tokens=5) for p in prompts]
        eng.step()
        running = eng.batcher.running  # the budget is spent: the last one admitted in part
        assert sum(s.req.num_tokens - s.req.num_cached for s in running) == 48
        assert any(s.req.num_tokens < len(s.prompt) for s in running)
        runs[caching] = eng.run(ids_)
        assert eng.stats.max_step_tokens <= 48 and eng.stats.max_step_requests <= 3
        eng.cache.check()
        assert not eng.has_work and eng.cache.stats.used_pages == 0
    want = [dense_greedy(MODEL, p, 5) for p in prompts]
    assert [r.output for r in runs[True]] == [r.output for r in runs[False]] == want
    for r, p in zip(runs[True], prompts):
        assert r.computed_tokens == len(p) - r.cached_tokens and r.finish_reason == "length"


@pytest.mark.parametrize("policy", POLICIES)
def test_tracked_counts_match_the_requests_every_step(policy, engine):
    """The sequence's copy of ``num_tokens``/``num_computed`` never drifts from Rust's, through
    chunked prefill, decodes and preemptions in a tiny pool."""
    rng = np.random.default_rng(8)
    eng = engine(CACHES[0].values[0], tokens=160, token_budget=40, policy=policy)
    for n in (90, 30, 70, 12, 55):
        eng.submit(ids(rng, n), max_new_tokens=12)
    while eng.has_work:
        eng.step()
        for seq in eng.batcher.running + eng.batcher.held:
            assert (seq.num_tokens, seq.num_computed) == (seq.req.num_tokens, seq.req.num_computed)
    assert eng.stats.preemptions > 0


class Counting:
    """Forwards every attribute to ``target`` and counts the calls of its methods."""

    def __init__(self, target, calls: collections.Counter) -> None:
        self._target, self._calls = target, calls

    def __getattr__(self, name):
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._calls[name] += 1
            return attr(*args, **kwargs)

        return call

    def __len__(self) -> int:
        return len(self._target)


def counted_engine(engine, monkeypatch, tokens: int, budget: int):
    eng = engine(CACHES[0].values[0], tokens=tokens, token_budget=budget, max_batch=64)
    calls: collections.Counter = collections.Counter()
    cache = Counting(eng.cache, calls)
    eng.cache = eng.kv.cache = eng.batcher.cache = cache
    eng.batcher.scheduler = Counting(eng.batcher.scheduler, calls)
    plan_step = radixkv.plan_step

    def counted_plan(requests, cache=None):
        calls["plan_step"] += 1
        return plan_step(requests, cache)

    monkeypatch.setattr(radixkv, "plan_step", counted_plan)
    return eng, calls


@pytest.mark.parametrize("tokens", [1 << 14, 700])
def test_a_step_calls_into_rust_a_fixed_number_of_times(engine, monkeypatch, tokens):
    """Per step: one plan, one commit, one extend for the running sequences (one more per
    preemption), at most one schedule call; per request: one finish (or abort when preempted).
    Never a per-request extend/commit in the step loop, however many sequences run."""
    rng = np.random.default_rng(2)
    eng, calls = counted_engine(engine, monkeypatch, tokens, budget=256)
    n = 24
    results = eng.generate([ids(rng, 20 + i) for i in range(n)], max_new_tokens=10)
    assert all(r.finish_reason == "length" for r in results)
    steps, pre = eng.stats.steps, eng.stats.preemptions
    assert steps >= 10 and (pre > 0) == (tokens == 700)
    assert calls["plan_step"] == calls["commit_many"] == steps
    assert calls["extend_many"] <= steps + pre
    assert calls["schedule"] <= steps + 1
    assert calls["finish"] == n and calls["abort"] == pre
    per_request = {"extend", "commit", "admit", "fork", "match_prefix"}
    assert not per_request & set(calls), calls
    # Per request at submit: check_fits (the pool-fit rule, the core's) and add; at the end,
    # finish. Decodes of 24 sequences over 10+ steps: per-request calls would be in the hundreds.
    assert calls["check_fits"] == n
    assert sum(calls.values()) <= 4 * steps + 3 * n + 3 * pre
