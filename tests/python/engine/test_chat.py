"""Chat in Python: ``Engine.chat(messages)`` and ``Session.send(messages)`` render OpenAI-style
messages through the real tokenizer's chat template and return text; a 3-turn chat finds its
earlier turns in the prefix cache, and its last reply is transformers' own greedy reply to the
same conversation (SmolLM2, float32 on the CPU). An agent's history of tool calls renders as
``radixkv serve`` renders it (its ``chat_prompt``, what ``/tokenize`` counts), token for token:
the calls' arguments as objects for a template that renders calls, as JSON in the content (with
a warning) for one that ignores them."""

from __future__ import annotations

import copy
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import radixkv  # noqa: E402
import radixkv.hf  # noqa: E402
from radixkv.apps.serve import chat_prompt  # noqa: E402
from radixkv.engine import chat  # noqa: E402
from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path  # noqa: E402
from tool_history import ARGUMENTS, TEMPLATE, TOOLS, agent_history  # noqa: E402

if smollm2_path() is None:
    pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}", allow_module_level=True)

TOKENS = 5


@pytest.fixture(scope="module")
def loaded():
    return radixkv.hf.load("smollm2")


@pytest.fixture(scope="module")
def tools_tokenizer(loaded):
    """The real tokenizer with a Qwen-2.5-style template that renders tools and calls."""
    tok = copy.deepcopy(loaded[1])
    tok.chat_template = TEMPLATE
    return tok


def engine(loaded, tokenizer=True):
    model, tok = loaded
    if tokenizer is True:
        tokenizer = tok
    return radixkv.hf.engine(model, radixkv.RadixCache(512), tokenizer=tokenizer or None)


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


def test_a_tool_call_history_renders_as_the_server_renders_it(loaded, tools_tokenizer):
    served, notes = chat_prompt.render(tools_tokenizer, agent_history(), TOOLS, renders_calls=True)
    assert notes == []
    # the calls' arguments reach the template as objects, as transformers documents them
    objects = agent_history(arguments=json.loads(ARGUMENTS))
    want = tools_tokenizer.apply_chat_template(
        objects, tools=TOOLS, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert served == list(want)
    # the library asks the template whether it renders calls itself
    assert chat.render(tools_tokenizer, agent_history(), tools=TOOLS) == served
    # a template given as chat_template is the one asked
    assert chat.render(loaded[1], agent_history(), tools=TOOLS, chat_template=TEMPLATE) == served


def test_a_template_that_ignores_calls_gets_them_as_the_server_does_with_a_warning(loaded):
    tok = loaded[1]
    served, notes = chat_prompt.render(tok, agent_history(), TOOLS, renders_calls=False)
    assert notes == [chat.CALLS_NOT_RENDERED]
    with pytest.warns(UserWarning) as caught:
        ids = chat.render(tok, agent_history(), tools=TOOLS)
    assert ids == served
    assert [str(w.message) for w in caught] == [chat.CALLS_NOT_RENDERED]
    with pytest.warns(UserWarning) as caught:
        engine(loaded).chat(agent_history(), tools=TOOLS, max_new_tokens=1)
    assert [str(w.message) for w in caught] == [chat.CALLS_NOT_RENDERED]
    assert caught[0].filename == __file__  # issued where Engine.chat was called


def test_engine_chat_and_session_send_run_the_servers_prompt(loaded, tools_tokenizer):
    eng = engine(loaded, tools_tokenizer)
    served, _ = chat_prompt.render(tools_tokenizer, agent_history(), TOOLS, renders_calls=True)
    eng.chat(agent_history(), tools=TOOLS, max_new_tokens=1)
    # the chat's prompt is in the cache: the server's prompt finds all of it (but the last
    # token, whose logits a forward must give)
    (again,) = eng.generate([served], max_new_tokens=1, release=True)
    assert again.cached_tokens == len(served) - 1
    # a malformed call is an error naming it, before anything is queued
    history = agent_history()
    history[1]["tool_calls"] = [{"type": "function", "function": "get_weather"}]
    with pytest.raises(chat.MessageError) as e:
        eng.chat(history, max_new_tokens=1)
    assert e.value.param == "messages.1.tool_calls.0" and not eng.sequences
    # a session's prompt (no tools) is the server's, token for token
    session = radixkv.Session(eng)
    session.send(agent_history(), max_new_tokens=1)
    prompt = session.history[: len(session.history) - len(session.results[-1].output)]
    served, _ = chat_prompt.render(tools_tokenizer, agent_history(), None, renders_calls=True)
    assert prompt.tolist() == served
    before = list(session.messages)
    with pytest.raises(chat.MessageError) as e:  # named by its place in the conversation
        session.send(agent_history(arguments='{"city": "Par'))
    assert e.value.param == f"messages.{len(before) + 1}.tool_calls.0.function.arguments"
    assert session.messages == before  # unchanged by the refused turn
