"""Speculative decoding (``Engine(speculative=...)``): greedy outputs equal plain decoding token
for token (both drafters, every cache, batches, preemption, branches, stops, logprobs and
penalties), sampled ones keep their distribution, a retried request takes its reply from the
cache, a draft never carries another namespace's tokens, and rejected drafts never reach the
index. Tiny random models: their greedy text falls into loops, which prompt lookup predicts,
and leaves them, where drafts are rejected; the real model (SmolLM2) once, on a code edit."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import radixkv  # noqa: E402
from radixkv.engine.speculative import SpecConfig, prompt_lookup  # noqa: E402
from tiny_model import CACHES, ids, tiny_model  # noqa: E402

K = 5
NEW = 40


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def prompts(n: int = 4, seed: int = 0) -> list[np.ndarray]:
    """Prompts that repeat a random run of tokens three times (prompt lookup finds it)."""
    rng = np.random.default_rng(seed)
    return [np.concatenate([ids(rng, 20)] * 3) for _ in range(n)]


def run(model, cache, method=None, ps=None, engine_args=None, **params):
    """Outputs (and the engine) of ``ps`` run together, with speculation by ``method``."""
    spec = None if method is None else {"method": method, "num_speculative_tokens": K}
    eng = radixkv.Engine(model, model.make_kv_cache(cache), speculative=spec, **(engine_args or {}))
    params.setdefault("max_new_tokens", NEW)
    params.setdefault("stop", ())
    results = eng.generate(prompts() if ps is None else ps, **params)
    cache.check()
    return results, eng


@pytest.mark.parametrize("make", CACHES)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_outputs_equal_plain_decoding(model, make, method):
    plain, _ = run(model, make(2048))
    spec, eng = run(model, make(2048), method)
    assert [r.output for r in spec] == [r.output for r in plain]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
    st = eng.stats
    # Drafts were accepted and rejected both, and it took fewer steps.
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert sum(st.spec_accepted_per_pos) == st.spec_accepted_tokens
    assert st.spec_accepted_per_pos == sorted(st.spec_accepted_per_pos, reverse=True)
    assert eng.cache.stats.used_pages == 0  # every draft page given back


def test_a_batch_mixes_requests_with_and_without_drafts(model):
    # Random prompts give prompt lookup nothing at first; the repeating ones do.
    rng = np.random.default_rng(7)
    ps = prompts(3) + [ids(rng, 50) for _ in range(3)]
    plain, _ = run(model, radixkv.RadixCache(4096), ps=ps)
    spec, eng = run(model, radixkv.RadixCache(4096), "ngram", ps=ps)
    assert [r.output for r in spec] == [r.output for r in plain]
    assert eng.stats.spec_drafts > 0


def test_preemption_under_a_small_pool(model):
    ps = prompts(6, seed=3)
    small = dict(engine_args={"token_budget": 64})
    plain, _ = run(model, radixkv.RadixCache(100, page_size=4), ps=ps, **small)
    spec, eng = run(model, radixkv.RadixCache(100, page_size=4), "ngram", ps=ps, **small)
    assert [r.output for r in spec] == [r.output for r in plain]
    assert eng.stats.preemptions > 0 and eng.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_branches(model, method):
    ctx, suffixes = prompts(1)[0], [[1, 2], [3], []]

    def outputs(spec):
        eng = radixkv.Engine(model, model.make_kv_cache(radixkv.RadixCache(1024)), speculative=spec)
        ids_ = eng.branch(ctx, suffixes, max_new_tokens=NEW, stop=())
        out = [r.output for r in eng.run(ids_)]
        eng.cache.check()
        return out, eng.stats

    plain, _ = outputs(None)
    spec, st = outputs({"method": method, "num_speculative_tokens": K})
    assert spec == plain and st.spec_accepted_tokens > 0


def test_stop_tokens_and_length_cut_where_plain_decoding_does(model):
    plain, _ = run(model, radixkv.RadixCache(1024, page_size=1))
    # A token each request generates after its loop starts, and a short length for another.
    stops = {plain[0].output[12], plain[1].output[20]}
    for params in ({"stop": stops}, {"max_new_tokens": 13}):
        want, _ = run(model, radixkv.RadixCache(1024, page_size=1), **params)
        got, eng = run(model, radixkv.RadixCache(1024, page_size=1), "ngram", **params)
        assert [r.output for r in got] == [r.output for r in want]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
        assert ("stop" if "stop" in params else "length") in {r.finish_reason for r in got}
        assert eng.stats.spec_accepted_tokens > 0
        # Nothing past a stop (or the length) was kept: each request's pages hold its prompt
        # and output but the last token, as plain decoding's.
        for r, p in zip(got, prompts()):
            seq = np.concatenate([p, np.asarray(r.output, dtype=np.uint32)])
            assert eng.cache.match_prefix(np.append(seq, 0)) == len(seq) - 1


def test_logprobs_penalties_and_logit_bias_equal_plain_decoding(model):
    knobs = dict(
        logprobs=True,
        top_logprobs=3,
        repetition_penalty=1.05,
        frequency_penalty=0.1,
        logit_bias={7: 2.0},
    )
    plain, _ = run(model, radixkv.RadixCache(2048), **knobs)
    spec, eng = run(model, radixkv.RadixCache(2048), "ngram", **knobs)
    assert eng.stats.spec_accepted_tokens > 0
    for a, b in zip(spec, plain):
        assert a.output == b.output
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [
            [t for t, _ in top] for top in b.top_logprobs
        ]


def test_a_retried_request_takes_most_of_its_reply_from_the_cache(model):
    # A prompt that does not repeat: prompt lookup has little to go on.
    prompt = ids(np.random.default_rng(11), 64)
    cache = radixkv.RadixCache(1024, page_size=4)
    spec = {"method": "suffix", "num_speculative_tokens": 8}
    eng = radixkv.Engine(model, model.make_kv_cache(cache), speculative=spec)
    (first,) = eng.generate([prompt], max_new_tokens=NEW, stop=(), release=True)
    before = eng.stats.spec_accepted_tokens
    (again,) = eng.generate([prompt], max_new_tokens=NEW, stop=(), release=True)
    assert again.output == first.output
    accepted = eng.stats.spec_accepted_tokens - before
    # The earlier reply is cached but its last page and last token: most of it is accepted
    # (each step adds a token of the model's own beside its accepted drafts).
    assert accepted >= 2 * NEW // 3 > accepted_without_cache(model, prompt)
    cache.check()


def accepted_without_cache(model, prompt) -> int:
    eng = radixkv.Engine(
        model,
        model.make_kv_cache(radixkv.RadixCache(1024, page_size=4)),
        speculative={"method": "suffix", "num_speculative_tokens": 8},
    )
    eng.generate([prompt], max_new_tokens=NEW, stop=())
    return eng.stats.spec_accepted_tokens


def test_a_draft_never_crosses_namespaces(model):
    prompt = ids(np.random.default_rng(11), 64)
    spec = {"method": "suffix", "num_speculative_tokens": 8}

    def engine():
        cache = radixkv.RadixCache(1024, page_size=4)
        return radixkv.Engine(model, model.make_kv_cache(cache), speculative=spec)

    def stats(eng, namespace):
        """The spec counters of one request of ``namespace`` (a delta)."""
        st = eng.stats
        before = st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens
        eng.generate([prompt], max_new_tokens=NEW, stop=(), namespace=namespace)
        after = st.spec_drafts, st.spec_draft_tokens, st.spec_accepted_tokens
        return tuple(b - a for a, b in zip(before, after))

    eng = engine()
    fresh = stats(eng, "tenant-a")  # tenant a's reply is cached now
    assert len(eng.cache.continuation(prompt, 8, namespace="tenant-a")) == 8
    assert len(eng.cache.continuation(prompt, 8, namespace="tenant-b")) == 0
    # Tenant b drafts exactly what it did from an empty cache: nothing of a's.
    assert stats(eng, "tenant-b") == fresh == stats(engine(), "tenant-b")
    assert stats(eng, "tenant-a")[2] > fresh[2]


@pytest.mark.parametrize("make", CACHES)
def test_rejected_drafts_never_reach_the_index(model, make):
    cache = make(2048)
    eng = radixkv.Engine(
        model,
        model.make_kv_cache(cache),
        speculative={"method": "ngram", "num_speculative_tokens": 8},
    )
    bad = 511  # a token the requests never generate: every draft of it is rejected
    eng.drafter.propose = lambda seq, room: [bad] * room
    results = eng.generate(prompts(), max_new_tokens=NEW, stop=())
    cache.check()
    assert eng.stats.spec_draft_tokens > 0 and eng.stats.spec_accepted_tokens == 0
    assert cache.stats.used_pages == 0
    plain, _ = run(model, make(2048))
    assert [r.output for r in results] == [r.output for r in plain]
    for r, p in zip(results, prompts()):
        assert bad not in r.output
        seq = np.concatenate([p, np.asarray(r.output, dtype=np.uint32)])
        for i in range(len(p), len(seq)):
            # A later request that went the drafts' way finds only the verified tokens cached.
            drafted = np.concatenate([seq[:i], np.full(40, bad, dtype=np.uint32)])
            assert cache.match_prefix(drafted) <= i
        again = eng.generate([np.append(seq[:-8], bad)], max_new_tokens=1, stop=())[0]
        assert again.cached_tokens <= len(seq) - 8


# ---- sampling -----------------------------------------------------------------------------

SAMPLES = 1500
SMALL_VOCAB = 12


def sampled(model, first_seed: int, drafts: list[int] | None) -> np.ndarray:
    """The 4 tokens each of ``SAMPLES`` seeded requests samples (temperature 1), with every
    decoding step carrying ``drafts`` (None: plain decoding)."""
    spec = None if drafts is None else {"method": "ngram", "num_speculative_tokens": 3}
    eng = radixkv.Engine(
        model, model.make_kv_cache(radixkv.RadixCache(8192)), max_batch=256, speculative=spec
    )
    if drafts is not None:
        eng.drafter.propose = lambda seq, room: drafts[:room]
    ids_ = [
        eng.submit([1, 2, 3], max_new_tokens=4, temperature=1.0, stop=(), seed=first_seed + i)
        for i in range(SAMPLES)
    ]
    return np.array([r.output for r in eng.run(ids_, release=True)])


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """The largest total-variation distance between the two samples' token frequencies at
    any position."""
    worst = 0.0
    for j in range(a.shape[1]):
        pa = np.bincount(a[:, j], minlength=SMALL_VOCAB) / len(a)
        pb = np.bincount(b[:, j], minlength=SMALL_VOCAB) / len(b)
        worst = max(worst, 0.5 * float(np.abs(pa - pb).sum()))
    return worst


def test_sampling_keeps_the_distribution():
    model = tiny_model(seed=3, vocab_size=SMALL_VOCAB)
    plain = sampled(model, 0, None)
    noise = distance(plain, sampled(model, SAMPLES, None))  # two plain runs, other seeds
    # The greedy continuation: drafts the target often accepts and sometimes rejects.
    greedy = (
        radixkv.Engine(model, model.make_kv_cache(radixkv.RadixCache(64)))
        .generate([[1, 2, 3]], max_new_tokens=4, stop=())[0]
        .output
    )
    for drafts in (greedy[1:], [0, 0, 0]):
        spec = sampled(model, 2 * SAMPLES, drafts)
        assert distance(spec, plain) <= 1.5 * noise + 0.01, (distance(spec, plain), noise)
    # A seed repeats its tokens.
    again = sampled(model, 2 * SAMPLES, [0, 0, 0])
    assert np.array_equal(again, spec)


# ---- configuration ------------------------------------------------------------------------


def test_bad_configs_are_value_errors_naming_them(model):
    kv = model.make_kv_cache(radixkv.RadixCache(64))
    for bad, needle in (
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "lookup"),
        ("{not json", "JSON"),
        (3, "dict"),
    ):
        with pytest.raises(ValueError, match=needle):
            radixkv.Engine(model, kv, speculative=bad)
    assert SpecConfig.of('{"method": "suffix", "num_speculative_tokens": 8}') == SpecConfig(
        "suffix", 8
    )


def test_prompt_lookup_takes_the_longest_most_recent_match():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3], dtype=np.uint32)
    # "2 3" occurred twice before; "7 2 3" never: the most recent "2 3" is followed by 4 5.
    assert prompt_lookup(t, 3, 1, 3) == [4, 5, 7]
    assert prompt_lookup(t, 3, 3, 3) == []
    assert prompt_lookup(np.array([5], dtype=np.uint32), 3, 1, 4) == []


# ---- the real model -----------------------------------------------------------------------

CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""


#: A small JSON object, for a grammar request (with llguidance installed).
SHAPE = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}},
    "required": ["name"],
}


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    import radixkv.hf
    from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path

    if smollm2_path() is None:
        pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}")
    return radixkv.hf.load("smollm2")


def test_the_real_model_edits_code_as_plain_decoding_does(smollm2):
    """SmolLM2 copies a file it is asked to edit: greedy text, logprobs and a stop string's cut
    are plain decoding's, with both drafters, and a good part of the reply comes from drafts; a
    grammar request batched beside it gets plain decoding's output too."""
    import importlib.util

    import radixkv.hf

    grammar = importlib.util.find_spec("llguidance") is not None

    model, tok = smollm2
    text = f"Here is geometry.py:\n\n{CODE}\nRename width to w. Reply with the whole file only."
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )
    prompt = list(getattr(prompt, "input_ids", prompt))
    params = dict(max_new_tokens=40, logprobs=True, stop_strings=["perimeter"])
    runs = {}
    for method in (None, "ngram", "suffix"):
        spec = None if method is None else {"method": method, "num_speculative_tokens": 6}
        eng = radixkv.hf.engine(model, radixkv.RadixCache(1024), tokenizer=tok, speculative=spec)
        edit = eng.submit(prompt, **params)
        # Beside it, a request with a grammar (decoded without drafts, as without speculation).
        shaped = eng.submit(prompt, max_new_tokens=12, grammar=SHAPE) if grammar else None
        r = eng.run([edit])[0]
        eng.cache.check()
        # What the index holds after the tokens the client received (the last one sampled,
        # never computed): nothing, so no accepted draft past the stop string was published.
        seen = np.asarray([*prompt, *r.output[:-1]], dtype=np.uint32)
        held = eng.cache.continuation(seen, 8).tolist()
        runs[method] = r, eng.stats, shaped and eng.run([shaped])[0].output, held
    plain = runs[None][0]
    assert plain.finish_reason == "stop" and "perimeter" not in plain.text
    for method in ("ngram", "suffix"):
        r, st, shaped_output, held = runs[method]
        assert shaped_output == runs[None][2]
        assert held == runs[None][3] == [], (method, held)
        assert r.output == plain.output and r.text == plain.text
        assert r.logprobs == pytest.approx(plain.logprobs, abs=1e-3)
        assert st.spec_accepted_tokens >= len(r.output) // 4, (method, st)
        assert st.steps < runs[None][1].steps


