"""A step used after its requests changed raises ``StaleStepError`` and writes nothing; a cache
whose core panicked refuses every later call.

A stale step's slots may belong to pages published since (a commit) or handed to another
request (a finish or abort): writing them would serve overwritten KV to the next hit.
"""

from __future__ import annotations

import numpy as np
import pytest

import radixkv

pytestmark = pytest.mark.robust

torch = pytest.importorskip("torch")

L, H, D = 2, 2, 8


def setup(page_size: int = 1):
    cache = radixkv.RadixCache(64, page_size=page_size)
    kv = radixkv.KVCache(cache, num_layers=L, num_kv_heads=H, head_dim=D)
    return cache, kv


def qkv(t: int, value: float = 1.0):
    x = torch.full((t, H, D), value)
    return x, x, x


def write(kv, step, value: float = 1.0):
    for layer in range(L):
        step.attention(layer, *qkv(step.num_tokens, value))


def changes():
    """(name, what it does to the planned request r of cache c)."""
    return [
        ("committed", lambda c, kv, s, r: kv.cache.commit(r, r.num_tokens)),
        ("extended", lambda c, kv, s, r: c.extend(r, [7])),
        ("finished or aborted", lambda c, kv, s, r: (c.commit(r, r.num_tokens), c.finish(r))),
        ("finished or aborted", lambda c, kv, s, r: c.abort(r)),
    ]


@pytest.mark.parametrize("name,change", changes(), ids=["commit", "extend", "finish", "abort"])
def test_attention_on_a_stale_step_raises_and_writes_nothing(name, change):
    cache, kv = setup()
    prompt = list(range(10, 18))
    r = cache.admit(prompt)
    step = kv.plan([r])
    write(kv, step, 1.0)
    before = [k.clone() for k in kv.k]
    change(cache, kv, step, r)
    with pytest.raises(radixkv.StaleStepError, match=f"requests\\[0\\] was {name}") as e:
        step.attention(0, *qkv(step.num_tokens, 9.0))
    assert "Step(requests=1" in str(e.value) and "plan a new step" in str(e.value)
    assert isinstance(e.value, radixkv.InvalidRequest)
    for a, b in zip(before, kv.k):
        assert torch.equal(a, b), "a stale step wrote into the pool"
    cache.check()


def test_the_next_hit_after_a_stale_use_is_served_the_kv_written_by_its_step():
    cache, kv = setup(page_size=4)
    prompt = list(range(100, 116))
    r = cache.admit(prompt)
    step = kv.plan([r])
    write(kv, step, 1.0)
    kv.commit(step)
    cache.finish(r)
    with pytest.raises(radixkv.StaleStepError):
        write(kv, step, 5.0)  # would overwrite the published pages with 5.0
    hit = cache.admit([*prompt, 1])
    assert hit.num_cached == 16
    slots = torch.as_tensor(hit.slots[:16].astype(np.int64))
    assert torch.all(kv.k[0][slots] == 1.0) and torch.all(kv.v[1][slots] == 1.0)
    cache.abort(hit)


def test_a_step_is_current_until_its_requests_change():
    cache, kv = setup()
    a, b = cache.admit([1, 2, 3]), cache.admit([4, 5])
    step = kv.plan([a, b])
    other = cache.admit([9, 9, 9])  # a request outside the step changes nothing of it
    cache.abort(other)
    write(kv, step)
    step.check_current()
    kv.commit(step)
    with pytest.raises(radixkv.StaleStepError, match="requests\\[0\\] was committed"):
        step.check_current()
    for r in (a, b):
        cache.finish(r)


def test_committing_a_step_twice_or_after_a_change_raises():
    cache, kv = setup()
    r = cache.admit([1, 2, 3, 4])
    step = kv.plan([r])
    write(kv, step)
    kv.commit(step)
    with pytest.raises(radixkv.StaleStepError, match="was committed"):
        kv.commit(step)
    step = kv.plan([r]) if r.num_computed < r.num_tokens else None
    assert step is None  # nothing left to plan: the one commit counted once
    cache.extend(r, [5])
    step = kv.plan([r])
    cache.extend(r, [6])
    with pytest.raises(radixkv.StaleStepError, match="was extended"):
        kv.commit(step)
    assert r.num_computed == 4
    cache.abort(r)


def test_a_panic_in_the_core_breaks_the_cache_for_every_later_call():
    cache, kv = setup()
    live = cache.admit([1, 2, 3])
    with pytest.raises(radixkv.CorruptionError, match=r"forced by _panic_for_test.*broken"):
        cache._panic_for_test()
    calls = [
        lambda: cache.admit([4, 5]),
        lambda: cache.match_prefix([1, 2]),
        lambda: cache.check(),
        lambda: cache.stats,
        lambda: cache.evict(1),
        lambda: cache.finish(live),
        lambda: live.num_tokens,
        lambda: kv.plan([live]),
    ]
    for call in calls:
        with pytest.raises(radixkv.CorruptionError, match="is broken"):
            call()
    calls.clear()
    live = None  # dropping an open request of a broken cache neither raises nor aborts
    assert live is None


def test_a_healthy_cache_is_untouched_by_another_ones_panic():
    broken, healthy = radixkv.RadixCache(8, page_size=1), radixkv.RadixCache(8, page_size=1)
    with pytest.raises(radixkv.CorruptionError):
        broken._panic_for_test()
    r = healthy.admit([1, 2])
    healthy.abort(r)
    healthy.check()
