"""``radixkv serve --speculative-config``: the real command on the real model, driven by the
``openai`` client. A turn sent twice (a client's retry) gets the same greedy text both times,
the retry drafted from the reply the cache holds (``"suffix"``), and ``/metrics`` counts the
drafts with vLLM's meanings. (That greedy text with speculation is plain decoding's is
``test_speculative``'s, on the library.)"""

from __future__ import annotations

import re

import pytest

httpx = pytest.importorskip("httpx")

import serve_process  # noqa: E402

openai = serve_process.needs_real_server()

from serve_process import free_port  # noqa: E402

TOKENS = 20
ASK = [{"role": "user", "content": "Explain in two sentences what a prefix cache does."}]
CONFIG = '{"method": "suffix", "num_speculative_tokens": 6}'


def counters(url: str) -> dict[str, float]:
    """The speculative decoding counters of ``/metrics``, by name (per position summed)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"(radixkv_spec_decode_\w+_total)(\{[^}]*\})? (\S+)", line)
        if m:
            out[m[1]] = out.get(m[1], 0.0) + float(m[3])
    return out


def test_a_retried_turn_is_drafted_from_the_cache():
    port = free_port()
    proc = serve_process.start(port, "--num-pages", "512", "--speculative-config", CONFIG)
    try:
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        texts, seen = [], []
        for _ in range(2):
            r = client.chat.completions.create(
                model="smollm2", messages=ASK, max_tokens=TOKENS, temperature=0
            )
            texts.append(r.choices[0].message.content)
            seen.append(counters(url))
    finally:
        rc, err = serve_process.stop(proc)
    assert rc == 0, err
    assert texts[0] and texts[1] == texts[0]
    accepted = "radixkv_spec_decode_num_accepted_tokens_total"
    drafted = "radixkv_spec_decode_num_draft_tokens_total"
    retry = {k: seen[1][k] - seen[0].get(k, 0.0) for k in seen[1]}
    # The retry's reply is cached (but its last page): most of it is accepted from drafts.
    assert retry[accepted] >= TOKENS // 2, retry
    assert seen[1][drafted] >= seen[1][accepted] > 0
    assert seen[1]["radixkv_spec_decode_num_accepted_tokens_per_pos_total"] == seen[1][accepted]
