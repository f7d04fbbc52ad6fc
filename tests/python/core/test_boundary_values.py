"""Bad values at the boundary: the right error type, naming the argument and the value, and
nothing changed. ``bool`` is not a token id or a count; numpy integers are ints."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kv import KVCache

pytestmark = pytest.mark.robust

CACHES = [radixkv.RadixCache, radixkv.BlockCache]


@pytest.mark.parametrize("cls", CACHES)
def test_numpy_scalars_out_of_range_are_value_errors(cls: type) -> None:
    c = cls(16, 1)
    with pytest.raises(ValueError, match=r"tokens\[0\] = 9223372036854775808"):
        c.admit([np.uint64(2**63)])
    with pytest.raises(ValueError, match=r"tokens\[1\] = 4294967296"):
        c.admit([1, np.int64(2**32)])
    with pytest.raises(ValueError, match="num_pages must be >= 0, got -4"):
        cls(np.int64(-4))
    with pytest.raises(ValueError, match="num_pages must be >= 0, got -2"):
        c.evict(np.int64(-2))
    with pytest.raises(
        ValueError, match=re.escape("num_pages must be below 2**64, got 18446744073709551616")
    ):
        c.evict(2**64)
    assert c.evict(np.int64(3)) == 0
    assert cls(np.int32(5), np.uint8(2)).num_pages == 5
    r = c.admit(np.array([1, 2, 3], dtype=np.int64))
    c.commit(r, np.int64(2))
    assert r.num_computed == 2
    assert c.stats.queries == 1
    c.check()


@pytest.mark.parametrize("cls", CACHES)
def test_bool_is_not_a_token_or_a_count(cls: type) -> None:
    c = cls(16, 1)
    with pytest.raises(TypeError, match=r"tokens\[1\] must be an int, got bool"):
        c.admit([1, True])
    with pytest.raises(TypeError, match="num_pages must be an int, got bool"):
        c.evict(True)
    with pytest.raises(TypeError, match="num_pages must be an int, got bool"):
        cls(True)
    r = c.admit([1, 2])
    with pytest.raises(TypeError, match="num_computed must be an int, got bool"):
        c.commit(r, False)
    with pytest.raises(TypeError, match="tokens"):
        c.admit(np.array([True, False]))
    assert r.num_computed == 0 and c.stats.queries == 1


@pytest.mark.parametrize("cls", CACHES)
def test_bytearray_is_treated_like_bytes(cls: type) -> None:
    c = cls(16, 1)
    with pytest.raises(TypeError, match="tokenize text first"):
        c.admit(bytearray(b"ab"))
    with pytest.raises(TypeError, match="tokenize text first"):
        c.admit(b"ab")
    r = c.admit([1, 2, 3], namespace=b"t")
    c.commit(r, 3)
    c.finish(r)
    assert c.match_prefix([1, 2, 3], namespace=bytearray(b"t")) == 2


def test_scheduler_numbers_out_of_range_are_value_errors() -> None:
    c = radixkv.RadixCache(16)
    s = radixkv.Scheduler(c)
    with pytest.raises(ValueError, match="id must be >= 0, got -1"):
        s.cancel(-1)
    with pytest.raises(
        ValueError, match=re.escape("id must be below 2**64, got 18446744073709551616")
    ):
        s.cancel(2**64)
    with pytest.raises(TypeError, match="id must be an int, got bool"):
        s.cancel(True)
    assert s.cancel(np.uint64(2**64 - 1)) is False
    with pytest.raises(
        ValueError, match=re.escape("max_wait must be below 2**64, got 1180591620717411303424")
    ):
        radixkv.Scheduler(c, max_wait=2**70)
    with pytest.raises(ValueError, match="max_wait must be >= 0, got -1"):
        radixkv.Scheduler(c, max_wait=np.int64(-1))
    with pytest.raises(TypeError, match="priority must be an int, got bool"):
        s.add([1, 2], priority=True)
    with pytest.raises(ValueError, match=r"priority must be an int in .*, got 1099511627776"):
        s.add([1, 2], priority=2**40)
    assert len(s) == 0
    i = s.add([1, 2], priority=np.int8(-3), max_new_tokens=np.uint16(4))
    assert s.cancel(np.int64(i)) is True
    assert radixkv.Scheduler(c, max_wait=np.int64(5)).policy == "lpm"


def _step() -> tuple[KVCache, object]:
    kv = KVCache(radixkv.RadixCache(32), num_layers=2, num_kv_heads=1, head_dim=4)
    r = kv.cache.admit([1, 2, 3])
    return kv, kv.plan([r])


def test_attention_refuses_bad_layers_and_tensors() -> None:
    kv, step = _step()
    q = torch.randn(3, 1, 4)
    for layer in ("0", None, 0.5, True):
        with pytest.raises(TypeError, match="layer must be an int"):
            step.attention(layer, q, q, q)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 2\), got 2"):
        step.attention(2, q, q, q)
    with pytest.raises(
        TypeError, match=re.escape("q must be a floating-point tensor, got dtype torch.int64")
    ):
        step.attention(0, torch.ones(3, 1, 4, dtype=torch.int64), q, q)
    with pytest.raises(
        TypeError, match=re.escape("q must be a floating-point tensor, got dtype torch.bool")
    ):
        step.attention(0, torch.ones(3, 1, 4, dtype=torch.bool), q, q)
    with pytest.raises(TypeError, match=re.escape("k must be a torch.Tensor, got ndarray")):
        step.attention(0, q, np.zeros((3, 1, 4), dtype=np.float32), q)
    assert not kv.k[0].any() and not kv.v[0].any()
    out = step.attention(np.int64(1), q, q, q)
    assert out.shape == (3, 1, 4) and out.dtype == torch.float32
