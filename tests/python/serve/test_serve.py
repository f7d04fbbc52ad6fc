"""``radixkv serve`` on the real model (SmolLM2-135M-Instruct), driven by the official ``openai``
client over HTTP on 127.0.0.1: cached turns, streaming, ``n``, tenants, concurrency,
disconnects, bad requests, and the side endpoints.

The server runs in a thread of this process (uvicorn), so the tests can read its engine and
cache directly. Outputs are short: the model decodes about 10 tokens/s on two CPU cores.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import radixkv  # noqa: E402
import radixkv.hf  # noqa: E402
from serve_thread import Server, smollm2_unavailable  # noqa: E402

if smollm2_unavailable() and __name__ != "__main__":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason=smollm2_unavailable() or "")


SYSTEM = (
    "You are a coding agent. Tools: read_file(path), run_tests(target), search(query). "
    "Answer in one short sentence."
)


@pytest.fixture(scope="module")
def real():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(2)
    return radixkv.hf.load("smollm2")


@pytest.fixture(scope="module")
def server(real):
    s = Server(*real)
    yield s
    s.close()


def chat(server, messages, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return server.client.chat.completions.create(model="smollm2", messages=messages, **kw)


def reference_text(real, messages, max_new_tokens):
    """transformers' own greedy continuation of the chat, decoded, stopping at the EOS."""
    import torch

    model, tok = real
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_multi_turn_chat_is_cached_and_equals_transformers(server, real):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
    cached = []
    for turn in range(3):
        r = chat(server, messages)
        assert r.choices[0].message.content == reference_text(real, messages, 8)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"Now run the tests of module {turn}."},
        ]
    assert cached[0] == 0 or cached[0] < cached[1]
    assert cached[1] > 20 and cached[2] > cached[1]
    server.idle()
    server.cache.check()


def test_streaming_equals_non_streaming(server):
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = chat(server, messages, max_tokens=10).choices[0].message.content
    stream = chat(
        server, messages, max_tokens=10, stream=True, stream_options={"include_usage": True}
    )
    parts, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == whole
    assert reasons[-1] in ("stop", "length")
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0


def test_n_choices_compute_the_prompt_once(server):
    messages = [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "Go."}]
    before = server.engine.stats.tokens
    r = chat(server, messages, n=3, max_tokens=4)
    computed = server.engine.stats.tokens - before
    prompt = r.usage.prompt_tokens
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]
    # The prompt once, then at most a page of each branch's own and its decode steps.
    assert computed <= prompt + 3 * (4 + 1), (computed, prompt)
    texts = {c.message.content for c in r.choices}
    assert len(texts) == 1  # greedy: every branch says the same


def test_tenants_never_share_a_prefix(server):
    messages = [{"role": "user", "content": "A secret only tenant a has sent: 48213."}]
    a = chat(server, messages, extra_body={"cache_salt": "tenant-a"}, max_tokens=2)
    b = chat(server, messages, extra_body={"cache_salt": "tenant-b"}, max_tokens=2)
    a2 = chat(server, messages, extra_body={"cache_salt": "tenant-a"}, max_tokens=2)
    assert b.usage.prompt_tokens_details.cached_tokens == 0
    assert a2.usage.prompt_tokens_details.cached_tokens > 0
    # The configured header names the tenant; a salt only subdivides a tenant's namespace, so
    # the salt "tenant-a" (sent without the header) is not the tenant "tenant-a".
    h = chat(server, messages, extra_headers={"X-Tenant": "tenant-a"}, max_tokens=2)
    assert h.usage.prompt_tokens_details.cached_tokens == 0
    h2 = chat(server, messages, extra_headers={"X-Tenant": "tenant-a"}, max_tokens=2)
    assert h2.usage.prompt_tokens_details.cached_tokens > 0
    assert a.choices[0].message.content == b.choices[0].message.content


def test_sixteen_concurrent_streaming_clients_all_complete(server):
    async def one(client, i):
        stream = await client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        reason = None
        async for chunk in stream:
            for c in chunk.choices:
                reason = c.finish_reason or reason
        return reason

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(16)))

    steps = server.loop.steps
    reasons = asyncio.run(main())
    assert all(r in ("stop", "length") for r in reasons), reasons
    # Batched: far fewer steps than 16 clients one after the other would take.
    assert server.loop.steps - steps < 16 * 5
    server.idle()
    server.cache.check()


def test_a_client_gone_mid_stream_leaves_nothing_pinned(server):
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: ") for line in got)
    server.idle(timeout=60)  # cancelled well before its 200 tokens
    server.cache.check()
    stats = server.cache.stats
    assert stats.used_pages == 0, "a cancelled request still pins pages"


