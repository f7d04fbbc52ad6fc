"""`radixkv serve` as a process: SIGTERM drains the requests in flight, then the server exits 0.

The real command on the real model (SmolLM2-135M-Instruct), driven with the official ``openai``
client. Skips with a reason where the model package cannot be installed; ``make test`` installs it.
"""

from __future__ import annotations

import signal
import threading

import serve_process

openai = serve_process.needs_real_server()
from serve_process import free_port  # noqa: E402


def test_sigterm_drains_the_streams_in_flight_then_exits_0():
    port = free_port()
    proc = serve_process.start(port, "--num-pages", "4096")
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0
        )
        first = threading.Event()
        got: dict = {"text": [], "finish": None, "error": None, "tokens": None}

        def stream() -> None:
            try:
                chunks = client.completions.create(
                    model="smollm2",
                    prompt="Count from one to fifty in words: one, two, three,",
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in chunks:
                    if chunk.usage is not None:
                        got["tokens"] = chunk.usage.completion_tokens
                    for c in chunk.choices:
                        got["text"].append(c.text)
                        got["finish"] = c.finish_reason or got["finish"]
                    first.set()
            except Exception as e:  # reported by the assertions below
                got["error"] = e
                first.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(120), "no token came back"
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert not t.is_alive(), "the stream never ended"
        assert got["error"] is None, f"the stream in flight was cut by SIGTERM: {got['error']!r}"
        assert got["finish"] in ("length", "stop"), got
        assert "".join(got["text"]), "no text came back"
        if got["finish"] == "length":  # every token the request asked for was served
            assert got["tokens"] == 16, got
        rc = proc.wait(60)
        err = proc.stderr.read()
        assert rc == 0, f"radixkv serve exited {rc} after SIGTERM: {err}"
        assert "Traceback" not in err, err
        assert "drained" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
