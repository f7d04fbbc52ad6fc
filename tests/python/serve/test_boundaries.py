"""`radixkv serve` at its boundaries, probed from outside as a client would: the real command
(one process for the module) on the real model, driven by the ``openai`` client, and by raw
HTTP for bodies that client cannot send (a lone surrogate, ``Infinity``, bytes that are not
UTF-8).

- Tenants: with ``--tenant-header``, a ``cache_salt`` subdivides a tenant's namespace and never
  reaches another tenant's pages (no shared KV, no ``cached_tokens`` side channel).
- Sampling: a request without a seed samples with a fresh one; a seed stays reproducible.
- ``keep_alive``: bounded by ``--max-keep-alive`` (per tenant when one is named); ``Infinity``
  and ``1e308`` are 400s.
- Bad input (a lone surrogate, a schema the grammar library cannot use, a body that is not
  UTF-8) is a 400 with OpenAI's error object, streamed or not, and the server goes on serving.
- Streamed ``logprobs`` carry each token's log-probability, as the non-streamed reply does.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

httpx = pytest.importorskip("httpx")

import serve_process  # noqa: E402

openai = serve_process.needs_real_server()
from serve_process import free_port  # noqa: E402

#: The bound every request gets, and the tenant given a longer one.
MAX_KEEP_ALIVE = 60
LONG_TENANT, LONG_KEEP_ALIVE = "tenant-long", 3600


class Running:
    """The server process and clients for it."""

    def __init__(self, port: int, proc) -> None:
        self.port, self.proc = port, proc
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def chat(self, content: str, tenant: str | None = None, **kw):
        kw.setdefault("max_tokens", 1)
        kw.setdefault("temperature", 0)
        headers = {"X-Tenant": tenant} if tenant is not None else None
        return self.client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": content}],
            extra_headers=headers,
            **kw,
        )

    def post(self, path: str, content: bytes) -> httpx.Response:
        """A raw POST of ``content`` as JSON (bodies the openai client refuses to send)."""
        headers = {"content-type": "application/json"}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60)

    def still_serving(self) -> None:
        assert self.chat("ok?").choices[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def server(served):
    args = [
        "--num-pages",
        "4096",
        "--tenant-header",
        "X-Tenant",
        "--max-keep-alive",
        str(MAX_KEEP_ALIVE),
        "--max-keep-alive",
        f"{LONG_TENANT}={LONG_KEEP_ALIVE}",
    ]
    s = served(*args)
    return Running(s.port, s.proc)


def cached(r) -> int:
    details = r.usage.prompt_tokens_details
    return (details.cached_tokens if details is not None else 0) or 0


def openai_error(r: httpx.Response, param: str | None) -> dict:
    """The error object of a 400 ``r``, checked to be OpenAI's and to name ``param``."""
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- tenants ------------------------------------------------------------------------------


def test_a_cache_salt_never_reaches_another_tenants_pages(server):
    secret = "Tenant b's private notes: the launch code is 48213, the vault is on floor 9."
    b = server.chat(secret, tenant="tenant-b")
    assert cached(server.chat(secret, tenant="tenant-b")) > 0, "tenant b's own turn is cached"
    # Tenant a names b's tenant as its salt: its namespace stays its own.
    a = server.chat(secret, tenant="tenant-a", extra_body={"cache_salt": "tenant-b"})
    assert cached(a) == 0, "a salt took tenant a into tenant b's cache"
    # No header, b's name as the salt: not b's namespace either.
    assert cached(server.chat(secret, extra_body={"cache_salt": "tenant-b"})) == 0
    # A salt subdivides b's own namespace.
    salted = server.chat(secret, tenant="tenant-b", extra_body={"cache_salt": "s1"})
    assert cached(salted) == 0
    again = server.chat(secret, tenant="tenant-b", extra_body={"cache_salt": "s1"})
    assert cached(again) > 0
    assert a.choices[0].message.content == b.choices[0].message.content


# ---- sampling -----------------------------------------------------------------------------


def test_unseeded_samples_differ_and_a_seed_repeats(server):
    async def sample(n: int, **kw) -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        async def one() -> str:
            r = await client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "Invent a name for a pet."}],
                max_tokens=6,
                temperature=1.0,
                **kw,
            )
            return r.choices[0].message.content

        return list(await asyncio.gather(*(one() for _ in range(n))))

    unseeded = asyncio.run(sample(4))
    assert len(set(unseeded)) > 1, f"four unseeded samples are the same: {unseeded}"
    seeded = asyncio.run(sample(2, seed=1234))
    assert seeded[0] == seeded[1], seeded


