"""OpenAI's Responses API through the real ``radixkv serve`` on the real model, driven by the
official ``openai`` client (``client.responses``, its stream helper) and an ``openai-agents``
agent: a conversation chained by ``previous_response_id`` reuses the cache turn by turn and
says what chat completions say for it whole; stored responses are per tenant and bounded;
malformed items are 400s naming the field; chat's prompt caching fields (``prompt_cache_key``
reported in the KV events, read by a subscriber of radixkv's and of vLLM's layout). One server
for the module (a tenant header, three stored responses at most, KV events on)."""

from __future__ import annotations

import asyncio
import itertools
import json
import tempfile
import uuid

import pytest

httpx = pytest.importorskip("httpx")

import serve_process  # noqa: E402

openai = serve_process.needs_real_server()

TENANT = "X-Tenant"
STORED = 3
#: Where the server publishes its KV events.
EVENTS = f"ipc://{tempfile.gettempdir()}/radixkv-test-responses-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def url(served):
    args = ["--num-pages", "2048", "--served-model-name", "m", "--tenant-header", TENANT]
    events = ["--kv-events", EVENTS] if has_events() else []
    return served(*args, "--max-stored-responses", str(STORED), *events).url


def has_events() -> bool:
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError:
        return False
    return True


def client(url, tenant="a"):
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key="none",
        max_retries=0,
        default_headers={TENANT: tenant},
    )


GREEDY = dict(model="m", temperature=0, max_output_tokens=8)
TURNS = ["Name a fruit.", "Name another one.", "And a vegetable?", "Which is the sweetest?"]


def test_a_chain_by_previous_response_id_is_the_cached_conversation(url):
    """Four turns by ``previous_response_id``: each later turn finds the previous turn's
    prompt and output cached (all but its last sampled token, whose KV no step computed), and
    each reply is the one chat completions gives the whole conversation (greedy)."""
    c = client(url, "chain")
    previous, prior_total, messages = None, None, []
    for turn, text in enumerate(TURNS):
        r = c.responses.create(input=text, previous_response_id=previous, **GREEDY)
        assert r.status in ("completed", "incomplete") and r.output_text
        messages.append({"role": "user", "content": text})
        whole = c.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=8)
        assert r.output_text == whole.choices[0].message.content, turn
        assert r.usage.input_tokens == whole.usage.prompt_tokens, "the same prompt"
        if prior_total is not None:
            cached = r.usage.input_tokens_details.cached_tokens
            assert cached >= prior_total - 1, (turn, cached, prior_total)
        messages.append({"role": "assistant", "content": r.output_text})
        previous, prior_total = r.id, r.usage.total_tokens


def test_instructions_are_this_responses_only(url):
    c = client(url, "instr")
    first = c.responses.create(input="Hi.", instructions="Answer in French.", **GREEDY)
    second = c.responses.create(input="Bye.", previous_response_id=first.id, **GREEDY)
    conversation = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Bye."},
    ]
    whole = c.chat.completions.create(model="m", messages=conversation, max_tokens=8)
    assert second.usage.input_tokens == whole.usage.prompt_tokens, "no system message carried"


def test_a_response_id_is_its_tenants_alone(url):
    a, b = client(url, "tenant-a"), client(url, "tenant-b")
    r = a.responses.create(input="Hello.", **GREEDY)
    assert a.responses.retrieve(r.id).output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        b.responses.create(input="Go on.", previous_response_id=r.id, **GREEDY)
    assert "previous_response_id" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r.id)
    a.responses.delete(r.id)  # its own tenant's
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r.id)


