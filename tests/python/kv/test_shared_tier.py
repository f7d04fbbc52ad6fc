"""The shared tier end to end on a real ``redis-server``: pages one replica computed are hits
for another (carrying exactly the KV computed for them, the greedy tokens of a cold run), and
never for another tenant or another model; a corrupted or forged page is recomputed, never
served; a store that dies costs a bounded time and no request, and hits resume when it is back;
a store off this machine is refused without a key, and credentials never show."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import radixkv
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.tiers import shared as shared_tier
from radixkv.kv.tiers.breaker import CLOSED, OPEN, Breaker
from radixkv.kv.tiers.fingerprint import model_fingerprint
from radixkv.kv.tiers.page import HEADER
from radixkv.kv.tiers.payload import page_payload
from radixkv.kv.tiers.store import check_url, is_local, redact
from redis_server import RedisServer, require
from test_host_tier import check_cached_kv
from tiny_model import dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=11)
OTHER = tiny_model(seed=12)
CFG = MODEL.config
HEAD_DIM = CFG.hidden_size // CFG.num_heads
FP = model_fingerprint(MODEL)
SECRET = b"an operator secret of 32 bytes.."

CACHES = [
    pytest.param(lambda: radixkv.RadixCache(64, 4, 32), id="radix-p4-host"),
    pytest.param(lambda: radixkv.BlockCache(16, 16), id="block-p16"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()


@pytest.fixture
def store(server):
    """The server, emptied before the test."""
    if server.proc is None:
        server.start()
    c = server.client()
    c.flushall()
    c.close()
    return server


def shared_kv(cache, url, fingerprint=FP, key=None) -> KVCache:
    return KVCache(
        cache,
        CFG.num_layers,
        CFG.num_kv_heads,
        HEAD_DIM,
        host_device="cpu" if cache.host_pages else None,
        fingerprint=fingerprint,
        shared_store=url,
        shared_store_key=key,
    )


def run(engine, prompt, n=4, namespace=None) -> radixkv.Result:
    sid = engine.submit(prompt, max_new_tokens=n, stop=(), namespace=namespace)
    (res,) = engine.run([sid], release=True)
    return res


def replica(make, url, model=MODEL, key=None, fingerprint=None):
    kv = shared_kv(make(), url, fingerprint or model_fingerprint(model), key)
    return radixkv.Engine(model, kv), kv


@pytest.mark.parametrize("make", CACHES)
def test_pages_one_replica_computed_are_hits_for_another(make, store):
    rng = np.random.default_rng(0)
    a = ids(rng, 70)
    engine_a, kv_a = replica(make, store.url)
    first = run(engine_a, a)
    assert first.output == dense_greedy(MODEL, a, 4)
    kv_a.shared.flush()
    p = kv_a.page_size
    put = kv_a.shared.stats()["put_pages"]
    assert put >= len(a) // p
    # A fresh replica (its own empty cache) on the same store: a's pages are hits.
    engine_b, kv_b = replica(make, store.url)
    turn = np.concatenate([a, ids(rng, 9)])
    res = run(engine_b, turn)
    assert res.output == dense_greedy(MODEL, turn, 4)
    assert res.cached_tokens >= len(a) // p * p
    s = kv_b.shared.stats()
    assert s["hit_tokens"] == res.cached_tokens and s["bad_pages"] == 0
    # The engine counts them as the shared tier's, not the disk's.
    assert engine_b.stats.shared_tokens == res.cached_tokens and engine_b.stats.disk_tokens == 0
    # The fetched pages hold exactly the KV computed for their tokens.
    req = kv_b.cache.admit(turn)
    kv_b.apply_copies()
    assert req.num_cached >= len(a) // p * p
    check_cached_kv(MODEL, kv_b, req, req.num_cached, atol=1e-6)
    kv_b.cache.abort(req)
    # What the store held already was not sent again: only the pages past a's.
    kv_b.shared.flush()
    assert kv_b.shared.stats()["put_pages"] <= (len(turn) + 4) // p - len(a) // p
    kv_a.close()
    kv_b.close()


def test_another_tenant_and_another_model_get_no_hits(store):
    make = CACHES[0].values[0]
    rng = np.random.default_rng(1)
    a = ids(rng, 60)
    engine_a, kv_a = replica(make, store.url)
    run(engine_a, a, namespace="tenant-a")
    kv_a.shared.flush()
    engine_b, kv_b = replica(make, store.url)
    assert run(engine_b, a, namespace="tenant-b").cached_tokens == 0
    assert run(engine_b, a).cached_tokens == 0  # no namespace is another tenant too
    engine_c, kv_c = replica(make, store.url, model=OTHER)
    res = run(engine_c, a, namespace="tenant-a")
    assert res.cached_tokens == 0
    assert res.output == dense_greedy(OTHER, a, 4)
    assert kv_b.shared.stats()["hit_pages"] == kv_c.shared.stats()["hit_pages"] == 0
    # The owner's tenant does hit (the pages are there).
    engine_d, kv_d = replica(make, store.url)
    assert run(engine_d, a, namespace="tenant-a").cached_tokens > 0
    for kv in (kv_a, kv_b, kv_c, kv_d):
        kv.close()


def test_a_keyed_and_an_unkeyed_replica_never_ask_for_each_others_pages(store):
    """Replicas with and without the operator's secret on one store: the MAC kind is part of
    the setup in the keys, so neither even reads the other's pages (none is fetched and found
    bad: a reader would otherwise fetch them all and drop each one failing its check)."""
    make = CACHES[0].values[0]
    rng = np.random.default_rng(5)
    a, b = ids(rng, 64), ids(rng, 64)
    engine_k, kv_k = replica(make, store.url, key=SECRET)
    engine_u, kv_u = replica(make, store.url)
    run(engine_k, a)
    run(engine_u, b)
    kv_k.shared.flush()
    kv_u.shared.flush()
    assert kv_k.shared.key_prefix(None) != kv_u.shared.key_prefix(None)
    # Each reads the other's prompt: no hit, and no page of the other's was fetched at all.
    engine_k2, kv_k2 = replica(make, store.url, key=SECRET)
    engine_u2, kv_u2 = replica(make, store.url)
    assert run(engine_u2, a).cached_tokens == 0
    assert run(engine_k2, b).cached_tokens == 0
    for kv in (kv_u2, kv_k2):
        s = kv.shared.stats()
        assert s["bad_pages"] == 0 and s["hit_pages"] == 0, s
    # Their own pages are hits for their own kind (the pages are there).
    assert run(engine_k2, a).cached_tokens > 0 and run(engine_u2, b).cached_tokens > 0
    for kv in (kv_k, kv_u, kv_k2, kv_u2):
        kv.close()


def test_each_namespace_has_a_key_prefix_of_its_own(store):
    """The second layer of a store key (the namespace's digest, after the setup): every page
    of a tenant is under its own prefix and no other tenant's is, so an operator can find or
    drop one tenant's pages by pattern."""
    make = CACHES[0].values[0]
    rng = np.random.default_rng(6)
    a = ids(rng, 64)
    engine, kv = replica(make, store.url)
    run(engine, a, namespace="tenant-a")
    run(engine, a, namespace="tenant-b")
    run(engine, a)
    kv.shared.flush()
    c = store.client()
    try:
        every = set(c.keys(b"radixkv:*"))
        mine = {
            ns: set(c.scan_iter(match=kv.shared.key_prefix(ns) + b"*"))
            for ns in ("tenant-a", "tenant-b", None)
        }
    finally:
        c.close()
    pages = len(a) // kv.page_size
    for ns, keys in mine.items():
        assert len(keys) == pages, f"{ns!r}: {len(keys)} keys under its prefix, {pages} pages"
        assert keys == set(kv.shared.store_keys(a, ns, 0, pages))
    assert set().union(*mine.values()) == every and len(every) == 3 * pages
    kv.close()


def _values(store, prefix=b"radixkv:"):
    c = store.client()
    keys = sorted(c.keys(prefix + b"*"))
    return c, keys


def test_a_corrupted_page_is_recomputed_and_dropped(store):
    make = CACHES[0].values[0]
    rng = np.random.default_rng(2)
    a = ids(rng, 64)
    engine_a, kv_a = replica(make, store.url)
    run(engine_a, a)
    kv_a.shared.flush()
    c, keys = _values(store)
    assert keys
    # Flip one payload byte of every stored page: each fails its checksum.
    for k in keys:
        v = bytearray(c.get(k))
        v[HEADER + 5] ^= 0x40
        c.set(k, bytes(v))
    engine_b, kv_b = replica(make, store.url)
    res = run(engine_b, a)
    assert res.output == dense_greedy(MODEL, a, 4)
    assert res.cached_tokens == 0
    s = kv_b.shared.stats()
    assert s["bad_pages"] == 1 and s["hit_pages"] == 0
    # The bad page left the store, and B put its own computed one in its place.
    kv_b.shared.flush()
    engine_c, kv_c = replica(make, store.url)
    assert run(engine_c, a).cached_tokens >= 4
    c.close()
    for kv in (kv_a, kv_b, kv_c):
        kv.close()


def test_a_forged_page_is_never_served(store):
    """A writer without the operator's secret plants KV of another model under the keys of a
    prompt; a replica holding the secret finds every page failing its MAC."""
    make = CACHES[0].values[0]
    rng = np.random.default_rng(3)
    a = ids(rng, 64)
    # The forger: another model's KV, under this model's fingerprint, with its own key.
    engine_f, kv_f = replica(
        make, store.url, model=OTHER, key=b"not the operator key", fingerprint=FP
    )
    run(engine_f, a)
    kv_f.shared.flush()
    assert kv_f.shared.stats()["put_pages"] > 0
    engine_b, kv_b = replica(make, store.url, key=SECRET)
    res = run(engine_b, a)
    assert res.output == dense_greedy(MODEL, a, 4)
    assert res.cached_tokens == 0
    assert kv_b.shared.stats()["bad_pages"] == 1
    # Pages written by a holder of the secret are served.
    kv_b.shared.flush()
    engine_c, kv_c = replica(make, store.url, key=SECRET)
    res = run(engine_c, a)
    assert res.cached_tokens > 0 and res.output == dense_greedy(MODEL, a, 4)
    for kv in (kv_f, kv_b, kv_c):
        kv.close()


def test_a_dead_store_costs_a_bounded_time_and_hits_resume(store):
    make = CACHES[0].values[0]
    rng = np.random.default_rng(4)
    a = ids(rng, 64)
    engine_a, kv_a = replica(make, store.url)
    run(engine_a, a)
    kv_a.shared.flush()
    store.stop()
    with pytest.warns(RuntimeWarning, match="store failed"):  # made while it is down: no error
        engine_b, kv_b = replica(make, store.url)
    kv_b.shared.breaker.cooldown_s = 0.2
    for i in range(3):
        # a's pages are in the (dead) store only; the other prompts are new.
        prompt = np.concatenate([a, ids(rng, 5)]) if i == 0 else ids(rng, 40)
        t = time.perf_counter()
        res = run(engine_b, prompt)
        # Generous bound (not a timing test): a dead store adds far less than a second.
        assert time.perf_counter() - t < 1.0 + 3.0
        assert res.output == dense_greedy(MODEL, prompt, 4)
        assert res.cached_tokens == 0
    s = kv_b.shared.stats()
    assert s["errors"] >= 1 and s["breaker_trips"] >= 1
    store.start()  # empty again: A puts its pages once more
    engine_a2, kv_a2 = replica(make, store.url)
    run(engine_a2, a)
    kv_a2.shared.flush()
    time.sleep(0.25)  # past B's cooldown: its next call probes the store
    b = ids(rng, 48)
    run(engine_a2, b)
    kv_a2.shared.flush()
    time.sleep(0.25)  # past B's cooldown: its next call probes the store
    res = run(engine_b, np.concatenate([b, ids(rng, 3)]))
    assert res.cached_tokens == 48
    assert kv_b.shared.breaker.state == CLOSED
    for kv in (kv_a, kv_b, kv_a2):
        kv.close()


def steps_until_done(engine, sids) -> tuple[dict[int, radixkv.Result], float]:
    """Steps ``engine`` until ``sids`` ended: their results, and the longest step (seconds)."""
    done: dict[int, radixkv.Result] = {}
    longest = 0.0
    while len(done) < len(sids):
        t = time.perf_counter()
        for r in engine.step():
            done[r.id] = r
        longest = max(longest, time.perf_counter() - t)
    return done, longest


def test_a_hung_store_never_delays_a_step_and_hits_still_happen(store):
    """The store is frozen (SIGSTOP: connections open, nothing answers, as a hung or
    overloaded server): the engine's steps never wait on it, every request completes with a
    cold run's tokens, and once it answers again its pages are hits."""
    make = CACHES[0].values[0]
    rng = np.random.default_rng(7)
    a, c, d = ids(rng, 64), ids(rng, 64), ids(rng, 64)
    engine_a, kv_a = replica(make, store.url)
    for prompt in (a, c, d):
        run(engine_a, prompt)
    kv_a.shared.flush()
    engine_b, kv_b = replica(make, store.url)
    kv_b.shared.breaker.cooldown_s = 0.2
    # While the store answers: fetched off the step, installed by one, found as hits.
    turn = np.concatenate([a, ids(rng, 5)])
    sid = engine_b.submit(turn, max_new_tokens=4, stop=())
    done, _ = steps_until_done(engine_b, [sid])
    assert done[sid].cached_tokens == 64 and done[sid].output == dense_greedy(MODEL, turn, 4)
    os.kill(store.proc.pid, signal.SIGSTOP)
    try:
        prompts = [np.concatenate([c, ids(rng, 5)]), ids(rng, 50), ids(rng, 30)]
        t = time.perf_counter()
        sids = [engine_b.submit(p, max_new_tokens=4, stop=()) for p in prompts]
        submit_s = time.perf_counter() - t
        done, longest = steps_until_done(engine_b, sids)
        # Generous bound (not a timing test): a step of the tiny model takes milliseconds; one
        # that called the frozen store would wait out its 1 s timeout.
        assert longest < 0.5 and submit_s < 0.5, (longest, submit_s)
        for sid, prompt in zip(sids, prompts):
            assert done[sid].output == dense_greedy(MODEL, prompt, 4)
            assert done[sid].cached_tokens == 0
    finally:
        os.kill(store.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while kv_b.shared.fetching:  # the reader's call into the frozen store times out
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert kv_b.shared.stats()["errors"] >= 1
    time.sleep(0.3)  # past B's cooldown: its next call probes the store
    turn = np.concatenate([d, ids(rng, 5)])
    res = run(engine_b, turn)
    assert res.cached_tokens == 64 and res.output == dense_greedy(MODEL, turn, 4)
    assert kv_b.shared.breaker.state == CLOSED
    kv_a.close()
    kv_b.close()


def test_a_page_the_store_lacks_is_not_asked_for_again_at_once(store):
    """A waiting request is polled at every step; the page its fetch found missing is not
    asked for again until the miss expires."""
    make = CACHES[0].values[0]
    kv = shared_kv(make(), store.url)
    prompt = ids(np.random.default_rng(8), 40)
    assert kv.shared.poll(prompt) == (0, True)  # the fetch starts, off this thread
    assert kv.shared.prefetch(prompt, wait_s=5.0) == 0  # back: a miss
    assert kv.shared.stats()["lookups"] == 1
    for _ in range(20):
        assert kv.shared.poll(prompt) == (0, False)
    assert kv.shared.stats()["lookups"] == 1 and not kv.shared.fetching
    # Once it expires the store is asked again (it may hold the page by then).
    time.sleep(shared_tier.MISS_TTL_S + 0.05)
    assert kv.shared.poll(prompt) == (0, True)
    assert kv.shared.prefetch(prompt, wait_s=5.0) == 0
    assert kv.shared.stats()["lookups"] == 2
    kv.close()


def test_a_step_copies_the_pages_it_completed_out_in_one_gather(store, monkeypatch):
    """Both prompts' pages, prefilled in one step, leave the pool in one gather (one host copy
    on a device), each row exactly the page's KV; the store then serves them."""
    make = CACHES[0].values[0]
    calls = []
    real = shared_tier.page_payloads

    def spy(kv, k, v, pages):
        rows = real(kv, k, v, pages)
        for page, row in zip(pages, rows):
            assert np.array_equal(row, page_payload(kv, k, v, page))
        calls.append(len(pages))
        return rows

    monkeypatch.setattr(shared_tier, "page_payloads", spy)
    rng = np.random.default_rng(9)
    a, b = ids(rng, 41), ids(rng, 41)
    kv = shared_kv(make(), store.url)
    kv.shared.hold_s = 0  # both admitted at once, without waiting for their (missing) pages
    engine = radixkv.Engine(MODEL, kv, token_budget=256)
    sids = [engine.submit(p, max_new_tokens=1, stop=()) for p in (a, b)]
    engine.run(sids, release=True)
    kv.shared.flush()
    assert calls[0] == 2 * 10  # the prefill step: both prompts' 10 full pages, one gather
    assert kv.shared.stats()["put_pages"] == sum(calls) == 20
    other, kv_o = replica(make, store.url)
    assert run(other, np.concatenate([b, ids(rng, 3)])).cached_tokens == 40
    kv.close()
    kv_o.close()


@pytest.mark.parametrize("block_hash", ["blake3", "sha256_cbor"])
def test_routers_learn_which_pages_the_shared_store_holds(store, block_hash):
    """The pages a replica put in the store are announced as KV events of their own medium,
    chained as the device's, so a router can count them for every replica on the store."""
    pytest.importorskip("zmq", reason="KV events need radixkv[events]")
    pytest.importorskip("msgspec", reason="KV events need radixkv[events]")
    from event_subscriber import receive_all, slow_join, subscriber
    from radixkv.events import ZmqPublisher

    make = CACHES[0].values[0]
    kv = shared_kv(make(), store.url)
    engine = radixkv.Engine(MODEL, kv)
    pub = ZmqPublisher(kv.cache, "tcp://127.0.0.1:*", bind=True, block_hash=block_hash)
    pub.announce_shared(kv.shared)
    sub, decoder = subscriber(pub.endpoint, "")
    try:
        slow_join(pub, sub, decoder)
        a = ids(np.random.default_rng(10), 41)
        run(engine, a, n=1, namespace="tenant-x")
        kv.shared.flush()
        assert pub.publish() > 0
        events = [e for _, batch in receive_all(sub, decoder, pub._seq - 1) for e in batch.events]
        stored = [e for e in events if type(e).__name__ == "BlockStored"]
        shared = [e for e in stored if e.medium == "SHARED"]
        device = [e for e in stored if e.medium == "GPU"]
        # The prompt's 10 full pages, in order, with their tokens, under the device's hashes.
        assert [h for e in shared for h in e.block_hashes] == [
            h for e in device for h in e.block_hashes
        ]
        assert len([h for e in shared for h in e.block_hashes]) == 10
        assert [t for e in shared for t in e.token_ids] == [int(t) for t in a[:40]]
        if block_hash == "blake3":
            keys = radixkv.block_hashes(a[:40], 4, "tenant-x")
            assert [h for e in shared for h in e.block_hashes] == list(keys)
        # Pages the store is known to hold are not sent, nor announced, again: the next turn
        # announces its two new pages only, chained onto the last one announced.
        turn = np.concatenate([a, ids(np.random.default_rng(11), 8)])
        run(engine, turn, n=1, namespace="tenant-x")
        kv.shared.flush()
        keys = radixkv.block_hashes(turn[:48], 4, "tenant-x")
        ((kind, ns, parent, new, tokens),) = kv.shared.drain_events()
        assert (kind, ns, parent, new) == ("stored", b"tenant-x", keys[9], keys[10:12])
        assert tokens.tolist() == turn[40:48].tolist()
    finally:
        pub.close()
        sub.close()
        kv.close()


def test_a_unix_socket_store_with_a_password(tmp_path):
    s = RedisServer(tmp_path, unix=True, password="p4ss-w0rd-xyz")
    try:
        make = CACHES[1].values[0]
        rng = np.random.default_rng(5)
        a = ids(rng, 40)
        engine_a, kv_a = replica(make, s.url)
        run(engine_a, a)
        kv_a.shared.flush()
        engine_b, kv_b = replica(make, s.url)
        assert run(engine_b, a).cached_tokens == 32
        for shown in (repr(kv_b.shared), repr(kv_b.shared.stats()), kv_b.shared.address):
            assert "p4ss-w0rd-xyz" not in shown
        kv_a.close()
        kv_b.close()
    finally:
        s.stop()


def test_a_store_off_this_machine_needs_a_key_and_urls_are_checked():
    require()
    cache = radixkv.RadixCache(8, 4)
    url = "redis://user:s3cret-pw@10.255.255.1:6379/0"
    with pytest.raises(ValueError, match="loopback") as e:
        shared_kv(cache, url)
    assert "s3cret-pw" not in str(e.value) and "***" in str(e.value)
    for bad, what in (
        ("http://127.0.0.1:6379", "scheme"),
        ("redis://", "no host"),
        ("unix://", "no socket"),
        ("redis://127.0.0.1:notaport", "not a valid URL"),
        (6379, "URL str"),
    ):
        with pytest.raises(ValueError, match=what):
            shared_kv(radixkv.RadixCache(8, 4), bad)
    with pytest.raises(ValueError, match="at least 16"):
        shared_kv(radixkv.RadixCache(8, 4), "redis://127.0.0.1:1", key=b"short")
    with pytest.raises(ValueError, match="needs shared_store"):
        shared_kv(radixkv.RadixCache(8, 4), None, key=SECRET)
    for bad, what in (
        ("mooncake://127.0.0.1", "names no master"),
        ("mooncake://127.0.0.1:1?bogus=1", "unknown option 'bogus'"),
        ("mooncake://127.0.0.1:1?local_buffer_mb=lots", "whole number of MiB"),
    ):
        with pytest.raises(ValueError, match=what):
            check_url(bad)
    # Mooncake's transfer listeners bind every address: never taken as local (needs a key).
    assert not is_local("mooncake://127.0.0.1:50051")
    assert is_local("redis://localhost:1") and is_local("redis://[::1]:1")
    assert is_local("unix:///tmp/x.sock") and not is_local("redis://10.0.0.1:1")
    assert redact("redis://:pw@h:1/0") == "redis://***@h:1/0"


def test_the_breaker_opens_and_probes_after_its_cooldown():
    now = [0.0]
    b = Breaker(failures=2, cooldown_s=5.0, clock=lambda: now[0])
    assert b.allow()
    b.failure()
    assert b.state == CLOSED and b.allow()
    b.failure()
    assert b.state == OPEN and not b.allow() and b.trips == 1
    now[0] = 5.0
    assert b.allow() and not b.allow()  # one probe
    b.failure()
    assert b.state == OPEN and b.trips == 2 and not b.allow()
    now[0] = 10.0
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.allow()


def test_metrics_count_the_shared_tier_and_never_show_the_store(tmp_path):
    prometheus_client = pytest.importorskip("prometheus_client")
    from radixkv.metrics import CacheCollector

    s = RedisServer(tmp_path, password="m3trics-pw-xyz")
    try:
        make = CACHES[0].values[0]
        rng = np.random.default_rng(6)
        a = ids(rng, 40)
        engine_a, kv_a = replica(make, s.url)
        run(engine_a, a)
        kv_a.shared.flush()
        engine_b, kv_b = replica(make, s.url)
        run(engine_b, a)
        registry = prometheus_client.CollectorRegistry()
        registry.register(CacheCollector(engine_b.cache, engine=engine_b))
        got = registry.get_sample_value
        assert got("radixkv_kv_shared_hit_pages_total") == kv_b.shared.stats()["hit_pages"] == 9
        assert got("radixkv_kv_shared_breaker_open") == 0
        assert got("radixkv_kv_shared_bad_pages_total") == 0
        text = prometheus_client.generate_latest(registry).decode()
        assert "m3trics-pw-xyz" not in text and str(s.port) not in text
        kv_b.shared.flush()  # B's writes land first: its first failure is the read below
        s.stop()
        with pytest.warns(RuntimeWarning, match=r"store failed \(shared store redis://\*\*\*@"):
            run(engine_b, ids(rng, 40))
        assert got("radixkv_kv_shared_breaker_open") == 1
        assert got("radixkv_kv_shared_errors_total") >= 1
        kv_a.close()
        kv_b.close()
    finally:
        s.stop()
