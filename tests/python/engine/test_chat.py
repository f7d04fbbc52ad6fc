"""Chat in Python: ``Engine.chat(messages)`` and ``Session.send(messages)`` render OpenAI-style
messages through the real tokenizer's chat template and return text; a 3-turn chat finds its
earlier turns in the prefix cache, and its last reply is transformers' own greedy reply to the
same conversation (SmolLM2, float32 on the CPU)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import radixkv  # noqa: E402
import radixkv.hf  # noqa: E402
from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path  # noqa: E402

if smollm2_path() is None:
    pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}", allow_module_level=True)

TOKENS = 5


@pytest.fixture(scope="module")
def loaded():
    return radixkv.hf.load("smollm2")


def engine(loaded, tokenizer=True):
    model, tok = loaded
    return radixkv.hf.engine(model, radixkv.RadixCache(512), tokenizer=tok if tokenizer else None)


def transformers_reply(loaded, messages) -> str:
    model, tok = loaded
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_three_turn_chat_is_cached_and_equals_transformers(loaded):
    session = radixkv.Session(engine(loaded))
    replies = [
        session.send([{"role": "user", "content": text}], max_new_tokens=TOKENS)
        for text in ("Hi, who are you?", "Name a fruit.", "And a colour?")
    ]
    assert all(isinstance(r, str) and r for r in replies)
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3
    assert [m["content"] for m in session.messages[1::2]] == replies
    assert session.results[0].cached_tokens == 0
    assert session.results[1].cached_tokens > 0 and session.results[2].cached_tokens > 0
    assert replies[-1] == transformers_reply(loaded, session.messages[:-1])


def test_engine_chat_returns_the_text_of_the_rendered_prompt(loaded):
    eng = engine(loaded)
    ask = [{"role": "user", "content": "Name a fruit."}]
    text = eng.chat(ask, max_new_tokens=TOKENS)
    assert text == transformers_reply(loaded, ask)
    assert not eng.sequences  # released


def test_chat_needs_a_tokenizer_and_messages(loaded):
    with pytest.raises(ValueError, match="tokenizer"):
        engine(loaded, tokenizer=False).chat([{"role": "user", "content": "Hi"}])
    eng = engine(loaded)
    with pytest.raises(ValueError, match="messages"):
        eng.chat([{"content": "no role"}])
    chat = radixkv.Session(eng)
    chat.send([{"role": "user", "content": "Hi"}], max_new_tokens=1)
    with pytest.raises(ValueError, match="send messages"):
        chat.send([1, 2, 3])
    ids = radixkv.Session(eng, system=[1, 2])
    with pytest.raises(ValueError, match="token ids"):
        ids.send([{"role": "user", "content": "Hi"}])
