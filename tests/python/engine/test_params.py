"""``RequestParams``: one object for every per-request knob. It checks itself when made (the
messages the engine's keyword form gives), a request made with it runs exactly as the same
request made with keywords, on every entry point, and params and keywords together are
refused before anything is registered."""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest

import radixkv
from radixkv import RequestParams
from tiny_model import VOCAB, ids, tiny_model

MODEL = tiny_model(seed=7)


def engine(tokens: int = 4096) -> radixkv.Engine:
    return radixkv.Engine(MODEL, MODEL.make_kv_cache(radixkv.RadixCache(tokens)))


def prompt(seed: int, n: int = 14) -> np.ndarray:
    return ids(np.random.default_rng(seed), n)


#: Every knob off its default, sampled: a request whose tokens depend on each of them.
KNOBS = dict(
    max_new_tokens=9,
    temperature=0.9,
    stop=(),
    seed=5,
    top_p=0.9,
    top_k=40,
    min_p=0.01,
    repetition_penalty=1.3,
    presence_penalty=0.5,
    frequency_penalty=0.4,
    logprobs=True,
    top_logprobs=3,
    logit_bias={3: 5.0, 9: -100.0},
)


BAD = [
    ("max_new_tokens", -1, r"max_new_tokens must be an int in \[0, 2\*\*32\), got -1"),
    ("max_new_tokens", True, r"max_new_tokens must be an int in \[0, 2\*\*32\), got True"),
    ("temperature", math.nan, "temperature must be a finite number >= 0, got nan"),
    ("temperature", "0.5", "temperature must be a finite number >= 0, got '0.5'"),
    ("stop", 5, "stop must be an iterable of token ids, got 5"),
    ("stop", [-1], r"stop must be token ids in \[0, 2\*\*32\), got -1"),
    ("namespace", 5, "namespace must be None, a str or bytes, got 5"),
    ("seed", 2**63, r"seed must be an int in \[0, 2\*\*63\)"),
    ("priority", 2**31, r"priority must be an int in \[-2\*\*31, 2\*\*31\)"),
    ("top_p", 0.0, r"top_p must be a number in \(0, 1\]"),
    ("top_logprobs", 2, "top_logprobs=2 needs logprobs=True"),
    ("logit_bias", {"7": 5.0}, r"logit_bias keys must be token ids \(ints\), got '7'"),
    ("stop_strings", "ab", "stop_strings must be an iterable of non-empty str"),
    ("on_token", 3, "on_token must be None or callable, got 3"),
    ("retain", -1.0, r"retain must be seconds >= 0 \(or math.inf\), got -1.0"),
    ("cache_priority", radixkv.EVICTION_CLASSES, "cache_priority must be an eviction class"),
]


@pytest.mark.parametrize(("name", "value", "match"), BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_request_params_refuse_a_bad_field_as_submit_does(name, value, match):
    with pytest.raises(ValueError, match=match):
        RequestParams(**{name: value})
    eng = engine()
    with pytest.raises(ValueError, match=match):
        eng.submit(prompt(1), **{name: value})
    assert not eng.sequences


def test_request_params_hold_their_fields_normalized():
    p = RequestParams(
        temperature=1e-9,
        stop=np.array([4, 2, 4]),
        stop_strings=["a", "b", "a"],
        logit_bias={np.int64(9): 2, 3: -1.5, 4: 0.0},
        top_k=np.int64(3),
    )
    assert p.temperature == 0.01  # raised to the lowest temperature sampled with
    assert p.stop == frozenset({2, 4}) and p.stop_strings == ("a", "b")
    assert p.logit_bias == ((3, -1.5), (9, 2.0)) and type(p.top_k) is int
    assert p.sampling.logit_bias == p.logit_bias and p.sampling.top_k == 3
    # a copy with one field changed is checked again and keeps the rest as they were
    q = dataclasses.replace(p, seed=3)
    assert q.logit_bias == p.logit_bias and q.seed == 3
    with pytest.raises(ValueError, match="seed must be"):
        dataclasses.replace(p, seed=-1)
    assert pickle.loads(pickle.dumps(q)) == q  # what the tensor-parallel broadcast sends
    assert RequestParams().sampling is radixkv.engine.sampling.OFF


def test_the_engine_checks_what_depends_on_it():
    eng = engine()
    with pytest.raises(ValueError, match=rf"stop must be token ids in \[0, {VOCAB}\), got {VOCAB}"):
        eng.submit(prompt(1), params=RequestParams(stop=[VOCAB]))
    with pytest.raises(ValueError, match=f"logit_bias holds token id {VOCAB}, outside"):
        eng.submit(prompt(1), params=RequestParams(logit_bias={VOCAB: 1.0}))
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        eng.submit(prompt(1), params=RequestParams(stop_strings=["x"]))
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63 - 2\]"):
        eng.branch(prompt(1), [[1], [2]], params=RequestParams(seed=2**63 - 1))
    assert not eng.sequences


