"""The bounds and meanings of ``radixkv serve``'s request fields, probed as a careless client
would: the real command (one process, ``--max-waiting 4``) on the real model, the ``openai``
client and raw HTTP.

- ``--max-waiting`` counts sequences (``n`` x prompts), so a list of prompts cannot bypass it;
  a request that alone asks for more is a 400 naming the bound.
- Sampling values at the edge of their ranges (``temperature: 1e-300``, ``top_p: 5e-324``,
  ``repetition_penalty: 1e-300``) are served or refused with a 400 naming them, never a 500.
- ``logprobs`` are the model's own log-probabilities, whatever the temperature and
  ``logit_bias`` (OpenAI's meaning, vLLM's default).
- A logprob's ``bytes`` are its token's own, so joining them rebuilds the reply's text, a
  character split across tokens included.
"""

from __future__ import annotations

import json
import math

import pytest

httpx = pytest.importorskip("httpx")

import serve_process  # noqa: E402

openai = serve_process.needs_real_server()

MODEL = "smollm2"
MAX_WAITING = 4
USER = [{"role": "user", "content": "Name three colors."}]


class Running:
    def __init__(self, port: int, proc) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def chat(self, messages=USER, **kw):
        kw.setdefault("max_tokens", 1)
        kw.setdefault("temperature", 0)
        return self.client.chat.completions.create(model=MODEL, messages=messages, **kw)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def server(served):
    s = served("--num-pages", "1024", "--max-waiting", str(MAX_WAITING))
    return Running(s.port, s.proc)


def test_a_request_past_max_waiting_alone_is_a_400_naming_the_bound(server):
    many = server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1},
    )
    assert many.status_code == 400, many.text
    err = many.json()["error"]
    assert err["param"] == "prompt" and "6 sequences" in err["message"]
    assert f"--max-waiting {MAX_WAITING}" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(n=MAX_WAITING + 1)
    assert e.value.body["param"] == "n"
    # At the bound exactly: served.
    ok = server.post(
        "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 1}
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_WAITING


def test_sequences_in_flight_count_against_max_waiting(server):
    """Three sequences stream; a request of two more is a 429, one more is served."""
    stream = server.chat(n=3, max_tokens=64, temperature=1.0, seed=1, stream=True)
    chunks = iter(stream)
    next(chunks)  # the three are in flight
    try:
        with pytest.raises(openai.RateLimitError) as e:
            server.chat(n=2)
        assert "3 sequences are in flight" in e.value.body["message"]
        over = server.post(
            "/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1}
        )
        assert over.status_code == 429, over.text
        assert server.chat(n=1).choices[0].message.content is not None
    finally:
        stream.close()


@pytest.mark.parametrize(
    "field",
    [
        {"temperature": 1e-300},
        {"temperature": 5e-324},
        {"top_p": 5e-324, "temperature": 1.0},
        {"top_p": 5e-324, "temperature": 1e-300},
        {"min_p": 0.999999, "temperature": 1.0},
        {"top_k": 2**62, "temperature": 1.0},
        {"repetition_penalty": 0.01, "temperature": 0.01},
        {"repetition_penalty": 1e4, "temperature": 1e-300},
        {"presence_penalty": -2, "frequency_penalty": -2, "temperature": 0.01},
        {"logit_bias": {"0": -100, "1": 100}, "temperature": 1e-300},
    ],
    ids=json.dumps,
)
def test_edge_values_of_sampling_fields_are_served(server, field):
    r = server.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "max_tokens": 3, "seed": 7, "logprobs": True, **field},
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(math.isfinite(e["logprob"]) for e in content)


def test_a_tiny_temperature_samples_as_the_floor(server):
    """Below 0.01 a temperature is raised to 0.01 (vLLM's rule), not an overflow."""
    floor = server.chat(temperature=0.01, seed=3, max_tokens=6).choices[0].message.content
    assert server.chat(temperature=1e-300, seed=3, max_tokens=6).choices[0].message.content == floor


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e5),
        ("temperature", -1e-300),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.0000001),
        ("min_p", 1.0),
        ("presence_penalty", 2.0001),
        ("top_k", -1),
        ("seed", -1),
    ],
)
def test_values_out_of_range_are_a_400_naming_the_field(server, field, value):
    r = server.post(
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "max_tokens": 1, field: value},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_logprobs_are_the_models_own_whatever_the_temperature_and_bias(server):
    """The first reply token's logprob and top logprobs, sampled at temperature 0.5 with a
    ``logit_bias``, equal transformers' ``log_softmax`` of the model's logits at the end of
    the prompt (the same tokens as ``/tokenize`` gives)."""
    import torch

    import radixkv.hf

    model, _ = radixkv.hf.load("smollm2")
    ids = server.post("/tokenize", {"model": MODEL, "messages": USER})
    ids = ids.json()["tokens"]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
    top5 = torch.topk(want, 5)
    bias = {str(int(top5.indices[1])): 3.0}  # favours the second most likely token
    for kw in ({"temperature": 0.5, "logit_bias": bias}, {"temperature": 0}):
        reply = server.chat(max_tokens=1, seed=11, logprobs=True, top_logprobs=5, **kw)
        (entry,) = reply.choices[0].logprobs.content
        got = [t.logprob for t in entry.top_logprobs]
        assert got == pytest.approx(top5.values.tolist(), abs=2e-4), kw
        chosen = bytes(entry.bytes).decode()
        assert entry.logprob == pytest.approx(
            float(want[model_token(ids, chosen, want)]), abs=2e-4
        ), kw


def model_token(ids: list[int], text: str, logp) -> int:
    """The id of the top-20 token whose text is ``text`` (the reply's only token)."""
    from radixkv.hf._load import load

    _, tok = load("smollm2")
    for t in logp.topk(20).indices.tolist():
        if tok.decode([t]) == text:
            return t
    raise AssertionError(f"{text!r} is not among the 20 most likely tokens")


def test_logprob_bytes_join_into_the_text_a_split_character_included(server):
    """A reply forced (by a JSON schema) to hold characters of several bytes that the
    vocabulary splits across tokens: each token's ``bytes`` are its own, so they join into
    the reply's UTF-8 bytes (each split token's text is U+FFFD, whose bytes are not)."""
    word = "東京🙂"
    schema = {"type": "string", "enum": [word]}
    reply = server.chat(
        max_tokens=32,
        logprobs=True,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
    )
    text = reply.choices[0].message.content
    assert json.loads(text) == word
    entries = reply.choices[0].logprobs.content
    assert any(e.token == "\ufffd" for e in entries), "no token splits a character here"
    joined = b"".join(bytes(e.bytes) for e in entries)
    # the stop token that ended it, if the reply reports it, is the last entry and no text
    assert joined in (text.encode(), text.encode() + bytes(entries[-1].bytes)), joined
