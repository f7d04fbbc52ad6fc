"""Anthropic's Messages API through the real ``radixkv serve`` on the real model, driven by the
official ``anthropic`` client: a ``cache_control`` breakpoint keeps the prompt's prefix up to
the exact token where its block ends through pressure that evicts everything else, for its TTL
and not after; the usage fields add up to the prompt; errors are Anthropic's and name the
field; ``x-api-key`` is the server's ``--api-key``; the stream parses with the SDK's helper.
One server for the module: a key, a pool of 400 pages, retention bounded to a few seconds."""

from __future__ import annotations

import time
import uuid

import pytest

httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")

import serve_process  # noqa: E402

openai = serve_process.needs_real_server()
from radixkv.hf._load import _converted, smollm2_path  # noqa: E402

KEY = "sk-test"
PAGES = 400
#: --max-keep-alive: the bound the default TTL of a breakpoint that names none (5 minutes) is cut
#: to, so that the test sees it end; a ttl named past it ("5m", "1h") is a 400. The breakpoint
#: test waits it out; the pressure it must outlast takes about 2 s here (the test fails, saying
#: so, if the pressure ever outlasts it).
TTL = 10.0


@pytest.fixture(scope="module")
def url(served):
    args = ["--num-pages", str(PAGES), "--served-model-name", "m", "--api-key", KEY]
    return served(*args, "--max-keep-alive", f"{TTL:g}").url


def client(url, key=KEY):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


SYSTEM = "You answer questions about a small town."
NOTES = (
    "Here are the town notes: the baker is Ada, the mayor is Bob, the river is cold, the bridge "
    "is old, the market opens on Monday and the library closes at noon on Friday"
)
QUESTION = "Now the question: who is the {}?"


def ask(notes_block: dict, who: str) -> dict:
    return dict(
        model="m",
        max_tokens=4,
        extra_body={"temperature": 0},
        system=SYSTEM,
        messages=[
            {
                "role": "user",
                "content": [notes_block, {"type": "text", "text": QUESTION.format(who)}],
            }
        ],
    )


def notes_end() -> int:
    """Tokens of the prompt up to the end of NOTES, counted from the model's own tokenizer and
    chat template (the user content is the blocks' texts joined by a newline)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_converted(smollm2_path())))
    conversation = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": NOTES + "\n" + QUESTION.format("baker")},
    ]
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text[: text.index(NOTES) + len(NOTES)], add_special_tokens=False))


def pressure(url, seed: int) -> None:
    """Unrelated prompts of more tokens than the pool holds, each cached after the last."""
    api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    for k in range(3):
        words = " ".join(f"w{seed}x{k}y{j}" for j in range(40))
        api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": words}], max_tokens=1
        )


def test_a_breakpoint_keeps_its_prefix_through_pressure_for_its_ttl(url):
    c = client(url)
    marked = {"type": "text", "text": NOTES, "cache_control": {"type": "ephemeral"}}
    plain = {"type": "text", "text": NOTES}
    end = notes_end()
    first = c.messages.create(**ask(marked, "baker"))
    retained_at = time.monotonic()
    u = first.usage
    assert u.cache_read_input_tokens + u.cache_creation_input_tokens == end, u
    pressure(url, 1)
    assert time.monotonic() - retained_at < TTL, "pressure outlasted the TTL: the pool is too big"
    probe = c.messages.create(**ask(plain, "mayor"))
    # the probe shares more than the notes with the first prompt ("Now the question: who is
    # the"): only the breakpoint's prefix, to its exact token, outlived the pressure
    assert probe.usage.cache_read_input_tokens == end, probe.usage
    assert probe.usage.cache_creation_input_tokens == 0
    time.sleep(max(0.0, retained_at + TTL + 1 - time.monotonic()))
    pressure(url, 2)
    late = c.messages.create(**ask(plain, "river"))
    assert late.usage.cache_read_input_tokens < end, "past its TTL the prefix is evicted"


def test_the_usage_fields_add_up_to_the_prompt(url):
    c = client(url)
    marked = {"type": "text", "text": NOTES, "cache_control": {"type": "ephemeral"}}
    m = c.messages.create(**ask(marked, "baker"))
    chat = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    whole = chat.chat.completions.create(
        model="m",
        max_tokens=4,
        temperature=0,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": NOTES + "\n" + QUESTION.format("baker")},
        ],
    )
    u = m.usage
    total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert total == whole.usage.prompt_tokens, u
    assert m.content[0].text == whole.choices[0].message.content


@pytest.mark.parametrize("ttl", ["5m", "1h"])
def test_a_ttl_past_the_bound_is_a_400_naming_it_and_nothing_is_retained(url, ttl):
    """A ``ttl`` named is honoured or refused, never cut: past ``--max-keep-alive`` (10 s
    here) the 400 names the field, the value and the bound, and nothing was retained."""
    before = retentions(url)
    marked = {"type": "text", "text": NOTES, "cache_control": {"type": "ephemeral", "ttl": ttl}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client(url).messages.create(**ask(marked, "baker"))
    message = e.value.body["error"]["message"]
    assert message.startswith("messages.0.content.0.cache_control.ttl: "), message
    assert repr(ttl) in message and f"bound of {TTL:g} seconds (--max-keep-alive)" in message
    assert retentions(url) == before


def retentions(url) -> float:
    """The server's live retentions."""
    return metric(url, "radixkv_retentions")


