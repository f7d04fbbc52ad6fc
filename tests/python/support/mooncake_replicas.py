"""Two replicas on one Mooncake Store, run by ``test_shared_mooncake.py`` inside a private
network namespace where a ``mooncake_master`` and a ``mooncake_client`` memory holder run:
pages replica A computed are hits for replica B (the greedy tokens of a cold run), another
tenant gets none, a forged page is never served; then a stopped master costs a call the store's
timeout, not the client's 30 s. Exits 0 and prints ``ok`` and ``hung master ok`` when every
check holds; an ``AssertionError`` otherwise.

    python mooncake_replicas.py mooncake://127.0.0.1:PORT MASTER_PID
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import radixkv
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.tiers.fingerprint import model_fingerprint
from radixkv.kv.tiers.store import SharedStoreError, open_store
from tiny_model import dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=11)
SECRET = b"an operator secret of 32 bytes.."


def replica(url: str, key: bytes = SECRET):
    cfg = MODEL.config
    kv = KVCache(
        radixkv.RadixCache(64, 4, 32),
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.hidden_size // cfg.num_heads,
        host_device="cpu",
        fingerprint=model_fingerprint(MODEL),
        shared_store=url,
        shared_store_key=key,
    )
    return radixkv.Engine(MODEL, kv), kv


def run(engine, prompt, namespace=None) -> radixkv.Result:
    sid = engine.submit(prompt, max_new_tokens=4, stop=(), namespace=namespace)
    (res,) = engine.run([sid], release=True)
    return res


def wait_for_store(url: str, timeout: float = 30.0) -> None:
    """Until the master answers and the holder's memory takes a value."""
    store = open_store(url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            store.put([(b"radixkv-probe", b"x" * 64)])
            break
        except SharedStoreError:
            if time.monotonic() > deadline:
                raise
            store.close()
            store = open_store(url)
            time.sleep(0.2)
    store.close()


def main(url: str) -> None:
    wait_for_store(url)
    rng = np.random.default_rng(0)
    a = ids(rng, 70)
    engine_a, kv_a = replica(url)
    assert run(engine_a, a, "tenant").output == dense_greedy(MODEL, a, 4)
    kv_a.shared.flush()
    assert kv_a.shared.stats()["put_pages"] >= 17, kv_a.shared.stats()
    engine_b, kv_b = replica(url)
    turn = np.concatenate([a, ids(rng, 9)])
    res = run(engine_b, turn, "tenant")
    assert res.cached_tokens >= 68, (res.cached_tokens, kv_b.shared.stats())
    assert res.output == dense_greedy(MODEL, turn, 4)
    assert run(engine_b, a, "another tenant").cached_tokens == 0
    # A writer without the operator's secret: its pages fail their MAC, B computes.
    engine_f, kv_f = replica(url, key=b"not the operator's secret......")
    c = ids(rng, 40)
    run(engine_f, c)
    kv_f.shared.flush()
    engine_c, kv_c = replica(url)
    res = run(engine_c, c)
    assert res.cached_tokens == 0 and res.output == dense_greedy(MODEL, c, 4)
    assert kv_c.shared.stats()["bad_pages"] == 1, kv_c.shared.stats()
    for kv in (kv_a, kv_b, kv_f, kv_c):
        kv.close()
    print("ok", kv_b.shared.stats())


def hung_master(url: str, master: int) -> None:
    """The master stopped (SIGSTOP: it holds its connections and answers nothing; the client's
    own RPC timeout is 30 s): a call is given up after the store's timeout, the next one fails
    at once without reaching the client, and once the master runs again calls succeed."""
    store = open_store(url)
    store.put([(b"radixkv-hung", b"x" * 64)])
    os.kill(master, signal.SIGSTOP)
    try:
        t = time.monotonic()
        try:
            store.exists([b"radixkv-hung"])
            raise AssertionError("EXISTS answered by a stopped master")
        except SharedStoreError as e:
            took = time.monotonic() - t
            assert "no answer in" in str(e) and took < store.timeout_s + 1.0, (str(e), took)
        t = time.monotonic()
        try:
            store.get([b"radixkv-hung"])
            raise AssertionError("GET sent behind a call the client still holds")
        except SharedStoreError as e:
            assert "still waits" in str(e) and time.monotonic() - t < 0.5, str(e)
    finally:
        os.kill(master, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while True:  # the late call comes back (answered, or the client's timeout), then calls go
        try:
            assert store.get([b"radixkv-hung"]) == [b"x" * 64]
            break
        except SharedStoreError:
            assert time.monotonic() < deadline, "calls never went through again"
            time.sleep(0.5)
    store.close()
    print("hung master ok")


if __name__ == "__main__":
    main(sys.argv[1])
    hung_master(sys.argv[1], int(sys.argv[2]))
