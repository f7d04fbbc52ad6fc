"""Two `radixkv serve` replicas on one shared store (the real command, the real model, a real
``redis-server`` started here by PID on loopback, the `openai` client): pages replica A computed
are hits for a longer prompt sent to replica B, whose greedy reply is a cold run's; another
tenant gets no hits; a store killed mid-run costs both replicas a bounded time and no request,
and hits resume once it is back.

One pair of servers for the whole module (each takes ~10 s to start); few tokens per reply."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

import radixkv
import serve_process

openai = serve_process.needs_real_server()
import httpx  # noqa: E402

from redis_server import RedisServer, free_port  # noqa: E402

PAGE = 16
SYSTEM = (
    "You are a careful assistant for a build system. Answer in one short sentence. "
    "Tools: read_file(path) returns a file; run(cmd) runs a shell command; search(q) greps the "
    "repository. Prefer reading before running. Never guess a path you have not seen."
)
#: Where replica A publishes its KV events (set by the fixture).
EVENTS: dict[str, str] = {}
#: The operator's secret both replicas are given (a key file).
SECRET = b"the operator's secret, 32 bytes."
#: Seconds one short request may take at most while the store is dead or just restarted.
#: Generous (not a timing test): a reply of a few tokens takes ~1-3 s here; a replica that
#: waited on the dead store per request (redis-py's retries: ~4 s a call) would take far more
#: than its compute, a hung one forever.
BOUND_S = 45.0


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """``(store, port_a, port_b)``: a redis-server and two replicas on it (tenant header
    ``X-Tenant``; pages carry a MAC under :data:`SECRET`), stopped by PID at the end."""
    where = tmp_path_factory.mktemp("redis")
    store = RedisServer(where)
    key_file = where / "secret"
    key_file.write_bytes(SECRET)
    procs = []
    try:
        ports = []
        for _ in range(2):
            port = free_port()
            args = ["--num-pages", "512", "--page-size", str(PAGE), "--host-pages", "256"]
            args += ["--shared-store", store.url, "--shared-store-key-file", str(key_file)]
            args += ["--tenant-header", "X-Tenant"]
            if not ports:  # A publishes its KV events (a unix socket: nothing off this machine)
                args += ["--kv-events", f"ipc://{where}/events-a"]
            procs.append(serve_process.start(port, *args))
            ports.append(port)
        EVENTS["a"] = f"ipc://{where}/events-a"
        yield store, ports[0], ports[1]
    finally:
        for proc in procs:
            if proc.poll() is None:
                rc, err = serve_process.stop(proc)
                assert rc == 0, f"radixkv serve exited {rc} after SIGTERM: {err}"
        store.stop()


def chat(port: int, messages: list[dict], tenant: str | None = None) -> tuple[str, int, int]:
    """``(reply, prompt tokens, cached tokens)`` of a greedy chat completion of 6 tokens."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
    )
    headers = {"X-Tenant": tenant} if tenant is not None else None
    r = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=6, temperature=0, extra_headers=headers
    )
    details = r.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else 0
    return r.choices[0].message.content, r.usage.prompt_tokens, cached or 0


