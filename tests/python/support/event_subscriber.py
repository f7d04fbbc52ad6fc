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