def test_draft_length_adapts_and_pauses_while_nothing_is_accepted():
    from radixkv.engine.sequence import Sequence
    from radixkv.engine.speculative import FIRST_DRAFT, MAX_PAUSE, MISSES_TO_PAUSE, Drafter

    drafter = Drafter(SpecConfig("ngram", 4), radixkv.RadixCache(16))
    seq = Sequence(id=0, prompt=np.array([1, 2, 3, 4, 5, 1, 2], dtype=np.uint32), max_new_tokens=9)
    assert FIRST_DRAFT == 2 and drafter.propose(seq, 4) == [3, 4]
    drafter.accepted(seq, 2, 2)  # accepted whole: twice as long, up to K
    assert drafter.propose(seq, 4) == [3, 4, 5, 1]
    assert drafter.propose(seq, 3) == [3, 4, 5], "never past the room given"
    drafter.accepted(seq, 4, 1)  # one accepted: the next draft is two long
    assert drafter.propose(seq, 4) == [3, 4]
    pauses = []
    for _ in range(8):
        for _ in range(MISSES_TO_PAUSE):
            drafter.accepted(seq, 2, 0)
        paused = 0
        while not drafter.propose(seq, 4):
            paused += 1
        pauses.append(paused)
    # Each pause twice as long as the one before, up to the bound, then a short draft again.
    assert pauses == [min(2**i, MAX_PAUSE) for i in range(8)]
    assert seq.spec is not None and seq.spec.k == FIRST_DRAFT
    drafter.accepted(seq, 2, 2)
    drafter.accepted(seq, 4, 0)
    assert [drafter.propose(seq, 4) for _ in range(2)] == [[], [3, 4]], "a hit resets the pauses"


