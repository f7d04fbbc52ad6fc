"""KV events of a hybrid engine, as vLLM publishes a hybrid model's KV cache groups: the
attention pages in group 0 (``"full_attention"``), each recurrent-state snapshot one block of
group 1 (``"mamba"``) under the block hash of the page its prefix ends on, stored when it is
taken and removed when evicted. Decoded with vLLM's own field layout, they let a router
predict where the replica resumes each turn of a session re-sent whole.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5TextConfig"):  # requirements allow transformers 4.x
    pytest.skip(
        f"the hybrid families need transformers 5.x, found {transformers.__version__}",
        allow_module_level=True,
    )
pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import radixkv  # noqa: E402
import radixkv.hf  # noqa: E402
from event_subscriber import receive_all, slow_join, subscriber, vllm_decoder  # noqa: E402
from radixkv.events import ZmqPublisher  # noqa: E402
from tiny_hybrid import VOCAB, build  # noqa: E402

NEW = 4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Router:
    """What a router that follows vLLM's hybrid groups knows of one replica."""

    def __init__(self) -> None:
        self.groups: dict[int, set[Any]] = {0: set(), 1: set()}
        self.kinds: set[tuple[int, str | None]] = set()
        self.state_blocks: list[tuple[Any, list[int], int]] = []

    def apply(self, batch: Any) -> None:
        for ev in batch.events:
            name = type(ev).__name__
            if name == "BlockStored":
                self.kinds.add((ev.group_idx, ev.kv_cache_spec_kind))
                if ev.group_idx == 1:
                    assert ev.block_hashes[0] in self.groups[0], "a snapshot before its page"
                    self.state_blocks.append((ev.block_hashes[0], ev.token_ids, ev.block_size))
                self.groups[ev.group_idx].update(ev.block_hashes)
            elif name == "BlockRemoved":
                for h in ev.block_hashes:
                    self.groups[ev.group_idx].remove(h)  # only what was stored is removed
            else:
                self.groups[0].clear()
                self.groups[1].clear()

    def hit(self, prompt: list[int], hashes: list[Any]) -> int:
        """The tokens a replica resumes ``prompt`` at: the longest prefix (all tokens but the
        last at most) whose blocks group 0 holds and whose last block group 1 does."""
        n = len(prompt) - 1
        cached = next((i for i, h in enumerate(hashes[:n]) if h not in self.groups[0]), n)
        return next((k for k in range(cached, 0, -1) if hashes[k - 1] in self.groups[1]), 0)


@pytest.mark.parametrize("block_hash", ["blake3", "sha256_cbor"])
def test_snapshots_are_the_mamba_groups_blocks_where_each_turn_ends(block_hash):
    model = build("qwen3_5")
    cache = radixkv.RadixCache(256, page_size=1, state_slots=3)
    eng = radixkv.hf.engine(model, cache, token_budget=64)
    pub = ZmqPublisher(cache, "tcp://127.0.0.1:*", topic="kv", block_hash=block_hash)
    sub, _ = subscriber(pub.endpoint, "kv")
    vllm = vllm_decoder("array")  # vLLM's structs: no field of radixkv's own
    router = Router()

    def consume() -> None:
        if pub.publish():
            for _, batch in receive_all(sub, vllm, pub._seq - 1):
                router.apply(batch)

    def keys(seq: list[int]) -> list[Any]:
        return radixkv.block_hashes(seq, 1, None, algorithm=block_hash)

    try:
        slow_join(pub, sub, vllm)
        consume()
        sessions = [tokens(10, seed=70 + s) for s in range(3)]
        ends = []
        predicted = 0
        for s in [0, 0, 0, 1, 1, 2, 0, 1]:
            prompt = sessions[s]
            predicted_hit = router.hit(prompt, keys(prompt))
            assert predicted_hit == cache.match_prefix(prompt)
            (r,) = eng.generate([prompt], max_new_tokens=NEW)
            assert r.cached_tokens == predicted_hit
            predicted += predicted_hit > 0
            consume()
            whole = prompt + r.output[:-1]  # the last output token's KV is never computed
            ends.append((keys(prompt)[-1], keys(whole)[-1], whole[-1]))
            sessions[s] = prompt + r.output + tokens(3, seed=80 + len(ends))
        assert router.kinds == {(0, "full_attention"), (1, "mamba")}
        # Every request's prompt end and request end was announced as one block of group 1,
        # the block its prefix ends on, with that block's token.
        stored = {h: (toks, size) for h, toks, size in router.state_blocks}
        for prompt_end, request_end, last in ends:
            assert prompt_end in stored
            assert stored[request_end] == ([last], 1)
        assert predicted >= 3, "turns re-sent whole resumed where a snapshot was"
        st = cache.stats
        assert st.evicted_states > 0, "3 slots for 3 sessions: snapshots were evicted"
        assert len(router.groups[1]) == st.state_slots - st.state_free_slots
        cache.reset()
        consume()
        assert not router.groups[0] and not router.groups[1]
    finally:
        pub.close()
        sub.close(linger=0)
    cache.check()


def test_a_cache_with_state_slots_tags_its_pages_group_0_and_removals_their_group():
    cache = radixkv.RadixCache(8, page_size=2, state_slots=2)
    pub = ZmqPublisher(cache, "inproc://hybrid-groups", topic="kv")
    try:
        t = list(range(1, 9))
        r = cache.admit(t)
        assert cache.take_state(r, 4) is not None
        cache.commit(r, 8)
        cache.finish(r)
        events = pub._convert(cache.drain_events())
        assert [(type(e).__name__, e.group_idx, e.kv_cache_spec_kind) for e in events] == [
            ("BlockStored", 0, "full_attention"),
            ("BlockStored", 1, "mamba"),
        ]
        state = events[1]
        want = radixkv.block_hashes(t[:4], 2)
        assert (state.block_hashes, state.parent_block_hash) == ([want[1]], want[0])
        assert (state.token_ids, state.block_size) == ([3, 4], 2)
        cache.evict(4)  # every page: the snapshot goes with its pages
        events = pub._convert(cache.drain_events())
        assert [(type(e).__name__, e.group_idx) for e in events] == [
            ("BlockRemoved", 0),
            ("BlockRemoved", 1),
        ]
        assert events[1].block_hashes == [want[1]]
    finally:
        pub.close()
