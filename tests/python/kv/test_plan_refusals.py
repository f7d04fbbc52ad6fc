"""KVCache.plan refuses what would corrupt KV; KVCache.commit commits a whole step or nothing."""

from __future__ import annotations

import pytest
import torch

import radixkv
from radixkv.kv import KVCache

pytestmark = pytest.mark.robust

CACHES = [radixkv.RadixCache, radixkv.BlockCache]


def _kv(cls: type) -> KVCache:
    return KVCache(cls(64, 4), num_layers=1, num_kv_heads=1, head_dim=8)


@pytest.mark.parametrize("cls", CACHES)
def test_plan_refuses_a_request_of_another_cache(cls: type) -> None:
    kv, other = _kv(cls), _kv(cls)
    mine = kv.cache.admit([1, 2, 3])
    theirs = other.cache.admit([4, 5, 6])
    with pytest.raises(ValueError, match=r"requests\[0\] belongs to another cache"):
        kv.plan([theirs])
    with pytest.raises(ValueError, match=r"requests\[1\] belongs to another cache"):
        kv.plan([mine, theirs])
    assert mine.num_computed == 0 and theirs.num_computed == 0


@pytest.mark.parametrize("cls", CACHES)
def test_plan_refuses_duplicates(cls: type) -> None:
    kv = _kv(cls)
    a, b = kv.cache.admit([1, 2, 3]), kv.cache.admit([7, 8])
    with pytest.raises(ValueError, match=r"requests\[2\] repeats requests\[0\]"):
        kv.plan([a, b, a])
    with pytest.raises(ValueError, match=r"requests\[1\] repeats requests\[0\]"):
        radixkv.plan_step([b, b])
    with pytest.raises(TypeError, match=r"requests\[1\] must be a Request"):
        kv.plan([a, "b"])
    assert kv.plan([a, b]).num_tokens == 5


@pytest.mark.parametrize("cls", CACHES)
def test_commit_is_whole_or_nothing(cls: type) -> None:
    kv = _kv(cls)
    reqs = [kv.cache.admit(list(range(i, i + 9))) for i in (0, 100, 200)]
    step = kv.plan(reqs)
    t, h, d = step.num_tokens, 1, 8
    step.attention(0, torch.randn(t, h, d), torch.randn(t, h, d), torch.randn(t, h, d))
    kv.cache.abort(reqs[2])
    with pytest.raises(radixkv.InvalidRequest):
        kv.commit(step)
    assert [r.num_computed for r in reqs[:2]] == [0, 0]
    assert kv.cache.match_prefix(list(range(9))) == 0
    kv.cache.check()
