"""KV events: what each cache records, vLLM's sha256_cbor block hashes, and a subscriber on a
loopback socket that rebuilds the set of cached blocks from the wire and finds the cache's own."""

import hashlib
import time

import numpy as np
import pytest

import radixkv

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
cbor2 = pytest.importorskip("cbor2")

from event_subscriber import (  # noqa: E402
    receive_all,
    same_fields,
    slow_join,
    subscriber,
    vllm_decoder,
)
from radixkv.events import ZmqPublisher, event_types  # noqa: E402

CACHES = [
    pytest.param(lambda: radixkv.RadixCache(300, 1), id="radix-p1"),
    pytest.param(lambda: radixkv.RadixCache(90, 4), id="radix-p4"),
    pytest.param(lambda: radixkv.BlockCache(24, 16), id="block-p16"),
]

VECTORS = [  # docs/EVENTS.md
    ([*range(1, 10)], 4, None, "0", ["c9d58ba695280d69", "24125b23e68883b5"]),
    (
        [*range(16), *[100000, 4000000000] * 8],
        16,
        None,
        "0",
        ["d830de3d42c00f25", "5a6aab988b955a14"],
    ),
    ([*range(1, 9)], 4, "tenant-a", "0", ["5188afdf42517236", "d6ebcd87b3c5985e"]),
    ([1, 2, 3, 4], 4, None, "42", ["0a99040f25d8a5f2"]),
]


