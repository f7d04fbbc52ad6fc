"""The engine: continuous batching with caching on equals caching off equals a dense oracle."""

from __future__ import annotations

import numpy as np
import pytest

import radixkv
from tiny_model import CACHES, dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=11)
POLICIES = ["fcfs", "lpm", "dfs-weight"]


def workload(seed=0) -> list[np.ndarray]:
    """Prompts sharing a long prefix, a short one, and unrelated ones; mixed lengths."""
    rng = np.random.default_rng(seed)
    system = ids(rng, 90)
    prompts = [np.concatenate([system, ids(rng, n)]) for n in (5, 40, 17, 1)]
    prompts += [ids(rng, 33), ids(rng, 120), np.concatenate([system[:30], ids(rng, 8)])]
    return prompts


def assert_drained(eng: radixkv.Engine) -> None:
    eng.cache.check()
    assert not eng.has_work and eng.cache.stats.used_pages == 0


@pytest.mark.parametrize("make_cache", CACHES)
def test_greedy_identical_with_and_without_cache(make_cache, engine):
    prompts = workload()
    on = engine(make_cache, token_budget=64, max_batch=5)
    first = on.generate(prompts[:1], max_new_tokens=8)  # publish the shared prefix first
    got = first + on.generate(prompts[1:], max_new_tokens=8)
    off = engine(make_cache, caching=False, token_budget=64, max_batch=5).generate(
        prompts, max_new_tokens=8
    )
    assert [r.output for r in got] == [r.output for r in off]
    assert [r.output for r in got] == [dense_greedy(MODEL, p, 8) for p in prompts]
    assert sum(r.cached_tokens for r in got) >= 3 * 80 and all(r.cached_tokens == 0 for r in off)
    for r, p in zip(got, prompts):
        assert r.prompt_tokens == len(p) and r.finish_reason == "length"
        assert r.computed_tokens == len(p) - r.cached_tokens
        assert 0 < r.ttft_s <= r.latency_s
    assert_drained(on)


@pytest.mark.parametrize("make_cache", CACHES)
def test_preemption_in_a_tiny_pool_keeps_tokens_identical(make_cache, engine):
    prompts = workload(1)
    eng = engine(make_cache, tokens=192, token_budget=128)
    got = eng.generate(prompts, max_new_tokens=24)
    assert eng.stats.preemptions > 0
    assert [r.output for r in got] == [dense_greedy(MODEL, p, 24) for p in prompts]
    assert_drained(eng)


