"""``radixkv serve --api-key`` and the side endpoints (``/tokenize``, ``/detokenize``,
``/version``): the real command on the real model, driven by the ``openai`` client and raw
HTTP."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")

import radixkv  # noqa: E402
import serve_process  # noqa: E402

openai = serve_process.needs_real_server()
from serve_process import free_port  # noqa: E402

KEY = "sk-test-key"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def url(served):
    return served("--num-pages", "512", "--api-key", KEY).url


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_requests_need_the_key(url):
    with pytest.raises(openai.AuthenticationError) as e:
        client(url, "wrong").chat.completions.create(model="smollm2", messages=USER, max_tokens=1)
    assert "API key" in e.value.body["message"]
    assert httpx.get(url + "/v1/models").status_code == 401
    reply = client(url, KEY).chat.completions.create(
        model="smollm2", messages=USER, max_tokens=1, temperature=0
    )
    assert reply.usage.completion_tokens == 1


def test_health_and_metrics_stay_open(url):
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code in (200, 404)  # 404: no prometheus_client


def test_the_schema_and_its_pages_need_the_key(url):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + path, headers=auth).status_code == 200, path
    schema = httpx.get(url + "/openapi.json", headers=auth).json()
    assert "/v1/chat/completions" in schema["paths"]


def test_a_non_ascii_key_is_a_401_never_a_500(url):
    """A header byte past ASCII (a client sending UTF-8, or Latin-1) is a wrong key."""
    for key in ("clé-ключ".encode(), "clé".encode("latin-1"), b"\xff\xfe"):
        r = httpx.get(url + "/v1/models", headers={"Authorization": b"Bearer " + key})
        assert r.status_code == 401, (key, r.status_code, r.text)
        assert "API key" in r.json()["error"]["message"]


def test_a_non_ascii_configured_key_serves_its_holder(tmp_path):
    """--api-key of non-ASCII text: its holder (sending its UTF-8 bytes) is served, anyone
    else gets a 401 (was a 500 for every request)."""
    key = "clé-ключ-🔑"
    port = free_port()
    proc = serve_process.start(port, "--num-pages", "64", "--api-key", key)
    try:
        base = f"http://127.0.0.1:{port}"
        good = {"Authorization": b"Bearer " + key.encode()}
        assert httpx.get(base + "/v1/models", headers=good).status_code == 200
        for other in (b"Bearer wrong", b"Bearer " + key.encode()[:-1], b"Bearer cl\xe9"):
            r = httpx.get(base + "/v1/models", headers={"Authorization": other})
            assert r.status_code == 401, (other, r.status_code, r.text)
        assert httpx.get(base + "/v1/models").status_code == 401
    finally:
        rc, err = serve_process.stop(proc)
        assert rc == 0, err


def test_tokenize_detokenize_version(url):
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(url + "/tokenize", json={"prompt": "Hello"}).status_code == 401
    tok = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}, headers=auth).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 8192
    text = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}, headers=auth).json()
    assert text["prompt"].endswith("Hello world")
    chat = httpx.post(url + "/tokenize", json={"messages": USER}, headers=auth).json()
    reply = client(url, KEY).chat.completions.create(model="smollm2", messages=USER, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    bad = httpx.post(url + "/detokenize", json={"tokens": [-1]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(url + "/version", headers=auth).json() == {"version": radixkv.__version__}


def test_flush_cache_needs_the_key_and_empties_the_cache(url):
    ask = [{"role": "user", "content": "Name a colour."}]
    c = client(url, KEY)
    c.chat.completions.create(model="smollm2", messages=ask, max_tokens=1, temperature=0)
    again = c.chat.completions.create(model="smollm2", messages=ask, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert httpx.post(url + "/flush_cache").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    flushed = httpx.post(url + "/flush_cache", headers=auth)
    assert flushed.status_code == 200 and flushed.json()["flushed_pages"] > 0
    after = c.chat.completions.create(model="smollm2", messages=ask, max_tokens=1, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    # vLLM's name for it drops the pages of the last request
    assert httpx.post(url + "/reset_prefix_cache", headers=auth).json()["flushed_pages"] > 0