def vllm_reference(tokens, page_size, salt, seed):
    """vLLM's hash_block_tokens over sha256_cbor, written the way vLLM writes it (cbor2)."""
    sha256_cbor = lambda x: hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()  # noqa: E731
    prev, out = sha256_cbor(seed), []
    for i in range(len(tokens) // page_size):
        extra = (salt,) if (salt and i == 0) else None
        prev = sha256_cbor((prev, tuple(tokens[i * page_size : (i + 1) * page_size]), extra))
        out.append(prev)
    return out


@pytest.mark.parametrize(("tokens", "p", "ns", "seed", "prefixes"), VECTORS)
def test_sha256_cbor_vectors(tokens, p, ns, seed, prefixes):
    got = radixkv.block_hashes(tokens, p, ns, algorithm="sha256_cbor", hash_seed=seed)
    assert [h.hex()[:16] for h in got] == prefixes
    assert got == vllm_reference(tokens, p, ns, seed)


def test_sha256_cbor_matches_cbor2_on_random_prompts():
    rng = np.random.default_rng(5)
    for p in (1, 3, 16, 32):
        toks = rng.integers(0, 2**32, 100, dtype=np.uint64).astype(np.uint32)
        toks[:10] = rng.integers(0, 300, 10)  # every CBOR integer width
        for ns in (None, "a", "é-tenant"):
            got = radixkv.block_hashes(toks, p, ns, algorithm="sha256_cbor", hash_seed="7")
            assert got == vllm_reference([int(t) for t in toks], p, ns, "7")
    with pytest.raises(ValueError, match="algorithm must be 'blake3' or 'sha256_cbor', got 'md5'"):
        radixkv.block_hashes([1, 2], 1, algorithm="md5")


def run(cache, tokens, ns=None, finish=True):
    req = cache.admit(tokens, ns)
    cache.commit(req, req.num_tokens)
    if finish:
        cache.finish(req)
    return req


def cached_keys_by_probe(cache, blocks):
    """Of the blocks a subscriber knows (key -> prefix tokens, namespace), the ones the cache
    serves: match_prefix of the prefix covers the whole prefix."""
    return {
        k
        for k, (prefix, ns) in blocks.items()
        if cache.match_prefix([*prefix, 0], ns) >= len(prefix)
    }


@pytest.mark.parametrize("make_cache", CACHES)
def test_events_off_by_default_and_in_order(make_cache):
    cache = make_cache()
    run(cache, list(range(40)))
    assert cache.drain_events() == []  # off: nothing recorded
    cache.record_events(True)
    p = cache.page_size
    run(cache, list(range(40)) + list(range(100, 140)))
    (kind, ns, parent, keys, tokens), *rest = cache.drain_events()
    assert rest == [] and kind == "stored" and ns is None
    full = radixkv.block_hashes(list(range(40)) + list(range(100, 140)), p)
    # The first 40 tokens were cached already (whole pages of them): only the rest is stored.
    first = 40 // p
    assert keys == full[first:] and parent == full[first - 1]
    assert list(tokens) == (list(range(40)) + list(range(100, 140)))[first * p : len(full) * p]
    assert cache.drain_events() == []
    cache.record_events(False)
    run(cache, list(range(500, 540)))
    cache.record_events(True)
    assert cache.drain_events() == []


@pytest.mark.parametrize("block_hash", ["blake3", "sha256_cbor"])
@pytest.mark.parametrize("make_cache", CACHES)
def test_subscriber_rebuilds_the_cached_blocks(make_cache, block_hash):
    cache = make_cache()
    p = cache.page_size
    pub = ZmqPublisher(
        cache,
        "tcp://127.0.0.1:*",
        topic="kv",
        block_hash=block_hash,
        replay_endpoint="tcp://127.0.0.1:*",
    )
    sub, decoder = subscriber(pub.endpoint, "kv")
    try:
        slow_join(pub, sub, decoder)
        first_seq = pub._seq
        # A workload that publishes, shares, branches, evicts under pressure, and resets.
        rng = np.random.default_rng(0)
        system = list(range(1000, 1064))
        live = []
        for turn in range(60):
            ns = "tenant-b" if turn % 7 == 3 else None
            prompt = system + [int(x) for x in rng.integers(0, 50, int(rng.integers(5, 60)))]
            if turn % 5 == 0:
                live.append(run(cache, prompt, ns, finish=False))  # pinned for a while
            else:
                run(cache, prompt, ns)
            if len(live) > 2:
                cache.finish(live.pop(0))
            if turn == 45:
                cache.evict(5)
            if turn == 15:
                for r in live:
                    cache.finish(r)
                live = []
                cache.reset()
            if turn % 3 == 0:
                pub.publish()
        pub.publish()
        last_seq = pub._seq - 1
        batches = receive_all(sub, decoder, last_seq)
        assert [s for s, _ in batches] == list(range(first_seq, last_seq + 1))  # none lost

        # Rebuild: key -> (prefix tokens, namespace), from the wire alone.
        blocks = {}
        cleared = removed_after_clear = 0
        for _, batch in batches:
            for ev in batch.events:
                name = type(ev).__name__
                if name == "BlockStored":
                    assert ev.block_size == p and len(ev.token_ids) == p * len(ev.block_hashes)
                    if ev.parent_block_hash is None:
                        prefix, ns = [], None
                        if ev.extra_keys and ev.extra_keys[0]:
                            ns = ev.extra_keys[0][0]
                    else:
                        prefix, ns = blocks[ev.parent_block_hash]
                        prefix = list(prefix)
                    for i, h in enumerate(ev.block_hashes):
                        prefix = prefix + ev.token_ids[i * p : (i + 1) * p]
                        blocks[h] = (prefix, ns)
                elif name == "BlockRemoved":
                    for h in ev.block_hashes:
                        del blocks[h]  # only what was stored is removed
                    removed_after_clear += cleared
                else:
                    blocks.clear()
                    cleared += 1
        assert cleared == 1 and removed_after_clear > 0  # evictions after the reset too
        # Every block's hash is what a router computes from its tokens.
        assert any(ns == "tenant-b" for _, ns in blocks.values())
        for h, (prefix, ns) in blocks.items():
            if block_hash == "blake3":
                assert h == radixkv.block_hashes(prefix, p, ns)[-1]
            else:
                assert h == radixkv.block_hashes(prefix, p, ns, algorithm="sha256_cbor")[-1]
                assert h == vllm_reference(prefix, p, ns, "0")[-1]
        # The set is the cache's own: every block is served, and there are as many as the cache
        # holds (nothing is pinned now, so every cached page is evictable).
        for r in live:
            cache.finish(r)
        pub.publish()
        tail = receive_all(sub, decoder, pub._seq - 1) if pub._seq - 1 > last_seq else []
        for _, batch in tail:
            for ev in batch.events:
                assert type(ev).__name__ == "BlockRemoved"
                for h in ev.block_hashes:
                    del blocks[h]
        assert cache.stats.used_pages == 0
        assert len(blocks) == cache.stats.evictable_pages > 0
        assert cached_keys_by_probe(cache, blocks) == set(blocks)

        # Replay: a late subscriber asks for everything from first_seq on.
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", first_seq.to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert [s for s, _ in replayed] == [s for s, _ in batches + tail]
        assert [decoder.decode(b) for _, b in replayed] == [b for _, b in batches + tail]
        dealer.close(linger=0)
    finally:
        pub.close()
        sub.close(linger=0)
    cache.check()


def test_publisher_checks_its_arguments():
    cache = radixkv.BlockCache(8, 4)
    with pytest.raises(ValueError, match=r"block_hash must be 'blake3' or 'sha256_cbor'.*got 'x'"):
        ZmqPublisher(cache, "tcp://127.0.0.1:*", block_hash="x")
    with pytest.raises(ValueError, match="endpoint must be a ZeroMQ address"):
        ZmqPublisher(cache, "127.0.0.1:5557")
    with pytest.raises(ValueError, match="layout must be 'array' or 'map', got 'json'"):
        ZmqPublisher(cache, "tcp://127.0.0.1:*", layout="json")
    with pytest.raises(TypeError, match="cache must be a radixkv"):
        ZmqPublisher(object(), "tcp://127.0.0.1:*")


def test_map_layout_and_int_hashes():
    cache = radixkv.RadixCache(64, 4)
    pub = ZmqPublisher(cache, "tcp://127.0.0.1:*", layout="map", int_hashes=True, topic="t")
    sub, decoder = subscriber(pub.endpoint, "t", layout="map")
    try:
        slow_join(pub, sub, decoder)
        run(cache, list(range(12)))
        pub.publish()
        ((_, batch),) = receive_all(sub, decoder, pub._seq - 1)
        (ev,) = batch.events
        keys = radixkv.block_hashes(list(range(12)), 4)
        assert ev.block_hashes == [int.from_bytes(k[-8:], "big") for k in keys]
        raw = msgspec.msgpack.decode(pub._buffer[-1][1])
        assert raw["events"][0]["type"] == "BlockStored" and raw["data_parallel_rank"] == 0
    finally:
        pub.close()
        sub.close(linger=0)


def test_recording_cost(capsys):
    """Admit+finish of a cached 2,048-token prompt with recording off and on (printed)."""
    cache = radixkv.RadixCache(8192, 1)
    prompt = np.arange(2048, dtype=np.uint32)
    run(cache, prompt)

    def per_call(n=2000):
        t = time.perf_counter()
        for _ in range(n):
            cache.finish(cache.admit(prompt))
        return (time.perf_counter() - t) / n

    off = min(per_call() for _ in range(3))
    cache.record_events(True)
    on = min(per_call() for _ in range(3))
    assert cache.drain_events() == []  # a fully cached prompt publishes nothing
    with capsys.disabled():
        print(
            f"\nadmit+finish, cached 2048 tokens: events off {off * 1e6:.2f} us, "
            f"on {on * 1e6:.2f} us"
        )


def test_missing_extra_is_named():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['zmq'] = None\n"
        "import radixkv\n"
        "radixkv.block_hashes([1, 2], 1, algorithm='sha256_cbor')\n"
        "try:\n"
        "    import radixkv.events\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "radixkv.events needs pyzmq and msgspec: pip install 'radixkv[events]'" in out.stdout


def test_one_name_for_radixkv_block_keys():
    """``block_hash`` takes ``radixkv.block_hashes``' algorithm names; ``"radixkv"``, the name the
    design gives the same keys, is the same value and reads back as "blake3", without a warning."""
    import warnings

    cache = radixkv.BlockCache(8, 4)
    pub = ZmqPublisher(cache, "tcp://127.0.0.1:*")
    try:
        assert pub.block_hash == "blake3"
        assert set(radixkv.events.BLOCK_HASHES) == {"blake3", "sha256_cbor"}
        for name in radixkv.events.BLOCK_HASHES:  # each is an algorithm of block_hashes
            assert len(radixkv.block_hashes([1, 2, 3, 4], 4, algorithm=name)) == 1
    finally:
        pub.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither name warns
        for name in ("radixkv", "blake3"):
            p = ZmqPublisher(cache, "tcp://127.0.0.1:*", block_hash=name)
            try:
                assert p.block_hash == "blake3"
            finally:
                p.close()
    with pytest.raises(ValueError, match="'blake3' or 'sha256_cbor'"):
        ZmqPublisher(cache, "tcp://127.0.0.1:*", block_hash="md5")


WINDOW_CACHES = [
    pytest.param(lambda: radixkv.RadixCache(400, 1, window=8, window_pages=40), id="radix-p1"),
    pytest.param(lambda: radixkv.RadixCache(120, 4, window=8, window_pages=14), id="radix-p4"),
    pytest.param(lambda: radixkv.BlockCache(120, 4, window=8, window_pages=14), id="block-p4"),
]


def predicted_hit(full, window, tokens, p, w, algorithm):
    """The hit a router computes from the two groups' blocks: the longest prefix whose blocks
    group 0 holds and whose last window's blocks group 1 holds (tokens[:-1], whole pages)."""
    limit = (len(tokens) - 1) // p * p
    keys = radixkv.block_hashes(tokens[:limit], p, None, algorithm=algorithm)
    m = 0
    while m < len(keys) and keys[m] in full:
        m += 1
    for k in range(m, -1, -1):
        lo = min(max(0, k * p + 1 - w) // p, k)
        if all(h in window for h in keys[lo:k]):
            return k * p
    raise AssertionError("k = 0 always holds")


@pytest.mark.parametrize("block_hash", ["blake3", "sha256_cbor"])
@pytest.mark.parametrize("make_cache", WINDOW_CACHES)
def test_window_group_events_let_a_router_predict_every_hit(make_cache, block_hash):
    """Over the wire, a cache with a window group publishes two vLLM KV cache groups; a router
    that keeps both predicts every hit the window rule allows, under eviction of window pages."""
    cache = make_cache()
    p, w = cache.page_size, cache.window
    pub = ZmqPublisher(cache, "tcp://127.0.0.1:*", topic="kv", block_hash=block_hash)
    sub, decoder = subscriber(pub.endpoint, "kv")
    groups = {0: set(), 1: set()}
    kinds = set()

    def consume():
        if not pub.publish():
            return
        for _, batch in receive_all(sub, decoder, pub._seq - 1):
            for ev in batch.events:
                name = type(ev).__name__
                if name == "BlockStored":
                    kinds.add(
                        (ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
                    )
                    groups[ev.group_idx].update(ev.block_hashes)
                elif name == "BlockRemoved":
                    for h in ev.block_hashes:
                        groups[ev.group_idx].remove(h)  # only what was stored is removed
                else:
                    groups[0].clear()
                    groups[1].clear()

    try:
        slow_join(pub, sub, decoder)
        consume()
        rng = np.random.default_rng(3)
        sessions = [[int(x) for x in rng.integers(0, 99, 10)] for _ in range(5)]
        for turn in range(80):
            s = int(rng.integers(0, len(sessions)))
            t = list(sessions[s])
            if turn % 9 == 4:
                t = t[: len(t) // 2]  # a branch from inside the session
            t += [int(x) for x in rng.integers(100, 200, int(rng.integers(1, 7)))]
            if len(t) > 40:
                t = [int(x) for x in rng.integers(0, 99, 10)]  # a new session
            if turn % 4 == 0:
                consume()
                assert predicted_hit(groups[0], groups[1], t, p, w, block_hash) == (
                    cache.match_prefix(t)
                ), f"turn {turn}"
            run(cache, t)
            sessions[s] = t
        consume()
        assert cache.stats.window_evicted_pages > 0  # the window pool evicted
        assert len(groups[1]) == cache.stats.window_evictable_pages
        assert kinds == {(0, "full_attention", None), (1, "sliding_window", w)}
        cache.reset()
        consume()
        assert not groups[0] and not groups[1]
    finally:
        pub.close()
        sub.close(linger=0)
    cache.check()


def test_no_group_fields_without_a_window_group():
    cache = radixkv.RadixCache(50, 4)
    pub = ZmqPublisher(cache, "inproc://no-groups", topic="kv")
    try:
        run(cache, list(range(20)))
        events = pub._convert(cache.drain_events())
        assert events and all(ev.group_idx is None for ev in events)
        assert b"full_attention" not in msgspec.msgpack.encode(events)
    finally:
        pub.close()


@pytest.mark.parametrize("layout", ["array", "map"])
def test_a_hinted_prompt_reports_its_key_and_vllms_decoder_reads_on(layout):
    """``pub.hint(prompt, namespace, key)``: the prompt's blocks not cached yet carry the key
    hashed with the namespace, the rest of the stream none; a decoder of vLLM's structs (no
    ``prompt_cache_key``) decodes every batch of either layout to the same other fields."""
    from radixkv.events import prompt_cache_key_hash

    cache = radixkv.RadixCache(64, 4)
    pub = ZmqPublisher(cache, "inproc://hinted-" + layout, layout=layout)
    vllm = vllm_decoder(layout)
    try:
        run(cache, list(range(1, 9)), "t")  # two pages cached before the hinted request
        assert pub.hint(list(range(1, 21)), "t", "k") == 3, "the three uncached pages"
        req = run(cache, list(range(1, 21)), "t", finish=False)
        cache.extend(req, [7, 7, 7, 7])  # the reply's page: not the prompt's
        cache.commit(req, req.num_tokens)
        cache.finish(req)
        run(cache, list(range(50, 62)), "t")  # no hint
        pub.publish()
        payload = pub._buffer[-1][1]
        ours = msgspec.msgpack.Decoder(event_types(layout)["KVEventBatch"]).decode(payload)
        theirs = vllm.decode(payload)
        got = [(e.token_ids, e.prompt_cache_key) for e in ours.events]
        value = prompt_cache_key_hash("k", "t")
        assert got == [
            (list(range(1, 9)), None),
            (list(range(9, 21)), value),
            ([7, 7, 7, 7], None),
            (list(range(50, 62)), None),
        ]
        assert all(same_fields(x, y) for x, y in zip(ours.events, theirs.events, strict=True))
        assert value != prompt_cache_key_hash("k", "u") != prompt_cache_key_hash("k", None)
    finally:
        pub.close()