BAD = [
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 5}, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": []}, "messages"),
    ({"model": "smollm2"}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, None),
    ({"messages": [{"role": "user", "content": "x"}], "keep_alive": -1}, "keep_alive"),
    ({"messages": [{"role": "user", "content": "x"}], "cache_priority": 9}, "cache_priority"),
    (
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        "response_format",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            },
        },
        "response_format",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
            "tools": [{"type": "function", "function": {"name": "yes"}}],
        },
        "tool_choice",
    ),
    (
        {
            "messages": [{"role": "user", "content": "x"}],
            "tool_choice": "required",
            "tools": [{"type": "web"}],
        },
        "tools.0",
    ),
]


@pytest.mark.parametrize("body,field", BAD)
def test_bad_requests_get_400_naming_the_field_and_the_server_keeps_serving(server, body, field):
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if field is not None:
        assert err["param"] == field or field in err["message"], err
    assert chat(server, [{"role": "user", "content": "ok?"}], max_tokens=1).choices


def test_keep_alive_retains_a_turn_until_the_next_one_takes_over(server):
    """radixkv's own request fields, sent by the openai client with extra_body."""
    before = server.cache.stats.retentions
    messages = [{"role": "user", "content": "Name a prime number."}]
    first = chat(
        server, messages, max_tokens=2, extra_body={"keep_alive": 200, "cache_priority": 2}
    )
    server.idle()
    assert server.cache.stats.retentions == before + 1
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Another one."},
    ]
    second = chat(server, messages, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    server.cache.check()
    server.loop.call_blocking(lambda: server.cache.advance(server.cache.now + 201.0))
    assert server.cache.stats.retentions == before, "expired with the cache's clock"


def test_invalid_json_is_a_400(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_a_full_queue_answers_429(server):
    server.loop.max_waiting = 1
    try:
        stream = chat(server, [{"role": "user", "content": "Count."}], max_tokens=40, stream=True)
        next(iter(stream))  # in flight: the one sequence the bound allows
        with pytest.raises(openai.RateLimitError):
            chat(server, [{"role": "user", "content": "hello"}], max_tokens=1)
        stream.close()
        server.idle()
    finally:
        server.loop.max_waiting = 64
    assert chat(server, [{"role": "user", "content": "hello"}], max_tokens=1).choices


def test_completions_models_health_and_metrics(server):
    r = server.client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=3, temperature=0
    )
    assert r.choices[0].text and r.usage.completion_tokens == 3
    assert [m.id for m in server.client.models.list()] == ["smollm2"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    metrics = httpx.get(server.url + "/metrics").text
    assert "radixkv_prefix_cache" in metrics


# ---- structured output ------------------------------------------------------------------------


def obj(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


WEATHER = obj(
    {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}}
)
SEARCH = obj(
    {
        "query": {"type": "string", "maxLength": 16},
        "limit": {"type": "integer", "minimum": 1, "maximum": 20},
    }
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "A city's weather.",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Searches the docs.",
            "parameters": SEARCH,
        },
    },
]
PARAMETERS = {"get_weather": WEATHER, "search_docs": SEARCH}


def test_response_format_json_schema_and_json_object_parse(server):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    person = obj(
        {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        }
    )
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person}}
    r = chat(server, ask, max_tokens=40, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), person)
    r = server.client.completions.create(
        model="smollm2",
        prompt="A person as JSON:",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": fmt},
    )
    jsonschema.validate(json.loads(r.choices[0].text), person)
    # Any object: the model could write one for ever; a few short ones before make it brief.
    few = 'Short JSON objects, one a line:\n{"a": 1}\n{"b": [2, 3]}\n{"c": "d"}\n'
    r = server.client.completions.create(
        model="smollm2",
        prompt=few,
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_tool_calls_parse_against_their_schemas_streaming_too_and_the_next_turn_is_cached(server):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    ask = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    calls = {}
    for choice in ("required", named):
        r = chat(server, ask, tools=TOOLS, tool_choice=choice, max_tokens=48)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        calls[str(choice)] = call
    call = calls[str(named)]
    assert call.function.name == "get_weather"
    stream = chat(server, ask, tools=TOOLS, tool_choice=named, max_tokens=48, stream=True)
    deltas, reasons = [], []
    for ch in stream:
        for c in ch.choices:
            deltas += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (call.function.name, call.function.arguments)
    ]
    assert reasons[-1] == "tool_calls"
    # The agent sends the call and its result back: the call is found in the cache.
    follow = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."},
    ]
    first = chat(server, ask, max_tokens=1)
    r = chat(server, follow, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens + 10
    server.idle()
    server.cache.check()
