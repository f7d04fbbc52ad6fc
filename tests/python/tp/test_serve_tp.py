"""``radixkv serve --tensor-parallel-size 3``: the real model's 9 heads (3 KV heads) sharded over
three CPU processes by transformers' plan, the engines in lockstep, driven through the real
command and the ``openai`` client. Replies equal one process's greedy tokens over the same
prompt tokens, prefixes are reused, ``/flush_cache``, structured output and speculative decoding
(drafts verified on every rank, stop strings met inside them) keep the ranks in step, a rank
killed or stopped (SIGSTOP, under ``--rank-timeout``) stops the server with status 1 naming it,
the requests it ends getting OpenAI's error object (in their stream too), and SIGTERM to the
whole process group (what a service manager sends) drains, closes every rank and exits 0.
Options it cannot run with, and sizes the heads do not divide by, are one-line errors before any
rank starts."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")

import budget  # noqa: E402
import serve_process  # noqa: E402

openai = serve_process.needs_real_server()
import torch  # noqa: E402

from serve_process import free_port  # noqa: E402

if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="three CPU ranks (a CUDA machine would need 3 devices)"
)

WORLD = "3"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
MODEL = "SmolLM2-135M-Instruct"
OPTIONS = ["--tensor-parallel-size", WORLD, "--num-pages", "256", "--page-size", "16"]

#: A fault test that only ``make test-long`` runs: each starts a 3-rank server of its own (15-20 s
#: on two cores), and ``make test`` keeps a case of the same path (named in its docstring).
long_fault = pytest.mark.skipif(not budget.LONG, reason="a long fault test: make test-long")


@pytest.fixture(scope="module")
def server():
    """One 3-rank server for the module (its own process group); the last test stops it."""
    port = free_port()
    proc = serve_process.start(port, *OPTIONS, threads=3, timeout=300, new_session=True)
    yield proc, port
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def chat(port: int, messages: list[dict], max_tokens: int = 10) -> tuple[str, int]:
    r = client(port).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def prompt_tokens(port: int, messages: list[dict]) -> list[int]:
    body = {"model": MODEL, "messages": messages}
    return httpx.post(f"http://127.0.0.1:{port}/tokenize", json=body, timeout=30).json()["tokens"]


@pytest.fixture(scope="module")
def one_process():
    """Greedy text of the unsharded model in this process: ``text(tokens, n)``."""
    import radixkv
    import radixkv.hf

    model, tokenizer = radixkv.hf.load("smollm2")
    eng = radixkv.hf.engine(model, radixkv.RadixCache(256, page_size=16), tokenizer=tokenizer)

    def text(tokens: list[int], n: int, grammar=None) -> str:
        i = eng.submit(tokens, max_new_tokens=n, grammar=grammar)
        return eng.run([i], release=True)[0].text

    return text


def test_three_ranks_reply_as_one_process_and_reuse_the_prefix(server, one_process):
    proc, port = server
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name the capital of France in one word."},
    ]
    reply, cached = chat(port, first)
    assert reply == one_process(prompt_tokens(port, first), 10)
    assert "Paris" in reply
    assert cached == 0
    second = [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And of Italy?"},
    ]
    reply2, cached2 = chat(port, second)
    assert reply2 == one_process(prompt_tokens(port, second), 10)
    assert cached2 >= 16, "the second turn reuses the first one's pages on every rank"
    assert proc.poll() is None


def test_flush_cache_keeps_the_ranks_in_step(server, one_process):
    proc, port = server
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
    reply, _ = chat(port, messages, max_tokens=6)
    _, cached = chat(port, messages, max_tokens=6)
    assert cached > 0
    flushed = httpx.post(f"http://127.0.0.1:{port}/flush_cache", timeout=30).json()
    assert flushed["flushed_pages"] > 0
    # Rank 0 dropped its pages; had the others kept theirs, the next step's state check fails
    # and the server stops (every step checks the batch; the digest every few steps).
    again, cached = chat(port, messages, max_tokens=6)
    assert (again, cached) == (reply, 0)
    for _ in range(3):
        assert chat(port, messages, max_tokens=6)[0] == reply
    assert reply == one_process(prompt_tokens(port, messages), 6)
    assert proc.poll() is None


def test_structured_output_on_every_rank(server, one_process):
    """A JSON schema and a required tool: every rank compiles the grammar and masks its
    logits as rank 0 does (the token check would part them otherwise); the reply is valid and
    equals one process's under the same grammar."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance", reason="grammars need radixkv[grammar]")
    from radixkv.engine.grammar import Grammar

    proc, port = server
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Which city is the capital of France? Answer in JSON."},
    ]
    r = client(port).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    reply = r.choices[0].message.content
    jsonschema.validate(json.loads(reply), schema)
    assert reply == one_process(prompt_tokens(port, messages), 24, Grammar.json_schema(schema))
    tool = {
        "type": "function",
        "function": {"name": "lookup", "parameters": schema},
    }
    r = client(port).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, tools=[tool], tool_choice="required"
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "lookup"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert proc.poll() is None


