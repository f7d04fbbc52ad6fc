"""OpenAI request fields as clients send them to ``radixkv serve``: the real command (one
process for the module) on the real model, driven by the ``openai`` client (raw HTTP where the
client cannot send a body).

- ``top_logprobs`` 0-20 (chat) and ``logprobs`` 0-20 (``/v1/completions``): the most likely
  tokens at each position, streamed or not.
- ``logit_bias``: a bias of 100 forces a token and -100 bans greedy's pick, on both
  endpoints; an id outside the vocabulary or a bias outside [-100, 100] is a 400 naming it.
- ``content`` as a list of parts: text parts joined, any other part type a 400 naming it.
- Fields that change the output are implemented (``continue_final_message``,
  ``chat_template_kwargs``) or a 400 naming them; an unknown ``model`` is a 404.
- ``--max-model-len``: a prompt and ``max_tokens`` past it are a 400 naming both lengths.
- ``max_tokens`` (or ``max_completion_tokens``) 0 is a 400 naming it, as vLLM answers.
- ``/tokenize``: an unknown ``model`` is a 404 as chat answers, its booleans are JSON booleans
  (the string ``"false"`` a 400), and its messages count what chat's prompt holds.
- A malformed ``tool_choice`` (a function given as a string, a list, an object without a
  string ``name``) is a 400 naming it.
"""

from __future__ import annotations

import math

import pytest

httpx = pytest.importorskip("httpx")

import serve_process  # noqa: E402

openai = serve_process.needs_real_server()
from test_tools import TOOLS  # noqa: E402

#: The model name the server answers to.
MODEL = "SmolLM2-135M-Instruct"


class Running:
    """The server process and an openai client for it."""

    def __init__(self, port: int, proc) -> None:
        self.port, self.proc = port, proc
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def chat(self, messages, **kw):
        kw.setdefault("max_tokens", 1)
        kw.setdefault("temperature", 0)
        kw.setdefault("model", MODEL)
        return self.client.chat.completions.create(messages=messages, **kw)

    def post(self, path: str, body: dict, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, **kw)


@pytest.fixture(scope="module")
def server(served):
    args = ["--num-pages", "2048", "--served-model-name", MODEL, "alias-b"]
    args += ["--max-model-len", str(MAX_MODEL_LEN)]
    s = served(*args)
    return Running(s.port, s.proc)


USER = [{"role": "user", "content": "Name a color."}]


def check_top(entries: list, k: int, chosen_logprob: float) -> None:
    """``k`` alternatives, most likely first, the greedy choice among them with its logprob."""
    assert len(entries) == k
    values = [e.logprob for e in entries]
    assert values == sorted(values, reverse=True)
    assert sum(math.exp(v) for v in values) <= 1.0 + 1e-4
    assert entries[0].logprob == pytest.approx(chosen_logprob, abs=1e-5)


def test_chat_top_logprobs(server):
    reply = server.chat(USER, max_tokens=2, logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert len(content) == 2
    for entry in content:
        check_top(entry.top_logprobs, 5, entry.logprob)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely one
    # 20 is OpenAI's bound; 21 a 400 naming the field.
    assert len(server.chat(USER, logprobs=True, top_logprobs=20).choices[0].logprobs.content[0]
               .top_logprobs) == 20  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(USER, logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(USER, top_logprobs=2)  # without logprobs
    assert e.value.body["param"] == "top_logprobs"


def test_chat_top_logprobs_streamed(server):
    stream = server.chat(USER, max_tokens=2, logprobs=True, top_logprobs=3, stream=True)
    entries = [e for c in stream if c.choices and c.choices[0].logprobs for e in
               c.choices[0].logprobs.content]  # fmt: skip
    assert len(entries) == 2
    for entry in entries:
        check_top(entry.top_logprobs, 3, entry.logprob)


def test_completions_logprobs(server):
    reply = server.client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=2, temperature=0, logprobs=4
    )
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 2
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 4 and token in top  # texts of two ids may coincide
        assert max(top.values()) == pytest.approx(value, abs=1e-5)
    zero = server.client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=1, temperature=0, logprobs=0
    )
    assert len(zero.choices[0].logprobs.token_logprobs) == 1