def metric(url, name: str) -> float:
    """The value of ``name`` on the server's ``/metrics``."""
    text = httpx.get(url + "/metrics", headers={"x-api-key": KEY}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_a_breakpoint_counts_no_query_and_no_hit(url):
    """A breakpoint's retention is no admission: a request with two breakpoints counts one
    admission (its own) in the cache's counters, its prompt's tokens and its cache read."""
    names = [f"radixkv_prefix_cache_{n}_total" for n in ("requests", "query_tokens", "hit_tokens")]
    before = [metric(url, n) for n in names]
    town = f"You answer questions about the town of {uuid.uuid4().hex[:8]}."  # not cached yet
    system = [{"type": "text", "text": town, "cache_control": {"type": "ephemeral"}}]
    marked = {"type": "text", "text": NOTES, "cache_control": {"type": "ephemeral"}}
    m = client(url).messages.create(**{**ask(marked, "bridge"), "system": system})
    u = m.usage
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert u.cache_creation_input_tokens > 0, u
    after = [metric(url, n) for n in names]
    assert [b - a for a, b in zip(before, after)] == [1, prompt, u.cache_read_input_tokens]


def test_more_than_four_breakpoints_is_anthropics_400(url):
    blocks = [
        {"type": "text", "text": f"part {k}", "cache_control": {"type": "ephemeral"}}
        for k in range(5)
    ]
    with pytest.raises(anthropic.BadRequestError) as e:
        client(url).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": blocks}]
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in str(e.value)


@pytest.mark.parametrize(
    "block, field",
    [
        ({"type": "tool_result", "content": "x"}, "messages.0.content.0.tool_use_id"),
        ({"type": "image", "source": {}}, "messages.0.content.0.type"),
        ({"type": "text"}, "messages.0.content.0.text"),
        (
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}},
            "messages.0.content.0.cache_control.ttl",
        ),
    ],
)
def test_a_malformed_block_is_a_400_naming_its_field(url, block, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        client(url).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": [block]}]
        )
    assert e.value.body["error"]["message"].startswith(field + ":"), e.value.body


def test_max_tokens_is_required(url):
    r = httpx.post(
        url + "/v1/messages",
        headers={"x-api-key": KEY},
        json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens:")


def test_x_api_key_is_the_servers_key(url):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(url, key="wrong").messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    assert e.value.body["type"] == "error", "Anthropic's error object"
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, json=[1])
    assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_the_stream_parses_with_the_sdks_helper(url):
    c = client(url)
    marked = {"type": "text", "text": NOTES, "cache_control": {"type": "ephemeral"}}
    whole = c.messages.create(**ask(marked, "mayor"))
    with c.messages.stream(**ask(marked, "mayor")) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text
    u = final.usage
    assert u.cache_read_input_tokens > 0, "the same prompt again"
    total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert total == whole.usage.input_tokens + whole.usage.cache_read_input_tokens + (
        whole.usage.cache_creation_input_tokens
    )


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "cache_control": {"type": "ephemeral"},
}


def test_a_tool_use_round_trip(url):
    c = client(url)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = c.messages.create(
        model="m",
        max_tokens=32,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=messages,
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}],
        },
    ]
    after = c.messages.create(
        model="m", max_tokens=8, extra_body={"temperature": 0}, tools=[WEATHER], messages=messages
    )
    assert after.content and after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    prior = first.usage
    prior_input = (
        prior.input_tokens + prior.cache_read_input_tokens + prior.cache_creation_input_tokens
    )
    assert after.usage.cache_read_input_tokens >= prior_input, after.usage


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{**WEATHER, "description": 1}]}, "tools.0.description"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"system": 3}, "system"),
    ],
)
def test_a_malformed_field_is_a_400_naming_it(url, extra, field):
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(url + "/v1/messages", headers={"x-api-key": KEY}, json={**body, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field + ":"), r.json()
