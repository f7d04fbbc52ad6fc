"""A subscriber to radixkv's KV events on a loopback ZeroMQ socket, for the tests that read the
wire (the events' own tests, and the shared tier's, whose replicas publish them)."""

from __future__ import annotations

import msgspec
import zmq

from radixkv.events import event_types


def subscriber(endpoint, topic, layout="array"):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(event_types(layout)["KVEventBatch"])
    return sub, decoder


def vllm_decoder(layout="array"):
    """A decoder of vLLM's event structs as its ``kv_events.py`` declares them (``array_like``
    in its older versions, maps now), without radixkv's own trailing field: ``BlockStored``
    ends at ``kv_cache_spec_sliding_window``. Built with ``msgspec.defstruct``, so that it
    needs no annotations resolved in a module."""
    kw = dict(array_like=layout == "array", omit_defaults=True, gc=False)
    hashes = list[bytes | int]
    stored = msgspec.defstruct(
        "BlockStored",
        [
            ("block_hashes", hashes),
            ("parent_block_hash", bytes | int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("extra_keys", list[tuple | None] | None, None),
            ("group_idx", int | None, None),
            ("kv_cache_spec_kind", str | None, None),
            ("kv_cache_spec_sliding_window", int | None, None),
        ],
        tag=True,
        **kw,
    )
    removed = msgspec.defstruct(
        "BlockRemoved",
        [("block_hashes", hashes), ("medium", str | None), ("group_idx", int | None, None)],
        tag=True,
        **kw,
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], tag=True, **kw)
    batch = msgspec.defstruct(
        "KVEventBatch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),
            ("data_parallel_rank", int | None, None),
        ],
        **kw,
    )
    return msgspec.msgpack.Decoder(batch)


def same_fields(ours, theirs):
    """Whether every field of ``theirs`` (an event of :func:`vllm_decoder`) equals ``ours``'s."""
    return [getattr(ours, f) for f in theirs.__struct_fields__] == list(
        msgspec.structs.astuple(theirs)
    )


def receive_all(sub, decoder, want_seq):
    """Decoded batches until sequence number ``want_seq`` (inclusive) has arrived."""
    got = []
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while not got or got[-1][0] < want_seq:
        assert poller.poll(5000), "no event batch within 5 s"
        _, seq, payload = sub.recv_multipart()
        got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
    return got


def slow_join(pub, sub, decoder):
    """PUB/SUB drop what is sent before the subscription is in: probe until one arrives."""
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    for _ in range(100):
        pub.cache.record_events(True)
        r = pub.cache.admit([4_000_000_000, 1, 2, 3] * 8, b"probe")
        pub.cache.commit(r, r.num_tokens)
        pub.cache.finish(r)
        pub.cache.reset()
        pub.publish()
        if poller.poll(50):
            while poller.poll(50):
                sub.recv_multipart()
            return
    raise AssertionError("subscriber never joined")