def metric(port: int, name: str) -> float:
    """The value of the sample ``name`` on the replica's ``/metrics`` (the server labels
    every sample with its ``model_name``)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def wait_for_pages(store: RedisServer, pages: int, timeout: float = 30.0) -> None:
    """Waits until the store holds ``pages`` pages (writes are behind the request)."""
    client = store.client()
    try:
        deadline = time.monotonic() + timeout
        while client.dbsize() < pages:
            assert time.monotonic() < deadline, f"the store holds {client.dbsize()} < {pages}"
            time.sleep(0.1)
    finally:
        client.close()


def turns(
    question: str, reply: str, follow_up: str, system: str = SYSTEM
) -> tuple[list[dict], list[dict]]:
    first = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    second = [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": follow_up},
    ]
    return first, second


def test_b_serves_from_the_pages_a_computed_and_another_tenant_gets_none(pool):
    store, a, b = pool
    first, _ = turns("Which tool shows me the Makefile?", "", "")
    reply, prompt_a, cached_a = chat(a, first)
    assert cached_a == 0
    wait_for_pages(store, prompt_a // PAGE)
    _, second = turns("Which tool shows me the Makefile?", reply, "And which runs the tests?")
    text, prompt_b, cached = chat(b, second)
    # B computed none of A's full pages: it fetched them from the store.
    assert cached >= prompt_a // PAGE * PAGE, (cached, prompt_a, prompt_b)
    assert metric(b, "radixkv_kv_shared_hit_pages_total") >= prompt_a // PAGE
    # Another tenant (on A, where turn one is cached for the default tenant, and in the store)
    # finds nothing: that is a cold run, and B's reply is its reply.
    cold_text, _, cold_cached = chat(a, second, tenant="someone-else")
    assert cold_cached == 0
    assert text == cold_text
    assert metric(b, "radixkv_kv_shared_bad_pages_total") == 0


def new_keys(store: RedisServer, before: set[bytes], pages: int) -> list[bytes]:
    """The keys the store gained since ``before`` once it holds ``pages`` more (writes are
    behind the request)."""
    wait_for_pages(store, len(before) + pages)
    client = store.client()
    try:
        return sorted(set(client.keys(b"radixkv:*")) - before)
    finally:
        client.close()


def test_a_replica_of_another_dtype_gets_none_of_the_pages(pool, tmp_path):
    """A third replica on the same store and secret, serving the model in bfloat16: the pages
    A computed in float32 hold other numbers, and their keys carry A's setup (fingerprint,
    dtype, layout), so C finds none of them: no shared hit, no cached token, and the pages it
    computes go in under keys of its own."""
    store, a, _ = pool
    first, _ = turns("Which tool greps the repository?", "", "", "Dtypes. " + SYSTEM)
    client = store.client()
    before = set(client.keys(b"radixkv:*"))
    client.close()
    _, prompt_a, _ = chat(a, first)
    after_a = set(new_keys(store, before, prompt_a // PAGE)) | before
    key_file = tmp_path / "secret"
    key_file.write_bytes(SECRET)
    port = free_port()
    args = ["--num-pages", "512", "--page-size", str(PAGE), "--host-pages", "256"]
    args += ["--shared-store", store.url, "--shared-store-key-file", str(key_file)]
    args += ["--tenant-header", "X-Tenant", "--dtype", "bfloat16"]
    proc = serve_process.start(port, *args)
    try:
        reply, prompt_c, cached = chat(port, first)
        assert reply and prompt_c == prompt_a
        assert cached == 0
        assert metric(port, "radixkv_kv_shared_hit_pages_total") == 0
        mine = new_keys(store, after_a, prompt_c // PAGE)
        setup = {k.split(b":")[1] for k in mine}
        assert len(mine) >= prompt_c // PAGE and setup.isdisjoint(
            {k.split(b":")[1] for k in after_a - before}
        ), "C's pages went in under A's setup"
    finally:
        rc, err = serve_process.stop(proc)
        assert rc == 0, err


def salted_chat(port: int, messages: list[dict], salt: str, tenant: str | None = None) -> int:
    """The cached prompt tokens of a greedy chat completion of 2 tokens with ``cache_salt``."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
    )
    headers = {"X-Tenant": tenant} if tenant is not None else None
    r = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_headers=headers,
        extra_body={"cache_salt": salt},
    )
    details = r.usage.prompt_tokens_details
    return (details.cached_tokens if details is not None else 0) or 0