# ---- keep_alive ---------------------------------------------------------------------------


def body(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 1, **kw}


@pytest.mark.parametrize("value", ["Infinity", "1e308", str(MAX_KEEP_ALIVE + 1)])
def test_keep_alive_past_the_servers_bound_is_a_400(server, value):
    text = json.dumps(body()).replace('"max_tokens"', f'"keep_alive": {value}, "max_tokens"')
    err = openai_error(server.post("/v1/chat/completions", text.encode()), "keep_alive")
    assert "keep_alive" in err["message"]
    if math.isfinite(float(value)):
        assert str(MAX_KEEP_ALIVE) in err["message"] and "--max-keep-alive" in err["message"]
    server.still_serving()


@pytest.mark.parametrize(
    "value,says",
    [
        ("inf", "seconds must be finite and >= 0, got 'inf'"),
        ("-1", "seconds must be finite and >= 0, got '-1'"),
        ("=5", "must be SECONDS or TENANT=SECONDS, got '=5'"),
        ("soon", "must be SECONDS or TENANT=SECONDS (a number >= 0), got 'soon'"),
        ("team=5", "--max-keep-alive team=5 names a tenant: it needs --tenant-header"),
    ],
)
def test_a_bad_max_keep_alive_is_a_usage_error(value, says):
    rc, err = serve_process.exit_of(free_port(), "--max-keep-alive", value)
    assert rc == 2 and says in err and "Traceback" not in err, err


def test_keep_alive_is_bounded_per_tenant(server):
    with pytest.raises(openai.BadRequestError, match="keep_alive"):
        server.chat("Hi.", tenant="tenant-a", extra_body={"keep_alive": LONG_KEEP_ALIVE})
    ok = server.chat("Hi.", tenant=LONG_TENANT, extra_body={"keep_alive": LONG_KEEP_ALIVE})
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert server.chat("Hi.", extra_body={"keep_alive": MAX_KEEP_ALIVE}).choices


# ---- bad input ----------------------------------------------------------------------------

SURROGATE = b'"\\ud800 hello"'  # JSON text of a lone surrogate, as a client may send it

BAD_BODIES = [
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": ' + SURROGATE + b'}], "max_tokens": 1}',
        "messages.0.content",
    ),
    ("/v1/completions", b'{"prompt": ' + SURROGATE + b', "max_tokens": 1}', "prompt"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "Hi."}], "stop": [' + SURROGATE + b"]}",
        "stop.0",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "caf\xe9"}], "max_tokens": 1}',
        None,
    ),
]


@pytest.mark.parametrize("path,content,param", BAD_BODIES)
def test_text_that_is_not_unicode_is_a_400_and_the_server_goes_on(server, path, content, param):
    openai_error(server.post(path, content), param)
    server.still_serving()


SELF_REF = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_grammar_library_cannot_use_is_a_400(server, stream):
    with pytest.raises(openai.BadRequestError) as e:
        server.chat("Give me JSON.", response_format=SELF_REF, stream=stream, max_tokens=4)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "response_format", err
    assert err["type"] == "invalid_request_error" and "schema" in err["message"], err
    server.still_serving()


# ---- streamed logprobs --------------------------------------------------------------------


def test_streamed_logprobs_equal_the_non_streamed_ones(server):
    kw = dict(max_tokens=4, logprobs=True)
    whole = server.chat("Name a color.", **kw)
    want = [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
    got, text = [], ""
    for chunk in server.chat("Name a color.", stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.delta.content:
                assert c.logprobs is not None, chunk
            if c.logprobs is not None:
                got += [(t.token, t.logprob) for t in c.logprobs.content]
    assert text == whole.choices[0].message.content
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)

    plain = server.client.completions.create(
        model="smollm2", prompt="Red, green and", max_tokens=3, temperature=0, logprobs=0
    )
    streamed = []
    for chunk in server.client.completions.create(
        model="smollm2",
        prompt="Red, green and",
        max_tokens=3,
        temperature=0,
        logprobs=0,
        stream=True,
    ):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.token_logprobs
    assert streamed == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert len(streamed) == plain.usage.completion_tokens