#: A JSON object a grammar request is held to (with llguidance installed).
PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_a_grammar_request_speculates_and_keeps_plain_decodings_output(smollm2):
    """A request with a grammar drafts too: its drafts are cut to what the grammar accepts and
    each row is masked as the grammar stands after the drafts before it, so greedy output and
    logprobs are plain decoding's (jump-forward on), and a retried request accepts most of its
    reply from the cache."""
    pytest.importorskip("llguidance")
    import radixkv.hf

    model, tok = smollm2
    ask = "Describe a pet cat as a JSON object with its name and age."
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": ask}], tokenize=True, add_generation_prompt=True
    )
    prompt = list(getattr(prompt, "input_ids", prompt))
    params = dict(max_new_tokens=24, logprobs=True, grammar=PET)
    runs = {}
    for method in (None, "suffix", "ngram"):
        spec = None if method is None else {"method": method, "num_speculative_tokens": 6}
        eng = radixkv.hf.engine(model, radixkv.RadixCache(1024), tokenizer=tok, speculative=spec)
        first = eng.generate([prompt], **params)[0]
        accepted = eng.stats.spec_accepted_tokens
        again = eng.generate([prompt], **params)[0]  # retried: the cache holds the reply
        eng.cache.check()
        runs[method] = first, again, eng.stats.spec_accepted_tokens - accepted, eng.stats.steps
    plain, plain_again, _, plain_steps = runs[None]
    assert plain.output == plain_again.output and plain.finish_reason == "stop"
    for method in ("suffix", "ngram"):
        first, again, accepted_again, steps = runs[method]
        for r in (first, again):
            assert r.output == plain.output and r.text == plain.text, method
            assert r.logprobs == pytest.approx(plain.logprobs, abs=1e-3)
    _, again, accepted_again, steps = runs["suffix"]
    assert accepted_again >= len(again.output) // 3, accepted_again
    assert steps < plain_steps
