"""radixkv.apps.serve.tool_calls: tool calls parsed out of real model text in vLLM's ``hermes`` and
``llama3_json`` formats, streamed or whole (a call names a declared tool and holds its arguments:
any other JSON is text), and whether a chat template renders tools (the real SmolLM2 tokenizer's
does not)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixkv.apps.serve import tool_calls

#: What Qwen 2.5 writes for two calls (its template's format, Hermes 2 Pro's).
QWEN = (
    "I'll check both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
)
#: What Llama 3.1 writes for a call (its template asks for "parameters").
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
#: The tools the request declares.
NAMES = frozenset({"get_weather", "f", "a", "b"})
TEMPLATES = Path(__file__).parents[1] / "support" / "templates"


def args(call):
    assert call["type"] == "function" and call["id"].startswith("call_")
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_hermes_calls_and_content():
    content, calls = tool_calls.parse("hermes", QWEN, NAMES)
    assert content == "I'll check both cities.\n"
    assert [args(c) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_weather", {"city": "Zürich"}),
    ]
    assert calls[0]["id"] != calls[1]["id"]


def test_hermes_unclosed_last_call_and_no_content():
    content, calls = tool_calls.parse(
        "hermes", '<tool_call>\n{"name": "f", "arguments": {}}', NAMES
    )
    assert content is None and [args(c) for c in calls] == [("f", {})]


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny today.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
        "<tool_call>not json</tool_call>",
    ],
)
def test_hermes_text_that_is_no_whole_call_is_text(text):
    assert tool_calls.parse("hermes", text, NAMES) == (text, [])


def test_llama3_json_calls():
    content, calls = tool_calls.parse("llama3_json", LLAMA, NAMES)
    assert content is None and [args(c) for c in calls] == [("get_weather", {"city": "Paris"})]
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
    both = tool_calls.parse("llama3_json", two, NAMES)[1]
    assert [args(c) for c in both] == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize(
    "text", ["The weather is fine.", '{"name": "f", "parameters": {"a": 1', LLAMA + " and more"]
)
def test_llama3_json_text_is_text(text):
    assert tool_calls.parse("llama3_json", text, NAMES) == (text, [])


#: JSON a model may write that is no call of the tools declared (``get_weather(city)``): an
#: answer shaped like a call to an undeclared function, a declared name without its arguments,
#: arguments that are no object.
NOT_CALLS = {
    "llama3_json": [
        '{"name": "Bob", "age": 30}',
        '{"name": "get_weather"}',
        '{"name": "get_weather", "parameters": [1]}',
        '{"name": "get_weather", "parameters": {}}; {"name": "Bob", "parameters": {}}',
    ],
    "hermes": [
        '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
        '<tool_call>\n{"name": "Bob", "arguments": {"age": 30}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": "[1]"}\n</tool_call>',
        'Two: <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>',
    ],
}


@pytest.mark.parametrize("parser, text", [(p, t) for p, texts in NOT_CALLS.items() for t in texts])
def test_json_that_is_no_call_of_a_declared_tool_is_text_streamed_too(parser, text):
    declared = frozenset({"get_weather"})
    assert tool_calls.parse(parser, text, declared) == (text, [])
    for size in (1, 1000):
        assert stream(parser, text, size, declared) == (text, [])


def test_a_declared_call_with_an_arguments_object_is_a_call_checked_against_nothing_more():
    # get_weather requires a city; the parser checks the name and that arguments are an object
    for parser, text in (
        ("llama3_json", '{"name": "get_weather", "parameters": {}}'),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),
    ):
        content, calls = tool_calls.parse(parser, text, frozenset({"get_weather"}))
        assert content is None and [args(c) for c in calls] == [("get_weather", {})]


def stream(parser: str, text: str, size: int, names=NAMES):
    """``text`` fed in pieces of ``size`` characters: (what was sent as content, calls)."""
    s = tool_calls.StreamSplitter(parser, names)
    sent = "".join(s.feed(text[i : i + size]) for i in range(0, len(text), size))
    content, calls = s.finish()
    return sent + (content or ""), calls


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_calls_equal_whole(size):
    for parser, text in (("hermes", QWEN), ("llama3_json", LLAMA)):
        content, calls = stream(parser, text, size)
        whole_content, whole_calls = tool_calls.parse(parser, text, NAMES)
        assert content == (whole_content or "")
        assert [args(c) for c in calls] == [args(c) for c in whole_calls]
    for parser in tool_calls.PARSERS:
        assert stream(parser, "Plain <tool text", size) == ("Plain <tool text", [])


def test_streamed_text_before_a_hermes_call_is_sent_before_the_end():
    s = tool_calls.StreamSplitter("hermes", NAMES)
    assert s.feed("Let me look. <tool") == "Let me look. "  # a start of <tool_call> held back
    assert s.feed('_call>{"name": "f", "arguments": {}}') == ""
    assert s.finish()[0] is None


def test_the_real_smollm2_template_ignores_tools_and_a_tools_template_renders_them():
    from radixkv.hf._load import smollm2_path

    if smollm2_path() is None:
        pytest.skip("the real model is not installed")
    import radixkv.hf

    _, tokenizer = radixkv.hf.load("smollm2")
    assert not tool_calls.template_renders_tools(tokenizer)
    template = (TEMPLATES / "hermes_tools.jinja").read_text()
    assert tool_calls.template_renders_tools(tokenizer, template)


def test_parallel_tool_calls_false_keeps_the_first_call():
    one = tool_calls.Auto("hermes", NAMES, parallel=False)
    assert [args(c) for c in one.parse(QWEN)[1]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    s = one.splitter()
    s.feed(QWEN)
    assert len(s.finish()[1]) == 1 and len(tool_calls.Auto("hermes", NAMES).parse(QWEN)[1]) == 2
