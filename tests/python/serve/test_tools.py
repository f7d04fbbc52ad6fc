"""``tool_choice="auto"`` through the real ``radixkv serve`` on the real model, driven by the
``openai`` client: the tools reach the prompt through the chat template, and whatever the model
writes comes back as ``tool_calls`` or as text, never a 400. The model is SmolLM2 with a
Hermes/Qwen-style template beside its weights that renders tools and an agent's history of calls
(the prompt is transformers' own, token for token, through chat and ``/tokenize``); its own
template ignores both: the server says so at start-up and in each reply, renders the calls as
JSON itself, and (``llama3_json``) parses no call out of a JSON answer that names no tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

import serve_process  # noqa: E402

openai = serve_process.needs_real_server()
from radixkv.apps.serve.chat_prompt import CALLS_NOT_RENDERED  # noqa: E402
from radixkv.hf._load import _converted, smollm2_path  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TEMPLATES = Path(__file__).parents[1] / "support" / "templates"
ASK = [{"role": "user", "content": "What is the weather in Paris? Call the tool."}]
#: The call the model made and its result, sent back as an agent does (OpenAI's shape: the
#: arguments a JSON string, the content null).
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY = [
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."},
]


def tools_checkpoint(tmp) -> str:
    """The real converted SmolLM2 checkpoint, its files linked, with a chat template that
    renders tools in the Hermes/Qwen format."""
    source = _converted(smollm2_path())
    for f in source.iterdir():
        if f.name != "chat_template.jinja":
            (tmp / f.name).symlink_to(f)
    (tmp / "chat_template.jinja").write_text((TEMPLATES / "hermes_tools.jinja").read_text())
    return str(tmp)


@pytest.fixture(scope="module")
def url(tmp_path_factory, served):
    model = tools_checkpoint(tmp_path_factory.mktemp("tools-model"))
    args = ["--model", model, "--num-pages", "1024", "--tool-call-parser", "hermes"]
    return served(*args, "--served-model-name", "m").url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def check_choice(choice):
    """A tool call (whole, valid JSON arguments) or text, as OpenAI answers ``"auto"``."""
    if choice.finish_reason == "tool_calls":
        call = choice.message.tool_calls[0]
        assert call.function.name and isinstance(json.loads(call.function.arguments), dict)
    else:
        assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
        assert isinstance(choice.message.content, str)


def test_the_prompt_holds_the_tools(url):
    with_tools = httpx.post(url + "/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    bare = httpx.post(url + "/tokenize", json={"messages": ASK}).json()
    text = httpx.post(url + "/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    r = client(url).chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=2, temperature=0
    )
    assert r.usage.prompt_tokens == with_tools["count"] > bare["count"]
    assert "warnings" not in (r.model_extra or {})  # the template renders the tools


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_returns_tool_calls_or_text(url, choice):
    kw = {} if choice is None else {"tool_choice": choice}  # OpenAI's default with tools: auto
    r = client(url).chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, max_tokens=24, temperature=0, **kw
    )
    check_choice(r.choices[0])


def test_auto_streamed_equals_whole(url):
    kw = dict(model="m", messages=ASK, tools=TOOLS, max_tokens=24, temperature=0)
    whole = client(url).chat.completions.create(**kw).choices[0]
    content, calls, reason = "", [], None
    for chunk in client(url).chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    assert reason == whole.finish_reason
    if calls:
        assert [c.function.arguments for c in calls] == [
            c.function.arguments for c in whole.message.tool_calls
        ]
    assert content == (whole.message.content or "")


def test_malformed_tools_are_a_400_naming_them(url):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(
            model="m", messages=ASK, tools=[{"type": "function"}], max_tokens=1
        )
    assert e.value.body["param"] == "tools.0"


def test_a_call_history_is_the_prompt_transformers_renders_through_chat_and_tokenize(url):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(_converted(smollm2_path()))
    documented = json.loads(json.dumps(HISTORY))  # transformers documents arguments as objects
    documented[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    want = tok.apply_chat_template(
        documented,
        tools=TOOLS,
        chat_template=(TEMPLATES / "hermes_tools.jinja").read_text(),
        tokenize=True,
        return_dict=False,
        add_generation_prompt=True,
    )
    got = httpx.post(url + "/tokenize", json={"messages": HISTORY, "tools": TOOLS}).json()
    assert got["tokens"] == list(want) and "warnings" not in got
    text = httpx.post(url + "/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    r = client(url).chat.completions.create(
        model="m", messages=HISTORY, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert r.usage.prompt_tokens == len(want)
    assert "warnings" not in (r.model_extra or {})


@pytest.fixture(scope="module")
def default(served):
    """The real model with its own template (which ignores tools and calls), parsing calls in
    Llama 3's JSON format."""
    s = served("--num-pages", "256", "--tool-call-parser", "llama3_json")
    return s.url, s.proc


def test_the_default_template_ignores_tools_and_the_server_says_so(default):
    url, proc = default
    lines = []
    while not lines or "on http://" not in lines[-1]:
        lines.append(proc.stderr.readline())
    assert any("does not render tools" in line for line in lines)
    r = client(url).chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=2, temperature=0
    )
    check_choice(r.choices[0])
    assert "does not render tools" in r.model_extra["warnings"][0]


def test_a_call_history_the_template_ignores_is_rendered_and_tokenized_alike(default):
    url, _ = default
    got = httpx.post(url + "/tokenize", json={"messages": HISTORY, "tools": TOOLS})
    assert got.status_code == 200, got.text
    assert got.json()["warnings"] == [CALLS_NOT_RENDERED]
    text = httpx.post(url + "/detokenize", json={"tokens": got.json()["tokens"]}).json()["prompt"]
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    r = client(url).chat.completions.create(
        model="smollm2", messages=HISTORY, tools=TOOLS, max_tokens=1, temperature=0
    )
    assert r.usage.prompt_tokens == got.json()["count"]
    assert CALLS_NOT_RENDERED in r.model_extra["warnings"]


def forced(value: dict) -> dict:
    """A ``response_format`` whose only reply is the JSON object ``value``."""
    props = {k: {"const": v} for k, v in value.items()}
    schema = {"type": "object", "properties": props, "required": list(value)}
    schema["additionalProperties"] = False
    return {"type": "json_schema", "json_schema": {"name": "forced", "schema": schema}}


@pytest.mark.parametrize("answer", [{"name": "Bob", "age": 30}, {"name": "get_weather"}])
def test_a_json_answer_that_is_no_declared_call_stays_text_streamed_too(default, answer):
    pytest.importorskip("llguidance")
    url, _ = default
    kw = dict(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    kw["extra_body"] = {"response_format": forced(answer)}
    c = client(url).chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert json.loads(c.message.content) == answer
    content, calls, reason = "", [], None
    for chunk in client(url).chat.completions.create(stream=True, **kw):
        for d in chunk.choices:
            content += d.delta.content or ""
            calls += d.delta.tool_calls or []
            reason = d.finish_reason or reason
    assert (content, calls, reason) == (c.message.content, [], "stop")
