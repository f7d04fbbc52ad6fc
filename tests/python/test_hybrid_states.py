"""The recurrent-state pool of hybrid models (radixkv.kv.state_pool): slots copied pairwise,
across dtypes, and refused with the bad value named and nothing written.
"""

from __future__ import annotations

import pytest
import torch

from radixkv.kv.state_pool import StatePool, StateSpec


def _pool(n_slots: int = 3, dtype: torch.dtype | None = None) -> StatePool:
    specs = [
        StateSpec(0, "conv", (4, 3), torch.float32),
        StateSpec(0, "recurrent", (2, 5), torch.float32),
    ]
    return StatePool(specs, n_slots, dtype=dtype)


def _fill(pool: StatePool) -> None:
    gen = torch.Generator().manual_seed(0)
    for spec in pool.specs:
        t = pool.tensor(spec.layer, spec.name)
        t.copy_(torch.randn(t.shape, generator=gen))


def test_a_pool_copies_slots_pairwise_and_leaves_the_rest():
    pool = _pool(4)
    _fill(pool)
    before = {s.name: pool.tensor(0, s.name).clone() for s in pool.specs}
    pool.copy([0, 1], [3, 2])
    for name, t in before.items():
        after = pool.tensor(0, name)
        assert torch.equal(after[3], t[0]) and torch.equal(after[2], t[1])
        assert torch.equal(after[:2], t[:2])
    assert pool.bytes_per_slot == (4 * 3 + 2 * 5) * 4
    assert pool.nbytes == 4 * pool.bytes_per_slot


def test_a_bf16_pool_holds_half_the_bytes_and_rounds_on_copy():
    pool, snaps = _pool(2), _pool(2, dtype=torch.bfloat16)
    _fill(pool)
    pool.copy(0, 1, into=snaps)
    snaps.copy(1, 1, into=pool)
    assert snaps.bytes_per_slot * 2 == pool.bytes_per_slot
    for spec in pool.specs:
        t = pool.tensor(0, spec.name)
        assert torch.equal(t[1], t[0].to(torch.bfloat16).float())
        assert not torch.equal(t[1], t[0])


@pytest.mark.parametrize(
    ("src", "dst", "error", "match"),
    [
        (0, 3, IndexError, "slot 3 is outside the pool's 3 slots"),
        ([0, -1], [1, 2], IndexError, "slot -1"),
        ([0, 1], [2], ValueError, "src has 2 slots but dst has 1"),
        ([0, 1], [2, 2], ValueError, "dst names a slot twice"),
        ([0.5], [1], ValueError, "slots must be ints, got 0.5"),
    ],
)
def test_a_bad_copy_names_the_bad_slot_and_writes_nothing(src, dst, error, match):
    pool = _pool()
    _fill(pool)
    before = [pool.tensor(0, s.name).clone() for s in pool.specs]
    with pytest.raises(error, match=match):
        pool.copy(src, dst)
    assert all(torch.equal(pool.tensor(0, s.name), b) for s, b in zip(pool.specs, before))


def test_a_pool_refuses_bad_specs_and_sizes():
    spec = StateSpec(0, "conv", (4, 3), torch.float32)
    with pytest.raises(ValueError, match="n_slots must be a positive int, got 0"):
        StatePool([spec], 0)
    with pytest.raises(ValueError, match=r"specs name the state \(0, 'conv'\) twice"):
        StatePool([spec, spec], 1)
    with pytest.raises(ValueError, match=r"torch\.int64"):
        StatePool([spec], 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="same states"):
        _pool().copy(0, 0, into=StatePool([spec], 1))