def test_a_chain_is_stored_turn_by_turn(url):
    """Each stored response holds its own turn and a link to the one before: the chain is
    rebuilt from the links, and one whose earlier response was deleted cannot go on."""
    c = client(url, "links")
    first = c.responses.create(input="Name a colour.", **GREEDY)
    second = c.responses.create(input="Another.", previous_response_id=first.id, **GREEDY)
    third = c.responses.create(input="And one more.", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.total_tokens - 1
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(input="Go on.", previous_response_id=third.id, **GREEDY)
    assert "previous_response_id" in str(e.value)


def test_the_store_keeps_the_newest_within_its_bound(url):
    c = client(url, "bound")
    ids = [c.responses.create(input=f"Say {k}.", **GREEDY).id for k in range(STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[0])
    assert c.responses.retrieve(ids[-1]).id == ids[-1]
    metrics = httpx.get(url + "/metrics").text
    dropped = [
        ln for ln in metrics.splitlines() if ln.startswith("radixkv_responses_dropped_total")
    ]
    assert dropped and float(dropped[0].split()[-1]) >= 1, metrics[-2000:]


@pytest.mark.parametrize(
    "item, field",
    [
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
        ({"type": "function_call_output", "output": "x"}, "input.0.call_id"),
        ({"role": "robot", "content": "x"}, "input.0.role"),
        ({"role": "user", "content": [{"type": "input_image"}]}, "input.0.content.0.type"),
        ({"type": "web_search_call"}, "input.0.type"),
    ],
)
def test_a_malformed_item_is_a_400_naming_its_field(url, item, field):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).responses.create(input=[item], **GREEDY)
    assert e.value.body["param"] == field and field in e.value.body["message"]


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"text": {"format": "json"}}, "text.format"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"background": True}, "background"),
        ({"instructions": 3}, "instructions"),
    ],
)
def test_a_malformed_field_is_a_400_naming_it(url, extra, field):
    r = httpx.post(url + "/v1/responses", json={"input": "Hi", **extra}, headers={TENANT: "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


YES_NO = {
    "type": "json_schema",
    "name": "answer",
    "schema": {
        "type": "object",
        "properties": {"yes": {"type": "boolean"}},
        "required": ["yes"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_the_stream_parses_with_the_sdks_helper(url):
    c = client(url, "stream")
    ask = dict(model="m", temperature=0, max_output_tokens=16, text={"format": YES_NO})
    whole = c.responses.create(input="Is the sky blue? Answer in JSON.", **ask)
    with c.responses.stream(input="Is the sky blue? Answer in JSON.", **ask) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    assert final.output_text == whole.output_text and "yes" in json.loads(final.output_text)
    assert final.usage.input_tokens_details.cached_tokens > 0, "the same prompt again"
    assert c.responses.retrieve(final.id).output_text == final.output_text


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_a_function_call_round_trip_streamed(url):
    c = client(url, "tools")
    ask = dict(model="m", temperature=0, max_output_tokens=32, tools=[WEATHER])
    stream = c.responses.create(
        input="Weather in Paris?", tool_choice="required", stream=True, **ask
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = events[-1].response
    [call] = [item for item in done.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    after = c.responses.create(input=[result], previous_response_id=done.id, **ask)
    assert (
        after.output and after.usage.input_tokens_details.cached_tokens >= done.usage.input_tokens
    )


def test_an_agents_sdk_agent_runs_through_responses(url):
    """An ``openai-agents`` agent with two function tools on the real model: its first step
    must call a tool (``tool_choice="required"``; SmolLM2 calls them poorly unforced), the SDK
    runs it and sends the result back, every later step finds the steps before cached, and
    the run ends (an answer, or the turn limit)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(f"weather {city}")
        return "Sunny, 21 C"

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        ran.append(f"time {city}")
        return "14:00"

    api = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, default_headers={TENANT: "agent"}
    )
    agent = agents.Agent(
        name="assistant",
        instructions="Answer with the tools' results.",
        tools=[get_weather, get_time],
        model=agents.OpenAIResponsesModel(model="m", openai_client=api),
        # a reply cut by max_tokens is "incomplete", which the SDK raises for: replies end
        # at the first full stop instead (radixkv's stop, sent as an extra)
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0, max_tokens=64, extra_body={"stop": ["."]}
        ),
    )

    async def run():
        try:
            result = await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        except agents.MaxTurnsExceeded as e:
            return e.run_data.raw_responses
        return result.raw_responses

    steps = asyncio.run(run())
    assert len(steps) >= 2 and ran, "a tool ran and its result went back to the model"
    assert any(item.type == "function_call" for item in steps[0].output)
    for before, step in itertools.pairwise(steps):
        cached = step.usage.input_tokens_details.cached_tokens
        assert cached >= before.usage.input_tokens, (cached, before.usage)


def test_prompt_cache_fields_of_chat_completions(url):
    c = client(url)
    ask = dict(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    r = c.chat.completions.create(
        **ask, extra_body={"prompt_cache_key": "k1", "prompt_cache_retention": "in_memory"}
    )
    assert r.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:  # 24 h is past --max-keep-alive's 1 h
        c.chat.completions.create(**ask, extra_body={"prompt_cache_retention": "24h"})
    assert e.value.body["param"] == "prompt_cache_retention"
    assert "bound of 3600 seconds (--max-keep-alive)" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(**ask, extra_body={"prompt_cache_retention": "forever"})
    assert e.value.body["param"] == "prompt_cache_retention"


def test_an_anthropic_1h_breakpoint_is_honoured_on_a_default_server(url):
    """This module's server has the default ``--max-keep-alive`` (an hour): the Anthropic SDK's
    longest ``ttl``, "1h", is honoured as asked (a 200 and a retention made), where chat's
    "24h" (above) is a 400 naming the bound: one rule for both."""
    anthropic = pytest.importorskip("anthropic")
    c = anthropic.Anthropic(
        base_url=url, api_key="none", max_retries=0, default_headers={TENANT: "a"}
    )
    before = retentions(url)
    text = "Notes for the long task: " + " ".join(f"item {k}" for k in range(30))
    m = c.messages.create(
        model="m",
        max_tokens=2,
        system=[
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
        ],
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert m.usage.cache_creation_input_tokens > 0, m.usage
    assert retentions(url) == before + 1


def retentions(url) -> float:
    """The server's live retentions (``radixkv_retentions`` on ``/metrics``)."""
    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("radixkv_retentions{")
    )


def test_prompt_cache_key_is_reported_with_the_blocks_its_request_stores(url):
    """With ``--kv-events``, the blocks a request with a ``prompt_cache_key`` stores carry the
    key hashed with the request's namespace: the same key of two tenants reports two values,
    a request without one reports none, the reply's blocks none. A decoder of vLLM's layout
    (its ``BlockStored`` without the field) reads the same events, every field of its equal."""
    if not has_events():
        pytest.skip("--kv-events needs radixkv[events] (pyzmq, msgspec)")
    import msgspec
    import zmq

    from event_subscriber import same_fields, vllm_decoder
    from radixkv.events import event_types, prompt_cache_key_hash
    from radixkv.tenancy import tenant_namespace

    ours = msgspec.msgpack.Decoder(event_types("array")["KVEventBatch"])
    vllm = vllm_decoder("array")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.connect(EVENTS)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)

    def chat(tenant: str, text: str, key: str | None = None) -> list[int]:
        """Runs ``text`` as tenant's chat completion; returns its prompt's tokens."""
        messages = [{"role": "user", "content": text}]
        extra = {} if key is None else {"prompt_cache_key": key}
        client(url, tenant).chat.completions.create(
            model="m", messages=messages, max_tokens=3, extra_body=extra
        )
        r = httpx.post(
            url + "/tokenize", headers={TENANT: tenant}, json={"model": "m", "messages": messages}
        )
        return r.json()["tokens"]

    def drain(quiet: float) -> list:
        """The BlockStored events, of both decoders, until none arrives for ``quiet`` s."""
        got = []
        while poller.poll(int(quiet * 1000)):
            _, _, payload = sub.recv_multipart()
            a, b = ours.decode(payload).events, vllm.decode(payload).events
            got += [(x, y) for x, y in zip(a, b) if type(x).__name__ == "BlockStored"]
        return got

    try:
        for k in range(100):  # PUB/SUB drops what is sent before the subscription is in
            chat("join", f"Say {k}.")
            if drain(0.5):
                break
        else:
            raise AssertionError("no KV event reached the subscriber")
        drain(1.0)
        word = uuid.uuid4().hex[:8]
        prompts = {
            "a": chat("a", f"Spell the word {word} backwards.", "k"),
            "b": chat("b", f"Spell the word {word} backwards.", "k"),
            "c": chat("a", f"Spell the word {word} twice.", None),
        }
        events = drain(1.5)
    finally:
        sub.close()
    hashes = {t: prompt_cache_key_hash("k", tenant_namespace(t, None, tenants=True)) for t in "ab"}
    assert hashes["a"] != hashes["b"], "one key, two tenants: two values"
    assert all(same_fields(x, y) for x, y in events), "vLLM's layout reads its own fields"
    reported = {e.prompt_cache_key for e, _ in events}
    assert reported == {hashes["a"], hashes["b"], None}, reported
    for t in "ab":
        hinted = [tok for e, _ in events if e.prompt_cache_key == hashes[t] for tok in e.token_ids]
        assert hinted and prompts[t][-len(hinted) :] == hinted, (t, hinted, prompts[t])