def test_every_entry_point_runs_params_as_its_keywords():
    params = RequestParams(**KNOBS)
    p = prompt(3)
    a, b = engine(), engine()
    (kw,) = a.run([a.submit(p, **KNOBS)])
    (pa,) = b.run([b.submit(p, params=params)])
    assert kw.output == pa.output and kw.logprobs == pa.logprobs
    assert kw.top_logprobs == pa.top_logprobs and len(kw.output) == KNOBS["max_new_tokens"]
    (gen,) = engine().generate([p], params=params)
    assert gen.output == kw.output
    branches = [[1], [2, 3]]
    a, b = engine(), engine()
    kw_b = a.run(a.branch(p, branches, **KNOBS))
    pa_b = b.run(b.branch(p, branches, params=params))
    assert [r.output for r in kw_b] == [r.output for r in pa_b]
    assert [r.logprobs for r in kw_b] == [r.logprobs for r in pa_b]
    turns = []
    for use_params in (False, True):
        session = radixkv.Session(engine(), system=p)
        got = session.send([5, 6], params=params) if use_params else session.send([5, 6], **KNOBS)
        kids = (
            session.branch(branches, params=params)
            if use_params
            else session.branch(branches, **KNOBS)
        )
        turns.append((got.output, got.logprobs, [r.output for r in kids]))
    assert turns[0] == turns[1]
    events = list(engine().stream(p, params=params))
    assert [e.token for e in events] == kw.output


def test_params_and_keywords_together_are_refused_before_anything_is_queued():
    eng = engine()
    params = RequestParams(max_new_tokens=3)
    with pytest.raises(TypeError, match=r"not both \(got \['temperature'\]"):
        eng.submit(prompt(1), temperature=0.5, params=params)
    with pytest.raises(TypeError, match=r"not both \(got \['top_k'\]"):
        eng.branch(prompt(1), [[1]], top_k=4, params=params)
    with pytest.raises(TypeError, match=r"not both \(got \['max_new_tokens'\]"):
        eng.generate([prompt(1)], max_new_tokens=4, params=params)
    with pytest.raises(TypeError, match=r"unknown parameters \['max_tokens'\]"):
        eng.branch(prompt(1), [[1]], max_tokens=4)
    with pytest.raises(ValueError, match=r"params must be a radixkv\.RequestParams, got dict"):
        eng.submit(prompt(1), params={"max_new_tokens": 3})
    with pytest.raises(ValueError, match="priority=3: branches are queued once their context"):
        eng.branch(prompt(1), [[1]], params=RequestParams(priority=3))
    with pytest.raises(TypeError, match="stream\\(\\) takes no on_token"):
        eng.stream(prompt(1), params=RequestParams(on_token=print))
    assert not eng.sequences and not eng.has_work
    # keywords left at their defaults beside params are not a conflict
    (r,) = eng.run([eng.submit(prompt(1), 16, 0.0, params=params)])
    assert len(r.output) == 3


def test_a_session_keeps_its_namespace_and_retention():
    eng = engine()
    session = radixkv.Session(eng, system=prompt(4), namespace="a", keep_alive=30.0)
    with pytest.raises(ValueError, match="namespace 'b' is not this session's"):
        session.send([1], params=RequestParams(namespace="b"))
    with pytest.raises(ValueError, match="retained by its keep_alive"):
        session.send([1], params=RequestParams(retain=5.0))
    assert not eng.sequences and len(session) == 14
    r = session.send([1], params=RequestParams(max_new_tokens=2, namespace="a"))
    assert r.retention is not None  # the session's keep_alive, not the params'
    # the turn ran in the session's namespace: all of it but the last token is cached there
    assert eng.cache.match_prefix(session.history, "a") == len(session.history) - 1
    assert eng.cache.match_prefix(session.history, None) == 0
