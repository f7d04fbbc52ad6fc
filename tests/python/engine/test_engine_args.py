"""The engine refuses bad arguments at call time (nothing registered) and survives failures
inside a step: the failing requests end with ``finish_reason="error"``, the rest run on, every
page comes back, and no later ``run()`` hangs."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import radixkv
from tiny_model import CACHES, VOCAB, dense_greedy, ids, tiny_model

pytestmark = pytest.mark.robust

MODEL = tiny_model(seed=5)
POISON = VOCAB - 1  # a prompt holding this token makes the failing models below fail
MAX_STEPS = 200  # every test here finishes in far fewer steps


def engine(tokens=2048, model=MODEL, make_cache=CACHES[0].values[0], **kw) -> radixkv.Engine:
    return radixkv.Engine(model, MODEL.make_kv_cache(make_cache(tokens)), **kw)


def watchdog(eng: radixkv.Engine, limit: int = MAX_STEPS) -> None:
    """Makes ``eng.step`` fail the test once it has been called ``limit`` times: a ``run()``
    that spins ends instead of hanging the suite."""
    step, count = eng.step, [0]

    def counted():
        count[0] += 1
        assert count[0] <= limit, f"run() did not return within {limit} steps"
        return step()

    eng.step = counted


def assert_drained(eng: radixkv.Engine) -> None:
    eng.cache.check()
    assert not eng.has_work and eng.cache.stats.used_pages == 0


def prompt(seed: int, n: int = 12, poison: bool = False) -> np.ndarray:
    p = ids(np.random.default_rng(seed), n) % POISON  # never the poison token by chance
    if poison:
        p[3] = POISON
    return p.astype(np.uint32)


class FailingModel(torch.nn.Module):
    """The tiny model, but a forward pass whose batch holds the poison token raises
    (``always=False``: only the first such pass); ``nan_rows``: instead of raising, the logits
    row of every request holding the poison token is NaN (so sampling it fails)."""

    def __init__(self, always=True, nan_rows=False, exc=RuntimeError, poison=POISON) -> None:
        super().__init__()
        self.inner, self.config, self.poison = MODEL, MODEL.config, poison
        self.always, self.nan_rows, self.exc, self.raised = always, nan_rows, exc, 0

    def forward(self, step):
        logits = self.inner(step)
        if self.nan_rows:
            logits = logits.clone()
            for row, req in enumerate(step.requests):
                if self.poison in np.asarray(req.tokens):
                    logits[row] = math.nan
            return logits
        if bool((step.input_ids == self.poison).any()) and (self.always or not self.raised):
            self.raised += 1
            raise self.exc("injected failure")
        return logits


# ---- arguments ------------------------------------------------------------------------------

BAD = [
    ("prompt", [1.5, 2.0], "prompt must be a 1-D sequence of ints"),
    ("prompt", "abc", "prompt must be a 1-D sequence of ints"),
    ("prompt", [[1, 2], [3]], "prompt must be a 1-D sequence of ints"),
    ("prompt", [True, False], "prompt must be a 1-D sequence of ints"),
    ("prompt", None, "prompt must be a 1-D sequence of ints"),
    ("prompt", [2**70], "prompt"),
    ("prompt", [VOCAB], "prompt holds token id 512"),
    ("max_new_tokens", -1, r"max_new_tokens must be an int in \[0, 2\*\*32\), got -1"),
    ("max_new_tokens", 1.5, r"max_new_tokens must be an int in \[0, 2\*\*32\), got 1.5"),
    ("max_new_tokens", None, r"max_new_tokens must be an int in \[0, 2\*\*32\), got None"),
    ("max_new_tokens", True, r"max_new_tokens must be an int in \[0, 2\*\*32\), got True"),
    ("max_new_tokens", 2**80, r"max_new_tokens must be an int in \[0, 2\*\*32\), got 1208"),
    # The scheduler's bound: refused when submitted, not when a branch is queued later.
    ("max_new_tokens", 2**32, r"max_new_tokens must be an int in \[0, 2\*\*32\), got 4294967296"),
    ("temperature", -0.5, "temperature must be a finite number >= 0, got -0.5"),
    ("temperature", math.nan, "temperature must be a finite number >= 0, got nan"),
    ("temperature", math.inf, "temperature must be a finite number >= 0, got inf"),
    ("temperature", "0.5", "temperature must be a finite number >= 0, got '0.5'"),
    ("temperature", None, "temperature must be a finite number >= 0, got None"),
    ("stop", [VOCAB], r"stop must be token ids in \[0, 512\), got 512"),
    ("stop", [-1], "stop must be token ids"),
    ("stop", [2**70], "stop must be token ids"),
    ("stop", ["a"], "stop must be token ids"),
    ("stop", [True], "stop must be token ids"),
    ("stop", 5, "stop must be an iterable of token ids, got 5"),
    ("stop", "ab", "stop must be an iterable of token ids, got 'ab'"),
    ("namespace", 5, "namespace must be None, a str or bytes, got 5"),
    ("namespace", ["a"], "namespace must be None, a str or bytes"),
    ("namespace", bytearray(b"a"), "namespace must be None, a str or bytes"),
    ("seed", 2**70, r"seed must be an int in \[0, 2\*\*63\), got 1180591620717411303424"),
    ("seed", 2**63, r"seed must be an int in \[0, 2\*\*63\)"),
    ("seed", -1, r"seed must be an int in \[0, 2\*\*63\), got -1"),
    ("seed", 1.5, "seed must be an int .* got 1.5"),
    ("seed", None, "seed must be an int .* got None"),
    ("seed", True, "seed must be an int .* got True"),
    ("priority", 2**40, r"priority must be an int in \[-2\*\*31, 2\*\*31\), got 1099511627776"),
    ("priority", 2**31, r"priority must be an int in \[-2\*\*31, 2\*\*31\)"),
    ("priority", -(2**31) - 1, r"priority must be an int in \[-2\*\*31, 2\*\*31\)"),
    ("priority", 0.5, "priority must be an int .* got 0.5"),
    ("priority", None, "priority must be an int .* got None"),
]


def good_args() -> dict:
    return dict(
        prompt=prompt(1), max_new_tokens=3, temperature=0.0, stop=(), namespace=None, seed=0
    )


@pytest.mark.parametrize(("name", "value", "match"), BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_submit_refuses_a_bad_argument_and_registers_nothing(name, value, match):
    eng = engine()
    keep = eng.submit(prompt(2), max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
        eng.submit(**{**good_args(), "priority": 0, name: value})
    assert list(eng.sequences) == [keep] and eng.batcher.num_waiting == 1
    watchdog(eng)
    (r,) = eng.run()
    assert r.output == dense_greedy(MODEL, prompt(2), 2)
    assert_drained(eng)


@pytest.mark.parametrize(("name", "value", "match"), [b for b in BAD if b[0] != "priority"])
def test_branch_and_generate_refuse_a_bad_argument_and_register_nothing(name, value, match):
    eng = engine()
    args = good_args()
    context = args.pop("prompt")
    if name == "prompt":
        with pytest.raises(ValueError, match=match.replace("prompt", "context")):
            eng.branch(value, [[1]], **args)
        with pytest.raises(ValueError, match=match.replace("prompt", "suffixes\\[1\\]")):
            eng.branch(context, [[1], value], **args)
    else:  # branch seeds read "in [0, 2**63 - 2]": two branches use seed and seed + 1
        with pytest.raises(ValueError, match="seed must be an int" if name == "seed" else match):
            eng.branch(context, [[1], [2]], **{**args, name: value})
    with pytest.raises(ValueError, match=match):
        if name == "prompt":
            eng.generate([prompt(3), value], **args)
        else:
            eng.generate([prompt(3), prompt(4)], **{**args, name: value})
    assert not eng.sequences and not eng.has_work


def test_branch_seeds_must_all_be_valid():
    eng = engine()
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63 - 3\]"):
        eng.branch(prompt(1), [[1], [2], [3]], seed=2**63 - 2)
    with pytest.raises(ValueError, match="suffixes must be a list of token sequences"):
        eng.branch(prompt(1), "abc")
    with pytest.raises(ValueError, match="suffixes must hold at least one branch"):
        eng.branch(prompt(1), iter([]))
    assert not eng.sequences
    got = eng.run(eng.branch(prompt(1), [[1], [2], [3]], max_new_tokens=2, seed=2**63 - 3))
    assert [r.finish_reason for r in got] == ["length"] * 3


def test_generate_with_an_unknown_parameter_registers_nothing():
    eng = engine()
    with pytest.raises(TypeError, match=r"unknown parameters \['max_tokens'\]"):
        eng.generate([prompt(1)], max_tokens=3)
    assert not eng.sequences


def test_unknown_ids_are_named():
    eng = engine()
    with pytest.raises(KeyError, match="no request with id 7"):
        eng.cancel(7)
    with pytest.raises(KeyError, match="no request with id 'a'"):
        eng.result("a")
    a = eng.submit(prompt(1), max_new_tokens=1)
    with pytest.raises(KeyError, match="no request with id 9"):
        eng.run([a, 9])
    assert not eng.sequences[a].done  # nothing ran
    eng.run()
    assert_drained(eng)


def test_session_refuses_bad_arguments_and_keeps_its_history():
    eng = engine()
    with pytest.raises(ValueError, match="namespace must be None, a str or bytes, got 5"):
        radixkv.Session(eng, system=prompt(1), namespace=5)
    with pytest.raises(ValueError, match=r"engine must be a radixkv\.Engine"):
        radixkv.Session(object())
    s = radixkv.Session(eng, system=prompt(1), namespace="tenant")
    before = s.history.copy()
    for kw in ({"seed": 2**70}, {"max_new_tokens": -1}, {"stop": [VOCAB]}, {"temperature": -1}):
        with pytest.raises(ValueError):
            s.send(prompt(2, 4), **kw)
        assert np.array_equal(s.history, before) and not eng.sequences
    with pytest.raises(ValueError, match="message must be a 1-D sequence of ints"):
        s.send([1.5])
    assert np.array_equal(s.history, before) and not eng.sequences
    r = s.send(prompt(2, 4), max_new_tokens=3)
    assert r.output == dense_greedy(MODEL, np.concatenate([before, prompt(2, 4)]), 3)


# ---- failures inside a step -----------------------------------------------------------------


@pytest.mark.parametrize("make_cache", CACHES)
def test_a_model_error_fails_its_batch_only(make_cache):
    """One request per step: the poisoned one fails with the model's error, every other one
    gives the dense tokens, every page comes back, and the engine keeps serving."""
    eng = engine(model=FailingModel(), make_cache=make_cache, max_batch=1)
    watchdog(eng)
    prompts = [prompt(10), prompt(11, 40, poison=True), prompt(12, 30)]
    got = eng.generate(prompts, max_new_tokens=5)
    assert [r.finish_reason for r in got] == ["length", "error", "length"]
    assert isinstance(got[1].error, RuntimeError) and str(got[1].error) == "injected failure"
    assert got[0].error is None and got[1].output == []
    for r, p in zip(got, prompts):
        if r.finish_reason == "length":
            assert r.output == dense_greedy(MODEL, p, 5)
    assert_drained(eng)
    (again,) = eng.generate([prompt(13)], max_new_tokens=4)  # still serving
    assert again.output == dense_greedy(MODEL, prompt(13), 4)
    assert [r.finish_reason for r in eng.run()] == ["length", "error", "length", "length"]
    assert_drained(eng)


def test_a_failing_step_in_a_shared_batch_fails_the_batch_and_later_requests_run():
    eng = engine(model=FailingModel(always=False))
    watchdog(eng)
    got = eng.generate([prompt(20), prompt(21, poison=True)], max_new_tokens=4)
    assert [r.finish_reason for r in got] == ["error", "error"]
    assert got[0].error is got[1].error
    assert_drained(eng)
    later = eng.generate([prompt(20), prompt(21, poison=True)], max_new_tokens=4)
    assert [r.output for r in later] == [
        dense_greedy(MODEL, prompt(20), 4),
        dense_greedy(MODEL, prompt(21, poison=True), 4),
    ]
    assert_drained(eng)


def test_a_failing_decode_keeps_the_tokens_before():
    """The model fails once a generated token is fed back: the request keeps its output so
    far; its pages (prompt and decodes) are released."""
    p = prompt(30)
    greedy = dense_greedy(MODEL, p, 3)
    assert greedy[1] not in p and greedy[0] != greedy[1]
    eng = engine(model=FailingModel(poison=greedy[1]))
    watchdog(eng)
    (r,) = eng.generate([p], max_new_tokens=3)
    assert r.finish_reason == "error" and r.output == greedy[:2]
    assert_drained(eng)


def test_a_sampling_error_fails_that_request_only():
    """NaN logits under temperature sampling: that request fails; the one batched with it
    draws exactly what it draws alone (its own generator)."""
    eng = engine(model=FailingModel(nan_rows=True))
    watchdog(eng)
    good, bad = prompt(40), prompt(41, poison=True)
    got = eng.generate([good, bad], max_new_tokens=6, temperature=1.0, seed=3)
    assert [r.finish_reason for r in got] == ["length", "error"]
    assert isinstance(got[1].error, ValueError) and "hold NaN" in str(got[1].error)
    (alone,) = engine().generate([good], max_new_tokens=6, temperature=1.0, seed=3)
    assert got[0].output == alone.output
    assert_drained(eng)


def test_nan_logits_fail_a_greedy_request_too():
    """argmax would silently pick the NaN's index: the request fails instead."""
    eng = engine(model=FailingModel(nan_rows=True))
    watchdog(eng)
    good, bad = prompt(42), prompt(43, poison=True)
    got = eng.generate([good, bad], max_new_tokens=4)
    assert [r.finish_reason for r in got] == ["length", "error"]
    assert got[0].output == dense_greedy(MODEL, good, 4) and got[1].output == []
    assert_drained(eng)