def test_idle_server_keeps_its_ranks(server):
    """Idle for longer than the heartbeat (rank 0 then steps an empty step, which the other
    ranks wait for in a collective): the ranks are still there and in step."""
    from radixkv.apps.serve.app import HEARTBEAT_S

    proc, port = server
    ranks = serve_process.children(proc.pid)
    assert len(ranks) == int(WORLD) - 1
    time.sleep(2 * HEARTBEAT_S + 1)
    assert serve_process.children(proc.pid) == ranks
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name the capital of France in one word."},
    ]
    assert "Paris" in chat(port, messages)[0]


def test_sigterm_to_the_process_group_drains_and_closes_every_rank(server):
    """Last in the module: stops the module's server as a service manager would, SIGTERM to
    every process of its group at once, with a request in flight."""
    proc, port = server
    ranks = serve_process.children(proc.pid)
    assert len(ranks) == int(WORLD) - 1
    c = client(port)
    stream = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about a cat."}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    first = next(iter(stream))  # the request is in flight
    os.killpg(proc.pid, signal.SIGTERM)
    pieces = [first.choices[0].delta.content or ""]
    pieces += [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len("".join(pieces)) > 0
    rc = proc.wait(120)
    err = proc.stderr.read()
    assert rc == 0, err[-3000:]
    assert "the 2 other ranks closed" in err
    assert _ranks_started_by(proc.pid) == [], f"rank processes of {ranks} are left"


#: ``--speculative-config`` of the speculating server: drafts from the cache and the prompt.
SPEC_CONFIG = '{"method": "suffix", "num_speculative_tokens": 4}'
SPEC_TOKENS = 16


def spec_counters(port: int) -> dict[str, float]:
    """The speculative decoding counters of ``/metrics``, by name (per position summed)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        m = re.match(r"(radixkv_spec_decode_\w+_total)(\{[^}]*\})? (\S+)", line)
        if m:
            out[m[1]] = out.get(m[1], 0.0) + float(m[3])
    return out


def stop_at(pieces: list[str], p: int) -> tuple[str, str]:
    """A stop string whose first match in the reply made of ``pieces`` (its tokens' texts)
    ends with token ``p``, and the text a request stopped by it returns."""
    text = "".join(pieces)
    for j in range(p, -1, -1):
        start = len("".join(pieces[:j]))
        stop = "".join(pieces[j : p + 1])
        if stop.strip() and text.find(stop) == start:
            return stop, text[:start]
    raise AssertionError(f"no stop string ends at token {p} of {pieces}")


def test_speculating_ranks_reply_as_plain_decoding_and_stop_inside_their_drafts(one_process):
    """``--speculative-config`` on 3 ranks: rank 0 drafts, every rank verifies, and each keeps
    as many tokens as rank 0 kept. Greedy text equals one unsharded process's plain decoding; a
    retried turn is drafted from the reply the cache holds (``/metrics`` counts the accepted
    drafts); a stop string (which only rank 0's tokenizer sees) ending at token ``p``, then one
    ending at ``p + 1``, cut the retry inside a verified draft at least once (a draft keeps up
    to 5 tokens: ``p`` and ``p + 1`` cannot both end one), and the ranks stay in step: the
    server answers again and closes every rank at SIGTERM."""
    port = free_port()
    proc = serve_process.start(
        port,
        *OPTIONS,
        "--speculative-config",
        SPEC_CONFIG,
        threads=3,
        timeout=300,
        new_session=True,
    )
    try:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Explain in two sentences what a prefix cache does."},
        ]

        def ask(**kw):
            r = client(port).chat.completions.create(
                model=MODEL, messages=messages, max_tokens=SPEC_TOKENS, temperature=0, **kw
            )
            return r.choices[0]

        first = ask(logprobs=True)
        reply = first.message.content
        assert reply == one_process(prompt_tokens(port, messages), SPEC_TOKENS)
        before = spec_counters(port)
        assert ask().message.content == reply
        seen = spec_counters(port)
        accepted = "radixkv_spec_decode_num_accepted_tokens_total"
        retry = {k: seen[k] - before.get(k, 0.0) for k in seen}
        assert retry[accepted] > 0, retry
        assert seen["radixkv_spec_decode_num_draft_tokens_total"] >= seen[accepted]
        pieces = [t.token for t in first.logprobs.content]
        assert "".join(pieces) == reply
        for p in (SPEC_TOKENS * 2 // 3, SPEC_TOKENS * 2 // 3 + 1):
            stop, cut = stop_at(pieces, p)
            stopped = ask(stop=[stop])
            assert (stopped.message.content, stopped.finish_reason) == (cut, "stop"), p
        assert ask().message.content == reply
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(120)
        err = proc.stderr.read()
        assert rc == 0, err[-3000:]
        assert "the 2 other ranks closed" in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@long_fault
def test_a_rank_that_dies_stops_the_server_naming_it():
    """A rank SIGKILLed while the server is idle. (``make test``: a rank killed with a request in
    flight, test_a_rank_lost_outside_the_forward_pass_ends_the_stream_with_an_error.)"""
    port = free_port()
    proc = serve_process.start(port, *OPTIONS, threads=3, timeout=300, new_session=True)
    try:
        ranks = serve_process.children(proc.pid)
        assert len(ranks) == int(WORLD) - 1
        assert sorted(_ranks_started_by(proc.pid)) == sorted(ranks)
        os.kill(ranks[-1], signal.SIGKILL)
        rc = proc.wait(60)
        err = proc.stderr.read()
        assert rc == 1, err[-3000:]
        assert "exited (status -9); the server stops" in err
        time.sleep(0.5)
        assert _ranks_started_by(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _rank_of(pid: int) -> int:
    """The rank of the rank process ``pid`` (``RANK`` in its environment)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    raise AssertionError(f"process {pid} has no RANK in its environment")


def _server_stops(err: str) -> list[str]:
    """Rank 0's lines saying why the server stops."""
    return [ln for ln in err.splitlines() if ln.startswith("radixkv serve: ") and "stops" in ln]


def _stream(port: int, max_tokens: int):
    """A streamed chat request, its first chunk read (the request is in the engine)."""
    stream = client(port).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a long story about a cat."}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    chunks = iter(stream)
    next(chunks)
    return chunks


def test_a_rank_lost_outside_the_forward_pass_ends_the_stream_with_an_error():
    """A rank lost while rank 0 waits for it in the step's own collectives (the broadcast of
    its calls, the step check, the token check), not in the forward pass: the requests in
    flight failed without a final event, and a stream ended with a plain ``[DONE]`` as if
    complete (4 kills of 11 by hand). Made so every time: rank 2 is stopped while the server
    is idle (it waits for rank 0's next step), a stream is sent (rank 0's step then waits for
    rank 2 in the step check, before any forward pass), and rank 2 is killed. The stream ends
    with OpenAI's error object, and the one line saying why the server stops names rank 2."""
    port = free_port()
    proc = serve_process.start(port, *OPTIONS, threads=3, timeout=300, new_session=True)
    try:
        ranks = {_rank_of(pid): pid for pid in serve_process.children(proc.pid)}
        assert sorted(ranks) == [1, 2]
        assert sorted(_ranks_started_by(proc.pid)) == sorted(ranks.values())
        os.kill(ranks[2], signal.SIGSTOP)
        try:
            chunks = _stream(port, 64)
        except openai.InternalServerError as e:  # rank 0 was in an idle step as rank 2 stopped
            chunks, refused = iter(()), e
        else:
            refused = None
        os.kill(ranks[2], signal.SIGKILL)
        if refused is None:
            with pytest.raises(openai.APIError, match="the request failed") as raised:
                for _ in chunks:
                    pass
            assert "PeerLostError" in str(raised.value), raised.value
        rc = proc.wait(60)
        err = proc.stderr.read()
        assert rc == 1, err[-3000:]
        stops = _server_stops(err)
        assert len(stops) == 1 and stops[0].startswith("radixkv serve: rank 2 exited (status -9)")
        time.sleep(0.5)
        assert _ranks_started_by(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@long_fault
def test_a_server_whose_stderr_has_no_reader_still_stops_when_it_loses_a_rank():
    """Its parent gone (stderr a pipe nobody reads): the line saying why it stops fails to
    print (EPIPE), which ended the engine thread before the server was told to stop, and it ran
    on with its engine dead. It exits 1, and leaves no rank behind. (``make test``: a lost rank
    with stderr read, test_a_rank_lost_outside_the_forward_pass_ends_the_stream_with_an_error.)"""
    port = free_port()
    proc = serve_process.start(port, *OPTIONS, threads=3, timeout=300, new_session=True)
    try:
        ranks = {_rank_of(pid): pid for pid in serve_process.children(proc.pid)}
        proc.stderr.close()
        os.kill(ranks[1], signal.SIGKILL)
        assert proc.wait(60) == 1
        time.sleep(0.5)
        assert _ranks_started_by(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


#: ``--rank-timeout`` of the stopped-rank test: seconds a collective may wait.
RANK_TIMEOUT_S = 8


def test_a_stopped_rank_stops_the_server_naming_it():
    """A rank SIGSTOPped (it does not exit: the heartbeat never sees it) while a stream is in
    flight froze the server: the stream stalled, new requests hung and ``/health`` answered 200
    for as long as it lasted. With ``--rank-timeout``: ``/health`` answers 503 once the step
    is overdue, the stream ends with an error object, a request sent meanwhile gets a 500, and
    the server exits 1 within the bound, naming the stopped rank, no rank left behind."""
    port = free_port()
    proc = serve_process.start(
        port,
        *OPTIONS,
        "--rank-timeout",
        str(RANK_TIMEOUT_S),
        threads=3,
        timeout=300,
        new_session=True,
    )
    try:
        ranks = {_rank_of(pid): pid for pid in serve_process.children(proc.pid)}
        chunks = _stream(port, 200)
        os.kill(ranks[1], signal.SIGSTOP)
        meanwhile = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60
        )
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            later = pool.submit(
                meanwhile.chat.completions.create,
                model=MODEL,
                messages=[{"role": "user", "content": "Say hi."}],
                max_tokens=4,
            )
            health = []
            deadline = time.monotonic() + 6 * RANK_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                    health.append((r.status_code, r.json()))
                time.sleep(0.1)
            assert proc.poll() == 1, f"still running {6 * RANK_TIMEOUT_S} s after the stop"
            with pytest.raises(openai.InternalServerError, match="the engine failed"):
                later.result(30)
        err = proc.stderr.read()
        overdue = [body for status, body in health if status == 503]
        assert overdue and "overdue" in overdue[0]["error"]["message"], health[-5:]
        with pytest.raises(openai.APIError, match="the request failed"):
            for _ in chunks:
                pass
        stops = _server_stops(err)
        assert len(stops) == 1, err[-3000:]
        assert stops[0].startswith("radixkv serve: rank 1 stopped answering"), stops
        time.sleep(0.5)
        assert _ranks_started_by(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a rank left stopped, when the test failed


@pytest.mark.parametrize("when", ["loading", pytest.param("serving", marks=long_fault)])
def test_ranks_die_with_a_rank_0_that_is_killed(when):
    """Rank 0 SIGKILLed (no drain, no close), while the ranks load the model or while it
    serves: the other ranks exit within seconds. Serving, their collectives fail as rank 0's
    sockets close; loading, nothing of rank 0's is open to them yet (they would wait for its
    rendezvous for the group's timeout, two hours): PR_SET_PDEATHSIG kills them. (``make test``
    runs the loading case: PR_SET_PDEATHSIG covers the serving ranks too.)"""
    port = free_port()
    if when == "serving":
        proc = serve_process.start(port, *OPTIONS, threads=3, timeout=300, new_session=True)
    else:
        proc = serve_process.spawn(port, *OPTIONS, threads=3, new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(ranks := _ranks_started_by(proc.pid)) < int(WORLD) - 1:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 10
        while _ranks_started_by(proc.pid):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived rank 0 ({when})"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tensor-parallel-size", "2"],
            "has 9 attention heads and 3 KV heads, which do not divide among 2 ranks "
            "(sizes that do: 1, 3)",
        ),
        (["-tp", "3", "--cache-dir", "DIR"], "with --cache-dir is not supported in this version"),
        (
            ["--tp", "3", "--shared-store", "redis://127.0.0.1:1"],
            "with --shared-store is not supported in this version",
        ),
        (["--tp-size", "3", "--device", "cuda"], "the ranks run on the CPU (no CUDA device here)"),
        (["-tp", "3", "--rank-timeout", "0.5"], "--rank-timeout 0.5 is too short: at least 1 s"),
    ],
)
def test_what_tensor_parallel_cannot_run_with_is_said_before_any_rank_starts(
    tmp_path, extra, message
):
    extra = [str(tmp_path) if a == "DIR" else a for a in extra]
    t = time.monotonic()
    rc, err = serve_process.exit_of(free_port(), *extra, threads=1)
    assert rc == 2, err[-2000:]
    assert message in err
    assert "Traceback" not in err
    assert time.monotonic() - t < 60


def test_a_usage_error_found_after_loading_is_status_2_on_every_rank(tmp_path):
    """``--window-pages`` needs the model's spec (loaded on every rank): each rank refuses it,
    and whichever rank 0 hears first (its own error, or a rank that exited with it), the
    command exits 2 with the message, no rank left behind."""
    port = free_port()
    proc = serve_process.spawn(port, *OPTIONS, "--window-pages", "4", threads=3, new_session=True)
    try:
        rc = proc.wait(180)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 2, err[-3000:]
    assert "--window-pages needs a model with sliding-window layers" in err
    time.sleep(0.5)
    assert _ranks_started_by(proc.pid) == []


def _ranks_started_by(pid: int) -> list[int]:
    """Live rank processes the server ``pid`` started (by the parent pid in their environment:
    once it exited they belong to init)."""
    mark = f"RADIXKV_PARENT_PID={pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and not _zombie(int(entry)):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found