def test_content_as_a_list_of_text_parts(server):
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "color."}]
    joined = [{"role": "user", "content": "Name a\ncolor."}]
    as_parts = server.chat([{"role": "user", "content": parts}], max_tokens=3)
    as_text = server.chat(joined, max_tokens=3)
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    system = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *USER]
    assert server.chat(system).usage.completion_tokens == 1


def test_content_parts_that_are_not_text_are_refused_by_name(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}]
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(messages)
    err = e.value.body
    assert err["param"] == "messages.0.content.1" and "'image_url'" in err["message"]
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("echo", True),
        ("best_of", 2),
        ("functions", [{"name": "f", "parameters": {}}]),
    ],
)
def test_fields_that_change_the_output_are_refused_by_name(server, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(USER, extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]


def one_token(server: Running, text: str) -> int:
    """The id of ``text``, which the tokenizer encodes as one token."""
    body = {"prompt": text, "add_special_tokens": False}
    (tok,) = server.post("/tokenize", body).json()["tokens"]
    return tok


def test_logit_bias_forces_and_bans_tokens(server):
    forced = one_token(server, " purple")
    want = server.post("/detokenize", {"tokens": [forced] * 3}).json()["prompt"]
    for temperature in (0, 1.0):
        reply = server.chat(USER, max_tokens=3, temperature=temperature,
                            logit_bias={str(forced): 100})  # fmt: skip
        assert reply.choices[0].message.content == want
    done = server.client.completions.create(
        model=MODEL, prompt="My favourite fruit is", max_tokens=3, temperature=0,
        logit_bias={str(forced): 100},
    )  # fmt: skip
    assert done.choices[0].text == want
    # -100 on greedy's first pick: another token comes first
    plain = server.chat(USER, max_tokens=1, logprobs=True).choices[0].logprobs.content[0]
    first = one_token(server, plain.token)
    banned = server.chat(USER, max_tokens=1, logprobs=True, logit_bias={str(first): -100})
    assert banned.choices[0].logprobs.content[0].token != plain.token
    assert server.chat(USER, logit_bias={str(first): 0}).choices[0].message.content == (
        plain.token
    )  # a zero bias changes nothing


@pytest.mark.parametrize(
    ("bias", "named"),
    [({"99999999": 5}, "99999999"), ({"-3": 5}, "-3"), ({"7": 150}, "150"), ({"x": 1}, "'x'")],
)
def test_a_bad_logit_bias_is_a_400_naming_it(server, bias, named):
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(USER, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias" and named in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias"


def test_no_op_values_of_refused_fields_are_accepted(server):
    reply = server.chat(USER, logit_bias={}, parallel_tool_calls=False, extra_body={"echo": False})
    assert reply.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, suffix="end")
    assert e.value.body["param"] == "suffix"


def test_continue_final_message(server):
    start = [*USER, {"role": "assistant", "content": "My favourite color is"}]
    body = {"continue_final_message": True, "add_generation_prompt": False}
    reply = server.chat(start, max_tokens=2, extra_body=body)
    answered = server.chat(start, max_tokens=2)
    # Continued: the prompt ends inside the assistant's message (no end-of-turn, no new turn).
    assert reply.usage.prompt_tokens < answered.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(start, extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"


def test_chat_template_kwargs_reach_the_template(server):
    # SmolLM2's template reads no extra keyword: a harmless one renders the same prompt.
    plain = server.chat(USER)
    kw = server.chat(USER, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kw.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(USER, extra_body={"chat_template_kwargs": {"tools": []}})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_an_unknown_model_is_a_404_and_the_served_names_work(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.chat(USER, model="gpt-4o")
    assert e.value.body["param"] == "model" and "gpt-4o" in e.value.body["message"]
    for name in (MODEL, "smollm2", "alias-b"):  # --served-model-name NAMES..., --model's value
        assert server.chat(USER, model=name).model == MODEL
    assert [m.id for m in server.client.models.list()] == [MODEL, "alias-b", "smollm2"]


#: The server's --max-model-len.
MAX_MODEL_LEN = 64


def test_a_request_past_max_model_len_is_a_400_naming_both_lengths(server):
    long = [{"role": "user", "content": "color " * 80}]
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(long)
    err = e.value.body
    assert (
        err["param"] == "messages"
        and f"maximum context length is {MAX_MODEL_LEN}" in (err["message"])
    )
    prompt = int(err["message"].split("(")[2].split(" ")[0])  # "(N in the messages, ..."
    assert prompt > MAX_MODEL_LEN and f"{prompt} in the messages" in err["message"]
    # The prompt fits; with max_tokens it does not.
    short = server.chat(USER)
    room = MAX_MODEL_LEN - short.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(USER, max_tokens=room + 1)
    assert (
        f"{short.usage.prompt_tokens} in the messages, {room + 1} in the completion"
        in (e.value.body["message"])
    )
    assert server.chat(USER, max_tokens=room).usage.prompt_tokens == short.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="color " * 80, max_tokens=1)
    assert e.value.body["param"] == "prompt"


def test_completions_take_a_list_of_prompts_one_choice_each_in_order(server):
    texts = ["The capital of France is", "One, two, three,"]
    single = [
        server.client.completions.create(model=MODEL, prompt=t, max_tokens=3, temperature=0)
        for t in texts
    ]
    both = server.client.completions.create(model=MODEL, prompt=texts, max_tokens=3, temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [r.choices[0].text for r in single]
    assert both.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in single)
    ids = server.post("/tokenize", {"prompt": texts[1]}).json()["tokens"]
    mixed = server.client.completions.create(
        model=MODEL, prompt=[ids, ids], max_tokens=1, temperature=0, n=2
    )
    assert [c.index for c in mixed.choices] == [0, 1, 2, 3]  # prompt by prompt, n of each
    assert len({c.text for c in mixed.choices}) == 1
    empty = server.post("/v1/completions", {"model": MODEL, "prompt": ["a", ""]})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt.1"


def test_metrics_carry_the_model_name_inter_token_latency_and_queue_time(server):
    server.chat([{"role": "user", "content": "Count to three."}], max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    count = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.endswith(tuple("0123456789.")) and "_count{" in line
    }
    assert count["radixkv_inter_token_latency_seconds_count"] >= 2
    assert count["radixkv_request_queue_time_seconds_count"] >= 1
    assert f'radixkv_request_queue_time_seconds_count{{model_name="{MODEL}"}}' in text


@pytest.mark.parametrize(
    "function",
    ["get_weather", ["get_weather"], {}, {"name": ["get_weather"]}, {"name": {"n": 1}}, None],
)
def test_a_malformed_tool_choice_is_a_400_naming_it(server, function):
    choice = {"type": "function", "function": function}
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(USER, tools=TOOLS, tool_choice=choice)
    assert e.value.body["param"] == "tool_choice"
    assert "tool_choice" in e.value.body["message"]


def test_zero_max_tokens_is_a_400_naming_it(server):
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            server.chat(USER, **{field: 0})
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    assert server.chat(USER, max_completion_tokens=1).usage.completion_tokens == 1


def test_tokenize_knows_its_models_and_booleans_and_counts_chats_prompt(server):
    r = server.post("/tokenize", {"model": "gpt-4o", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert server.post("/tokenize", {"model": "alias-b", "prompt": "Hi"}).status_code == 200
    for field in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
        r = server.post("/tokenize", {"messages": USER, field: "false"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = server.post("/tokenize", {"prompt": "Hi", "add_special_tokens": "false"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"
    # the fields chat takes render the prompt chat serves
    start = [*USER, {"role": "assistant", "content": "My favourite color is"}]
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    for messages, body in ((USER, {}), (USER, {"add_generation_prompt": False}), (start, cont)):
        count = server.post("/tokenize", {"messages": messages, **body}).json()["count"]
        assert count == server.chat(messages, extra_body=body).usage.prompt_tokens
    answered = server.post("/tokenize", {"messages": USER}).json()["count"]
    assert server.post("/tokenize", {"messages": USER, **cont}).json()["count"] < answered