def test_an_interrupt_requeues_the_step_and_the_engine_resumes():
    model = FailingModel(always=False, exc=KeyboardInterrupt)
    eng = engine(model=model)
    watchdog(eng)
    prompts = [prompt(50), prompt(51, poison=True)]
    a, b = (eng.submit(p, max_new_tokens=4) for p in prompts)
    with pytest.raises(KeyboardInterrupt):
        eng.run()
    eng.cache.check()
    got = eng.run([a, b])
    assert [r.output for r in got] == [dense_greedy(MODEL, p, 4) for p in prompts]
    assert_drained(eng)


def test_a_branch_context_that_fails_leaves_its_branches_running():
    eng = engine(model=FailingModel(always=False))
    watchdog(eng)
    ctx = prompt(60, 20, poison=True)
    got = eng.run(eng.branch(ctx, [[1, 2], [3]], max_new_tokens=3))
    want = [dense_greedy(MODEL, np.concatenate([ctx, s]), 3) for s in ([1, 2], [3])]
    assert [r.output for r in got] == want
    parent = [s for s in eng.sequences.values() if s.children]
    assert parent[0].finish_reason == "error"
    assert_drained(eng)


def test_preempting_a_request_of_the_highest_priority():
    """A preempted request goes back with its priority raised by one, capped at the
    scheduler's highest."""
    prompts = [prompt(70 + i, 30) for i in range(4)]
    eng = engine(tokens=96, token_budget=128)
    watchdog(eng)
    got = [eng.submit(p, max_new_tokens=12, priority=2**31 - 1) for p in prompts]
    results = eng.run(got)
    assert eng.stats.preemptions > 0
    assert [r.output for r in results] == [dense_greedy(MODEL, p, 12) for p in prompts]
    assert_drained(eng)