def test_no_salt_sent_to_a_replica_without_tenants_reads_a_tenants_pages(pool, tmp_path):
    """Replicas configured differently on one store: C takes no tenant header. A client of C
    that sends, as its ``cache_salt``, the namespace tenant "acme" has on A (its old
    ``["acme", null]`` form, or the current one) gets none of acme's pages; and a salt sent to C
    is not A's anonymous request's with the same salt."""
    store, a, b = pool
    first, _ = turns("Which tool reads a file?", "", "", "Tenants. " + SYSTEM)
    _, prompt_a, _ = chat(a, first, tenant="acme")
    wait_for_pages(store, prompt_a // PAGE)
    key_file = tmp_path / "secret"
    key_file.write_bytes(SECRET)
    port = free_port()
    args = ["--num-pages", "512", "--page-size", str(PAGE)]
    args += ["--shared-store", store.url, "--shared-store-key-file", str(key_file)]
    proc = serve_process.start(port, *args)
    try:
        forged = [json.dumps(["acme", None]), radixkv.tenant_namespace("acme", None, tenants=True)]
        for salt in forged:
            assert salted_chat(port, first, salt) == 0, f"cache_salt {salt!r} read acme's pages"
        # The store does hold acme's pages: B, configured as A, hits them.
        _, _, cached = chat(b, first, tenant="acme")
        assert cached >= prompt_a // PAGE * PAGE - PAGE
        # The same salt on both configurations, no tenant on A: two namespaces.
        second, _ = turns("Which tool runs a command?", "", "", "Salts. " + SYSTEM)
        salted_chat(port, second, "s")
        time.sleep(1.0)  # C's pages reach the store behind its request
        assert salted_chat(a, second, "s") == 0
    finally:
        rc, err = serve_process.stop(proc)
        assert rc == 0, err


def test_a_corrupted_or_forged_page_is_recomputed_with_the_reply_unchanged(pool):
    """A's pages of two prompts are tampered with in the store: one has a payload byte flipped
    (its checksum fails), the other is replaced by a forgery (well-formed, for the right key and
    setup, but its MAC made under another secret). B serves neither: it computes them, and its
    replies are a cold run's."""
    from radixkv.kv.tiers.page import HEADER, unpack_header
    from radixkv.kv.tiers.shared import _Codec

    store, a, b = pool
    client = store.client()
    bad_before = metric(b, "radixkv_kv_shared_bad_pages_total")
    for n, tamper in enumerate(("flip", "forge")):
        system = f"Tampered pages, case {n}. " + SYSTEM
        question = "Which tool runs a command?"
        before = set(client.keys(b"radixkv:*"))
        first, _ = turns(question, "", "", system)
        reply, prompt_a, _ = chat(a, first)
        keys = new_keys(store, before, prompt_a // PAGE)
        for k in keys:  # every page of the prompt: B's walk stops at the first
            value = bytearray(client.get(k))
            if tamper == "flip":
                value[HEADER + 100] ^= 0x01
            else:
                _, _, _, length, setup = unpack_header(bytes(value))
                forger = _Codec(b"not the operator's secret at all", setup, length)
                value = bytearray(forger.encode(k, np.zeros(length, np.uint8)))
            client.set(k, bytes(value))
        _, second = turns(question, reply, "And which one reads a file?", system)
        text, _, cached = chat(b, second)
        # The system prompt is new: B had none of it, and took nothing from the store.
        assert cached == 0, (tamper, cached)
        cold_text, _, cold_cached = chat(a, second, tenant=f"cold-{n}")
        assert cold_cached == 0 and text == cold_text, tamper
    client.close()
    assert metric(b, "radixkv_kv_shared_bad_pages_total") >= bad_before + 2
    assert metric(b, "radixkv_kv_shared_hit_pages_total") >= 1  # from the first test


def test_a_router_hears_which_pages_the_store_holds(pool):
    """A's KV events (``--kv-events``) announce the pages it put in the store as blocks of
    medium ``SHARED``: the same blocks it announced on its device, which every replica on the
    store can fetch."""
    zmq = pytest.importorskip("zmq", reason="--kv-events needs radixkv[events]")
    pytest.importorskip("msgspec", reason="--kv-events needs radixkv[events]")
    import msgspec

    from radixkv.events import event_types

    store, a, _ = pool
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    sub.connect(EVENTS["a"])
    decoder = msgspec.msgpack.Decoder(event_types()["KVEventBatch"])
    try:
        time.sleep(0.5)  # PUB/SUB: what is sent before the subscription is in is dropped
        client = store.client()
        before = set(client.keys(b"radixkv:*"))
        client.close()
        first, _ = turns("Which tool reads a file?", "", "", "Events. " + SYSTEM)
        _, prompt_a, _ = chat(a, first)
        new_keys(store, before, prompt_a // PAGE)
        # The writer confirmed the pages after the request's last step: the idle server
        # publishes their events without another request.
        device: set[bytes] = set()
        shared: list[bytes] = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        deadline = time.monotonic() + 20
        while len(shared) < prompt_a // PAGE:
            assert time.monotonic() < deadline, (len(shared), prompt_a // PAGE)
            if not poller.poll(500):
                chat(a, [{"role": "user", "content": "Say hi."}], tenant="events")
                continue
            _, _, payload = sub.recv_multipart()
            for e in decoder.decode(payload).events:
                if type(e).__name__ == "BlockStored":
                    if e.medium == "SHARED":
                        shared.extend(e.block_hashes)
                    else:
                        device.update(e.block_hashes)
        assert set(shared) <= device
    finally:
        sub.close()


def test_a_store_killed_mid_run_costs_a_bounded_time_and_hits_resume(pool):
    store, a, b = pool
    errors_before = [metric(p, "radixkv_kv_shared_errors_total") for p in (a, b)]
    store.stop()  # SIGKILL, as a crash
    for i, port in enumerate((a, b, a, b)):
        t = time.monotonic()
        messages, _ = turns(f"Store down, question {i}: what does run(cmd) do?", "", "")
        reply, _, _ = chat(port, messages)
        assert time.monotonic() - t < BOUND_S
        assert reply
    # Both noticed (B reading, A writing): the replies above ran past a failing store.
    deadline = time.monotonic() + 10
    while any(
        metric(p, "radixkv_kv_shared_errors_total") <= before
        for p, before in zip((a, b), errors_before)
    ):
        assert time.monotonic() < deadline, "a replica never called the dead store"
        time.sleep(0.2)
    store.start()  # on the same port, empty
    time.sleep(3.0)  # past the breakers' cooldown (2 s): their next call probes the store
    # Another system prompt: nothing of it is cached on either replica, so all of B's hits
    # past its first page come from the store.
    system = "After a restart of the store. " + SYSTEM
    question = "Which tool greps the repository?"
    first, _ = turns(question, "", "", system)
    t = time.monotonic()
    reply, prompt_a, _ = chat(a, first)
    assert time.monotonic() - t < BOUND_S
    wait_for_pages(store, prompt_a // PAGE)
    _, second = turns(question, reply, "And which reads a file?", system)
    _, _, cached = chat(b, second)
    assert cached >= prompt_a // PAGE * PAGE
    assert metric(a, "radixkv_kv_shared_breaker_open") == 0
    assert metric(b, "radixkv_kv_shared_breaker_open") == 0
