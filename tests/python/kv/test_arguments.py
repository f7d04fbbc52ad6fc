"""Arguments checked where they are given (issue 22, section 4): each test here failed before its
fix, either silently (a wrong count, a truncated copy) or far from the cause (at the first
``plan``, deep in torch or msgspec, as a bare ``OverflowError``/``TypeError``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.tiers.host import COPY_LOAD, COPY_OFFLOAD, copy_runs
from tiny_model import ids, tiny_model

pytestmark = pytest.mark.robust

# ---- CacheCollector attached late --------------------------------------------------------------


def _engine_total(collector, name="radixkv_engine_requests"):
    fams = {f.name: f for f in collector.collect()}
    (total,) = [s.value for s in fams[name].samples if s.name.endswith("total")]
    return total


def test_collector_attached_after_releases_counts_what_follows():
    pytest.importorskip("prometheus_client")
    from radixkv.metrics import CacheCollector

    model = tiny_model(seed=8)
    eng = radixkv.Engine(model, model.make_kv_cache(radixkv.RadixCache(1024)))
    rng = np.random.default_rng(5)
    eng.generate([ids(rng, 6) for _ in range(3)], max_new_tokens=1, release=True)  # ids 0..2
    held = eng.generate([ids(rng, 6)], max_new_tokens=1)  # id 3: finished, still held
    assert list(eng.sequences) == [held[0].id] == [3]
    collector = CacheCollector(eng.cache, engine=eng)
    # Released before the collector existed: gone, not counted; the held one is.
    assert _engine_total(collector) == 1
    later = eng.generate([ids(rng, 6) for _ in range(2)], max_new_tokens=1, release=True)
    assert _engine_total(collector) == 3
    assert _engine_total(collector, "radixkv_engine_prompt_tokens") == 6 * 3
    # A gap in the middle (request 6 released between scrapes, 7 still held) stops nothing.
    a, b = (eng.submit(ids(rng, 6), max_new_tokens=1) for _ in range(2))
    eng.run([a, b])
    eng.release([a])
    c = eng.submit(ids(rng, 6), max_new_tokens=1)
    eng.run([c])
    assert _engine_total(collector) == 6
    assert _engine_total(collector) == 6  # scraping again counts nothing twice
    assert len(later) == 2 and collector._pending == set()


def test_collector_forgets_requests_dropped_unfinished():
    """A request seen unfinished and then gone (dropped by a failed submit, or released by an
    engine without release hooks) is forgotten, not kept pending forever."""
    pytest.importorskip("prometheus_client")
    from radixkv.metrics import CacheCollector

    model = tiny_model(seed=8)
    eng = radixkv.Engine(model, model.make_kv_cache(radixkv.RadixCache(1024)))
    collector = CacheCollector(eng.cache, engine=eng)
    rng = np.random.default_rng(6)
    sid = eng.submit(ids(rng, 6), max_new_tokens=1)
    assert _engine_total(collector) == 0 and collector._pending == {sid}
    eng.sequences.pop(sid)  # as if it had vanished unfinished (ids are never reused)
    assert _engine_total(collector) == 0 and collector._pending == set()


# ---- KVCache(host_device=...) ------------------------------------------------------------------


def test_host_device_must_be_host_memory():
    tiered = radixkv.RadixCache(8, page_size=2, host_pages=5)
    with pytest.raises(ValueError, match=r"host_device='meta'.*no storage"):
        KVCache(tiered, 2, 2, 16, host_device="meta")
    with pytest.raises(ValueError, match=r"host_device=device\(type='meta'\)"):
        KVCache(tiered, 2, 2, 16, host_device=torch.device("meta"))
    # A CUDA "host" pool for a CPU (or CUDA) KV pool is device memory, not a host tier; refused
    # whether or not this machine has CUDA.
    with pytest.raises(ValueError, match=r"host_device='cuda'.*not host memory"):
        KVCache(tiered, 2, 2, 16, host_device="cuda")
    with pytest.raises(ValueError, match=r"host_device='cuda:1'.*host_device=\"cpu\""):
        KVCache(tiered, 2, 2, 16, host_device="cuda:1")
    for ok in ("cpu", "cpu:0", torch.device("cpu")):
        kv = KVCache(tiered, 1, 1, 4, host_device=ok)
        assert kv.host_device.type == "cpu" and kv.host_k[0].device.type == "cpu"


# ---- KVCache.apply_copies(log) / copy_runs -----------------------------------------------------


def _tiered_kv() -> KVCache:
    """8 device pages, 6 host pages, random distinct rows."""
    kv = KVCache(radixkv.RadixCache(8, page_size=2, host_pages=6), 1, 1, 4, host_device="cpu")
    g = torch.Generator().manual_seed(0)
    for t in (*kv.k, *kv.v, *kv.host_k, *kv.host_v):
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


@pytest.mark.parametrize(
    "log, match",
    [
        # Floats were truncated (1.7 -> page 1) and performed.
        pytest.param(
            np.array([[0, 1.7, 0]]), r"log row 0 = \[0\.0, 1\.7, 0\.0\].*integers", id="float"
        ),
        pytest.param(
            [[0, 1, 0], [1, 0.5, 2]],
            r"log row 1 = \[1, 0\.5, 2\].*got 0\.5 \(float\)",
            id="float-list",
        ),
        pytest.param(
            np.array([[0, 1, 0]], dtype=np.float32), r"log row 0 .*integers", id="float32-integral"
        ),
        pytest.param(np.array([[True, False, False]]), r"log row 0 .*integers", id="bool"),
        pytest.param(np.array([["0", "1", "0"]]), r"log row 0 .*integers", id="str"),
        # Huge ids gave a bare OverflowError (or numpy made them floats).
        pytest.param([[0, 2**70, 0]], rf"log row 0 = \[0, {2**70}, 0\] is not a copy", id="huge"),
        pytest.param([[0, 1, 0], [1, 0, -(2**70)]], r"log row 1 = .*is not a copy", id="huge-neg"),
        pytest.param([[0, 2**63, 0]], rf"log row 0 = \[0, {2**63}, 0\]", id="past-int64"),
        pytest.param(
            np.array([[0, 1, 0], [1, 2**64 - 1, 0]], dtype=np.uint64),
            rf"log row 1 = \[1, {2**64 - 1}, 0\]",
            id="uint64-wraps",
        ),
        pytest.param(np.array([[7, 1, 0]], dtype=np.int8), r"log row 0 = \[7, 1, 0\]", id="kind"),
        pytest.param(np.array([[COPY_LOAD, 6, 0]]), r"log row 0 = \[1, 6, 0\]", id="host-range"),
        pytest.param(np.array([[COPY_OFFLOAD, 1, 6]]), r"log row 0 = \[0, 1, 6\]", id="dst-range"),
        pytest.param([[0, 1], [0, 1, 2]], r"log must be shaped \[N, 3\]", id="ragged"),
        pytest.param(np.zeros(3, np.int32), r"log must be shaped \[N, 3\].*\(3,\)", id="1d"),
        pytest.param(np.int32(0), r"log must be shaped \[N, 3\].*\(\)", id="scalar"),
    ],
)
def test_apply_copies_checks_the_log(log, match):
    kv = _tiered_kv()
    before = [t.clone() for t in (*kv.k, *kv.v, *kv.host_k, *kv.host_v)]
    with pytest.raises(ValueError, match=match):
        kv.apply_copies(log)
    with pytest.raises(ValueError, match=match):
        copy_runs(log, 8, 6)
    after = (*kv.k, *kv.v, *kv.host_k, *kv.host_v)
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing performed
    assert kv.host.pending == 0 and kv.apply_copies() == 0


def test_apply_copies_takes_any_exact_integer_log():
    kv = _tiered_kv()
    want = kv.k[0][2:4].clone()
    # Python ints, numpy ints of any width, an object array of ints: all exact.
    assert kv.apply_copies([[COPY_OFFLOAD, 1, 0]]) == 1
    assert torch.equal(kv.host_k[0][0:2], want)
    assert kv.apply_copies(np.array([[COPY_LOAD, 0, 5]], dtype=np.uint8)) == 1
    assert torch.equal(kv.k[0][10:12], want)
    assert kv.apply_copies(np.array([[COPY_OFFLOAD, np.int64(2), 3]], dtype=object)) == 1
    assert kv.apply_copies([]) == 0 and kv.apply_copies(np.zeros((0, 3), np.int64)) == 0
    assert copy_runs([[0, 1, 0], [0, 2, 1]], 8, 6) == [(0, [(1, 0, 2)])]


# ---- KVCache.warmup ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_sizes": 4}, r"batch_sizes must be an iterable of positive ints.*got 4"),
        ({"batch_sizes": None}, r"batch_sizes must be an iterable.*got None"),
        ({"batch_sizes": "8"}, r"batch_sizes must be an iterable.*got '8'"),
        ({"batch_sizes": [1, 0]}, r"batch_sizes\[1\] must be a positive int, got 0"),
        ({"batch_sizes": (2, 2.5)}, r"batch_sizes\[1\] must be a positive int, got 2\.5"),
        ({"batch_sizes": [True]}, r"batch_sizes\[0\] must be a positive int, got True"),
        ({"scale": "x"}, r"scale must be a positive finite number or None, got 'x'"),
        ({"scale": 0.0}, r"scale must be .*got 0\.0"),
        ({"scale": float("nan")}, r"scale must be .*got nan"),
    ],
)
@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_warmup_checks_its_arguments(attention, kwargs, match):
    kv = KVCache(radixkv.RadixCache(16), 1, 2, 8, attention=attention)
    with pytest.raises(ValueError, match=match):
        kv.warmup(num_heads=4, **kwargs)


def test_warmup_takes_any_iterable_of_sizes():
    kv = KVCache(radixkv.RadixCache(16), 1, 2, 8, attention="sdpa")
    assert kv.warmup(4, batch_sizes=iter([1, 2])) == []
    assert kv.warmup(4, batch_sizes=range(1, 3), scale=0.5) == []
    assert kv.warmup(4, batch_sizes=np.array([3, 4]), scale=np.float32(0.25)) == []
    assert kv.warmup(4, batch_sizes=()) == []


# ---- block_hashes(hash_seed=...) ---------------------------------------------------------------


def test_block_hashes_seed_changes_sha256_cbor_only_by_spec():
    toks = list(range(8))
    sha = [radixkv.block_hashes(toks, 4, algorithm="sha256_cbor", hash_seed=s) for s in "01"]
    assert sha[0] != sha[1]  # the seed is vLLM's NONE_HASH seed


def test_block_hashes_refuses_a_seed_for_blake3():
    """docs/EVENTS.md and the docstring: hash_seed is used by sha256_cbor only (blake3 keys are
    the BlockCache's own and take no seed), so a non-default seed with blake3 is a mistake."""
    toks = list(range(8))
    with pytest.raises(ValueError, match="hash_seed='42' has no effect with algorithm='blake3'"):
        radixkv.block_hashes(toks, 4, algorithm="blake3", hash_seed="42")
    assert radixkv.block_hashes(toks, 4, algorithm="blake3", hash_seed="0")  # the default


# ---- ZmqPublisher ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"data_parallel_rank": "zero"},
            r"data_parallel_rank must be an int >= 0 or None, got 'zero'",
        ),
        ({"data_parallel_rank": -1}, r"data_parallel_rank must be .*got -1"),
        ({"data_parallel_rank": 1.0}, r"data_parallel_rank must be .*got 1\.0"),
        ({"data_parallel_rank": True}, r"data_parallel_rank must be .*got True"),
        ({"medium": 1}, r"medium must be a str .*or None, got 1"),
        ({"medium": b"GPU"}, r"medium must be a str .*got b'GPU'"),
        ({"int_hashes": 1}, r"int_hashes must be a bool, got 1"),
        ({"int_hashes": "yes"}, r"int_hashes must be a bool, got 'yes'"),
        ({"hwm": -1}, r"hwm must be an int >= 0.*got -1"),
        ({"hwm": "10"}, r"hwm must be an int >= 0.*got '10'"),
        ({"bind": "no"}, r"bind must be a bool or None, got 'no'"),
        ({"replay_endpoint": 5558}, r"replay_endpoint must be a ZeroMQ address.*got 5558"),
        # The seed of vLLM's sha256_cbor chains; radixkv's blake3 keys take none.
        ({"hash_seed": "42"}, r"hash_seed='42' has no effect with block_hash='blake3'"),
    ],
)
def test_publisher_checks_batch_fields(kwargs, match):
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from radixkv.events import ZmqPublisher

    cache = radixkv.BlockCache(8, 4)
    with pytest.raises(ValueError, match=match):
        ZmqPublisher(cache, "tcp://127.0.0.1:*", **kwargs)
    assert cache.drain_events() == []  # refused before recording was turned on


def test_publisher_accepts_vllm_batch_fields():
    pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    from radixkv.events import ZmqPublisher

    cache = radixkv.BlockCache(8, 4)
    for kwargs in (
        {"data_parallel_rank": None, "medium": None, "int_hashes": True},
        {"data_parallel_rank": 3, "medium": "CPU", "hash_seed": "0"},
        {"block_hash": "sha256_cbor", "hash_seed": "42", "hwm": 0, "bind": True},
    ):
        pub = ZmqPublisher(cache, "tcp://127.0.0.1:*", **kwargs)
        try:
            req = cache.admit(list(range(4)))
            cache.commit(req, 4)
            cache.finish(req)
            assert pub.publish() == 1
            raw = msgspec.msgpack.decode(pub._buffer[-1][1])
            assert raw[2] == kwargs.get("data_parallel_rank", 0)
            assert raw[1][0][6] == kwargs.get("medium", "GPU")
        finally:
            pub.close()
        cache.reset()