def test_engine_constructor_checks_its_arguments():
    kv = MODEL.make_kv_cache(radixkv.RadixCache(64))
    with pytest.raises(ValueError, match="prefix_caching must be a bool, got 'no'"):
        radixkv.Engine(MODEL, kv, prefix_caching="no")
    with pytest.raises(ValueError, match=r"kv must be a radixkv\.KVCache, got RadixCache"):
        radixkv.Engine(MODEL, kv.cache)
    with pytest.raises(ValueError, match=r"model must have config\.vocab_size"):
        radixkv.Engine(torch.nn.Identity(), kv)
    with pytest.raises(ValueError, match="max_batch must be a positive int, got True"):
        radixkv.Engine(MODEL, kv, max_batch=True)


def test_engine_refuses_a_kv_cache_shaped_for_another_model():
    """Layers, KV heads and head dim of the KVCache must be the model's: refused when the
    engine is built, not found later as every request failing with the error in its result."""
    cache = radixkv.RadixCache(64)
    layers, heads, dim = MODEL.kv_shape
    assert MODEL.kv_shape == (
        MODEL.config.num_layers,
        MODEL.config.num_kv_heads,
        MODEL.config.head_dim,
    )
    for shape in ((layers + 1, heads, dim), (layers, heads * 2, dim), (layers, heads, dim // 2)):
        kv = radixkv.KVCache(cache, num_layers=shape[0], num_kv_heads=shape[1], head_dim=shape[2])
        want = (
            f"kv is shaped (layers, KV heads, head dim) = {shape}, the model needs {MODEL.kv_shape}"
        )
        with pytest.raises(ValueError, match=re.escape(want)):
            radixkv.Engine(MODEL, kv)
    eng = radixkv.Engine(MODEL, MODEL.make_kv_cache(cache))  # the model's own shape
    assert eng.generate([prompt(3)], max_new_tokens=2)[0].finish_reason == "length"
    # A tensor-parallel shard states its slice of the KV heads, and its pool has that shape.
    shard = MODEL.shard(0, 2)
    assert shard.kv_shape == (layers, heads // 2, dim)
    assert shard.make_kv_cache(radixkv.RadixCache(8)).num_kv_heads == heads // 2


def test_a_session_turn_that_fails_raises_and_keeps_the_history():
    eng = engine(model=FailingModel(always=False))
    watchdog(eng)
    s = radixkv.Session(eng, system=prompt(80))
    before = s.history.copy()
    with pytest.raises(RuntimeError, match="injected failure"):
        s.send([POISON, 1, 2], max_new_tokens=2)
    assert np.array_equal(s.history, before) and s.results == []
    r = s.send([POISON, 1, 2], max_new_tokens=2)  # the model fails only once
    assert r.output == dense_greedy(MODEL, np.concatenate([before, [POISON, 1, 2]]), 2)
    assert len(s) == len(before) + 3 + 2
    assert_drained(eng)
