"""radixkv.apps.serve.chat_prompt: an agent's history of tool calls through the real SmolLM2
tokenizer's chat template, as transformers' ``apply_chat_template`` renders it. A template that
renders calls (the Hermes/Qwen-style one of support/tool_history.py) gets them, arguments as
objects, so the prompt is transformers' own token for token; SmolLM2's own template ignores
them, and gets each call as JSON in its message's content, with a warning."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("transformers")

import hf_models
from radixkv.apps.serve import chat_prompt
from radixkv.apps.serve.structured import BadRequest
from tool_history import ARGUMENTS, TEMPLATE, TOOLS, agent_history


@pytest.fixture(scope="module")
def tokenizer():
    return hf_models.smollm2_tokenizer()


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    """The real tokenizer with the Hermes/Qwen-style template that renders tools and calls."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TEMPLATE
    return tok


def test_which_templates_render_calls(tokenizer):
    assert chat_prompt.template_renders_calls(tokenizer, TEMPLATE)
    assert not chat_prompt.template_renders_calls(tokenizer)


def test_a_template_that_renders_calls_gets_them_as_transformers_documents(tools_tokenizer):
    ids, warnings = chat_prompt.render(tools_tokenizer, agent_history(), TOOLS, renders_calls=True)
    # transformers' own rendering of the same conversation, the arguments an object as its
    # documentation writes them
    hf_messages = agent_history(arguments=json.loads(ARGUMENTS))
    want = tools_tokenizer.apply_chat_template(
        hf_messages, tools=TOOLS, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert ids == list(want) and warnings == []
    text = tools_tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text
    assert "<tool_response>\nSunny, 24 degrees.\n</tool_response>" in text


def test_a_template_that_ignores_calls_gets_the_json_in_the_content_and_a_warning(tokenizer):
    ids, warnings = chat_prompt.render(tokenizer, agent_history(), TOOLS, renders_calls=False)
    assert warnings == [chat_prompt.CALLS_NOT_RENDERED]
    # the call as a constrained call generates it, its arguments byte for byte as sent
    shown = [
        agent_history()[0],
        {"role": "assistant", "content": '{"name": "get_weather", "arguments": ' + ARGUMENTS + "}"},
        agent_history()[2],
    ]
    want = tokenizer.apply_chat_template(
        shown, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert ids == list(want)
    # with text of its own, the calls follow it
    history = agent_history()
    history[1]["content"] = "Let me look."
    text = tokenizer.decode(chat_prompt.render(tokenizer, history, None, renders_calls=False)[0])
    assert 'Let me look.\n{"name": "get_weather", "arguments": ' + ARGUMENTS in text


@pytest.mark.parametrize("renders_calls", [True, False])
def test_no_tool_calls_renders_as_a_plain_message(tools_tokenizer, renders_calls):
    history = agent_history()
    plain = [history[0], {"role": "assistant", "content": "Sunny."}]
    for empty in (None, []):
        with_empty = [history[0], {"role": "assistant", "content": "Sunny.", "tool_calls": empty}]
        got = chat_prompt.render(tools_tokenizer, with_empty, None, renders_calls=renders_calls)
        assert got == chat_prompt.render(tools_tokenizer, plain, None, renders_calls=renders_calls)


@pytest.mark.parametrize(
    "arguments, where",
    [
        ('{"city": "Par', "messages.1.tool_calls.0.function.arguments"),
        ("[" * 100_000, "messages.1.tool_calls.0.function.arguments"),
        ("[1, 2]", "messages.1.tool_calls.0.function.arguments"),
        (7, "messages.1.tool_calls.0.function.arguments"),
    ],
)
@pytest.mark.parametrize("renders_calls", [True, False])
def test_malformed_arguments_are_a_bad_request_naming_them(
    tools_tokenizer, arguments, where, renders_calls
):
    with pytest.raises(BadRequest) as e:
        chat_prompt.render(
            tools_tokenizer, agent_history(arguments), TOOLS, renders_calls=renders_calls
        )
    assert e.value.param == where


def test_a_malformed_call_is_a_bad_request_naming_it(tools_tokenizer):
    history = agent_history()
    history[1]["tool_calls"] = [{"type": "function", "function": "get_weather"}]
    with pytest.raises(BadRequest) as e:
        chat_prompt.render(tools_tokenizer, history, TOOLS, renders_calls=True)
    assert e.value.param == "messages.1.tool_calls.0"
    history[1]["tool_calls"] = {"function": {"name": "get_weather"}}
    with pytest.raises(BadRequest) as e:
        chat_prompt.render(tools_tokenizer, history, TOOLS, renders_calls=True)
    assert e.value.param == "messages.1.tool_calls"
    history = agent_history()
    history[1]["content"] = 5
    with pytest.raises(BadRequest) as e:
        chat_prompt.render(tools_tokenizer, history, TOOLS, renders_calls=False)
    assert e.value.param == "messages.1.content"