@pytest.mark.parametrize("length", [63, 64, 65, 129, 150])
def test_chunked_prefill(length, engine):
    """A prompt longer than the budget is prefilled in budget-sized chunks, then decoded."""
    prompt = ids(np.random.default_rng(length), length)
    eng = engine(CACHES[0].values[0], token_budget=64)
    (r,) = eng.generate([prompt], max_new_tokens=4)
    assert r.output == dense_greedy(MODEL, prompt, 4)
    assert eng.stats.steps == -(-length // 64) + 3 and r.computed_tokens == length


def test_token_budget_and_batch_limit_hold_every_step(engine):
    eng = engine(CACHES[0].values[0], token_budget=50, max_batch=3)
    got = eng.generate(workload(2), max_new_tokens=5)
    assert eng.stats.max_step_tokens == 50 and eng.stats.max_step_requests == 3
    assert [r.output for r in got] == [dense_greedy(MODEL, p, 5) for p in workload(2)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("make_cache", CACHES)
def test_branches_share_one_context(make_cache, policy, engine):
    rng = np.random.default_rng(3)
    context = ids(rng, 70)
    suffixes = [ids(rng, n) for n in (6, 0, 11)]
    eng = engine(make_cache, policy=policy)
    got = eng.run(eng.branch(context, suffixes, max_new_tokens=6))
    want = [dense_greedy(MODEL, np.concatenate([context, s]), 6) for s in suffixes]
    assert [r.output for r in got] == want
    p = eng.cache.page_size
    # Every full page of the held context, within each branch's match limit.
    for r, s in zip(got, suffixes):
        assert r.cached_tokens == min(70 // p * p, (69 + len(s)) // p * p)
    parent = [s for s in eng.sequences.values() if s.children]
    assert len(parent) == 1 and parent[0].finish_reason == "context"
    off = engine(make_cache, caching=False)
    assert [r.output for r in off.run(off.branch(context, suffixes, max_new_tokens=6))] == want
    assert_drained(eng)


def test_cancelled_branches_do_not_run(engine):
    eng = engine(CACHES[0].values[0])
    rng = np.random.default_rng(9)
    context = ids(rng, 40)
    a, b = eng.branch(context, [ids(rng, 3), ids(rng, 5)], max_new_tokens=4)
    assert eng.cancel(a)  # before its context is even computed
    (rb,) = eng.run([b])
    assert eng.result(a).output == [] and eng.result(a).finish_reason == "cancelled"
    assert rb.output == dense_greedy(
        MODEL, np.concatenate([context, eng.sequences[b].prompt[40:]]), 4
    )
    assert_drained(eng)


def test_session_turns_reuse_the_whole_conversation(engine):
    eng = engine(CACHES[0].values[0])
    rng = np.random.default_rng(4)
    session = radixkv.Session(eng, system=ids(rng, 50))
    r1 = session.send(ids(rng, 10), max_new_tokens=5)
    session.append(ids(rng, 7))  # tool output
    r2 = session.send(ids(rng, 9), max_new_tokens=5)
    # Everything of turn 1 but its last sampled token (never fed back) was cached.
    assert r2.cached_tokens == r1.prompt_tokens + len(r1.output) - 1
    assert r2.prompt_tokens == r1.prompt_tokens + 5 + 7 + 9 == len(session) - 5
    assert r2.output == dense_greedy(MODEL, session.history[:-5], 5)
    subs = session.branch([ids(rng, 4), ids(rng, 6)], max_new_tokens=3)
    assert all(s.cached_tokens >= len(session) - 1 for s in subs)
    assert len(session.fork()) == len(session)


def test_sampling_is_seeded_per_request(engine):
    prompts = workload(5)[:3]
    runs = [
        engine(CACHES[0].values[0], caching=c).generate(
            prompts, max_new_tokens=12, temperature=1.0, seed=9
        )
        for c in (True, False)
    ]
    assert [r.output for r in runs[0]] == [r.output for r in runs[1]]
    assert [r.output for r in runs[0]] != [dense_greedy(MODEL, p, 12) for p in prompts]


def test_stop_tokens_end_generation(engine):
    prompt = workload()[0]
    greedy = dense_greedy(MODEL, prompt, 6)
    (r,) = engine(CACHES[0].values[0]).generate([prompt], max_new_tokens=6, stop=[greedy[2]])
    assert r.output == greedy[: greedy.index(greedy[2]) + 1] and r.finish_reason == "stop"


def test_request_larger_than_the_pool_is_refused_at_submit(engine):
    eng = engine(CACHES[0].values[0], tokens=64)
    rng = np.random.default_rng(6)
    with pytest.raises(ValueError, match=r"prompt of 80 tokens .* needs 83 pages .* only 64 pages"):
        eng.submit(ids(rng, 80), max_new_tokens=4)
    # Prompt and output together: 61 + 4 - 1 = 64 fits, 61 + 5 - 1 does not.
    eng.submit(ids(rng, 61), max_new_tokens=4)
    with pytest.raises(ValueError, match="needs 65 pages"):
        eng.submit(ids(rng, 61), max_new_tokens=5)
    with pytest.raises(ValueError, match="branch 1 of 66 tokens"):
        eng.branch(ids(rng, 60), [ids(rng, 2), ids(rng, 6)], max_new_tokens=1)
    assert len(eng.sequences) == 1  # nothing of a refused request or branch was queued
    small = eng.submit(ids(rng, 20), 4)
    (small_r,) = eng.run([small])
    assert small_r.finish_reason == "length" and len(small_r.output) == 4
    eng.run()
    assert_drained(eng)


def test_cancel_and_prefill_only(engine):
    eng = engine(CACHES[0].values[0])
    rng = np.random.default_rng(7)
    doc = ids(rng, 60)
    (warm,) = eng.generate([doc], max_new_tokens=0)
    assert warm.output == [] and warm.ttft_s is None and warm.finish_reason == "length"
    a = eng.submit(np.concatenate([doc, ids(rng, 3)]), max_new_tokens=50)
    eng.step()
    assert eng.cancel(a) and not eng.cancel(a)
    assert eng.result(a).finish_reason == "cancelled" and eng.result(a).cached_tokens == 60
    assert_drained(eng)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tokens", [4096, 200])
def test_every_policy_gives_the_same_tokens(policy, tokens):
    """Prompts longer than the budget (admitted in part); a pool that preempts."""
    prompts = workload(8)
    cache = radixkv.RadixCache(tokens)
    eng = radixkv.Engine(MODEL, MODEL.make_kv_cache(cache), token_budget=100, policy=policy)
    got = eng.generate(prompts, max_new_tokens=6)
    assert [r.output for r in got] == [dense_greedy(MODEL, p, 6) for p in prompts]
    assert all(r.finish_reason == "length" for r in got)
    assert (eng.stats.preemptions > 0) == (tokens == 200)
    assert_drained(eng)


def test_bad_arguments_are_named(engine):
    eng = engine(CACHES[0].values[0])
    with pytest.raises(ValueError, match="prompt holds token id 512, outside the vocabulary"):
        eng.submit([1, 512])
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        eng.submit([])
    with pytest.raises(
        ValueError, match=r"max_new_tokens must be an int in \[0, 2\*\*32\), got -1"
    ):
        eng.submit([1], max_new_tokens=-1)
    with pytest.raises(ValueError, match="token_budget must be a positive int, got 0"):
        radixkv.Engine(MODEL, eng.kv, token_budget=0)
    with pytest.raises(ValueError, match="policy must be 'fcfs', 'lpm' or 'dfs-weight'"):
        radixkv.Engine(MODEL, eng.kv, policy="sjf")
