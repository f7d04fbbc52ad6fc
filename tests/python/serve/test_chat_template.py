"""``radixkv serve --chat-template``: a file (or inline Jinja, as vLLM takes it) replaces the
model's chat template in every render: the real command on the real model, whose own template
ignores tools, given a Hermes-style one that renders them."""

from __future__ import annotations

from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

import serve_process  # noqa: E402

openai = serve_process.needs_real_server()
from radixkv.apps.serve.cmd import chat_template_of  # noqa: E402
from test_tools import ASK, TOOLS  # noqa: E402

TEMPLATE = Path(__file__).parents[1] / "support" / "templates" / "hermes_tools.jinja"


@pytest.fixture(scope="module")
def server(served):
    s = served("--num-pages", "512", "--chat-template", str(TEMPLATE))
    return s.url, s.proc


def test_the_given_template_renders_every_prompt(server):
    url, proc = server
    lines = []
    while not lines or "on http://" not in lines[-1]:
        lines.append(proc.stderr.readline())
    assert not any("does not render tools" in line for line in lines)  # the given one does
    tok = httpx.post(url + "/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    text = httpx.post(url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system\nYou may call") and "get_weather" in text
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=2, temperature=0
    )
    assert r.usage.prompt_tokens == tok["count"]
    assert "warnings" not in (r.model_extra or {})


def test_inline_jinja_is_the_template_and_a_path_is_read():
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chat_template_of(inline) == inline
    assert chat_template_of(str(TEMPLATE)) == TEMPLATE.read_text()
    assert chat_template_of(None) is None
