"""The SDPA backend's decode mirror (radixkv.kv.backends.mirror) is exact: random walks of
admissions,
hits, forks, decodes, multi-token extensions, uncommitted and out-of-order steps, run on twin
caches with the mirror on, off, and squeezed by a small budget, give bitwise equal attention.
Also: lanes stay packed, a request is still aborted when dropped, bad arguments are named."""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch

import radixkv
from tiny_model import CACHES, VOCAB

HQ, HKV, D, LAYERS = 4, 2, 8, 3
SINKS = torch.linspace(-1.0, 1.0, HQ)


class Twins:
    """The same cache configuration three times: mirror on (default), off, and a budget of
    ``small`` rows that forces the gather (and empties the mirror) on larger groups."""

    def __init__(self, make_cache, small: int = 96):
        self.kvs = []
        for mirror in (None, 0, small):
            cache = make_cache(2048)
            self.kvs.append(
                radixkv.KVCache(cache, LAYERS, HKV, D, attention="sdpa", decode_mirror=mirror)
            )
        self.caches = [kv.cache for kv in self.kvs]
        self.live: list[list] = []  # one request per twin

    def admit(self, tokens) -> list:
        reqs = [c.admit(tokens) for c in self.caches]
        assert len({r.num_cached for r in reqs}) == 1
        self.live.append(reqs)
        return reqs

    def fork(self, reqs) -> list:
        kids = [c.fork(r) for c, r in zip(self.caches, reqs)]
        self.live.append(kids)
        return kids

    def close(self, reqs, how: str) -> None:
        for c, r in zip(self.caches, reqs):
            getattr(c, how)(r)
        self.live.remove(reqs)

    def extend(self, reqs, tokens) -> None:
        for c, r in zip(self.caches, reqs):
            c.extend(r, tokens)


def run_layers(steps, gen: torch.Generator, layers=range(LAYERS)) -> None:
    """Runs ``layers`` of the twin ``steps`` on the same random inputs; the outputs must be
    bitwise equal. Layer 1 has a softcap and sinks; layer 2 a window (the gather's path)."""
    t = steps[0].num_tokens
    for layer in layers:
        q = torch.randn(t, HQ, D, generator=gen)
        k = torch.randn(t, HKV, D, generator=gen)
        v = torch.randn(t, HKV, D, generator=gen)
        extra = {}
        if layer == 1:
            extra = {"softcap": 4.0, "sinks": SINKS}
        elif layer == 2:
            extra = {"window": 24}
        outs = [s.attention(layer, q, k, v, **extra) for s in steps]
        for o in outs[1:]:
            assert torch.equal(outs[0], o), f"layer {layer}: mirror and gather differ"


def lanes_used(step) -> bool:
    return any(
        isinstance(g.state, dict) and g.state.get("lanes") is not None for _, g in step._groups
    )


@pytest.mark.parametrize("make_cache", CACHES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_walks_are_bitwise_equal_with_the_mirror_on_off_and_squeezed(make_cache, seed):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    tw = Twins(make_cache)
    tok = lambda n: rng.integers(0, VOCAB, n)  # noqa: E731
    served = decode_steps = 0
    for _ in range(120):
        roll = rng.random()
        if len(tw.live) < 2 or (roll < 0.08 and len(tw.live) < 9):
            if tw.live and rng.random() < 0.5:  # a hit on a live request's prefix
                base = tw.live[rng.integers(len(tw.live))][0].tokens
                tw.admit(np.concatenate([base[: rng.integers(1, len(base) + 1)], tok(3)]))
            else:
                tw.admit(tok(int(rng.integers(5, 40))))
            continue
        if roll < 0.12 and len(tw.live) < 9:
            parent = tw.live[rng.integers(len(tw.live))]
            if parent[0].num_computed == parent[0].num_tokens:
                kids = tw.fork(parent)
                tw.extend(kids, tok(1))
            continue
        if roll < 0.16:
            tw.close(tw.live[rng.integers(len(tw.live))], "finish" if roll < 0.14 else "abort")
            continue
        for reqs in tw.live:  # every computed request gets its next token (or a tool's output)
            if reqs[0].num_computed == reqs[0].num_tokens:
                tw.extend(reqs, tok(1 if rng.random() < 0.9 else int(rng.integers(2, 9))))
        pick = [r for r in tw.live if rng.random() < 0.85] or tw.live[:1]
        batch = [[r[i] for r in pick] for i in range(3)]
        steps = [kv.plan(b) for kv, b in zip(tw.kvs, batch)]
        decode_steps += steps[0].is_decode
        served += lanes_used(steps[0])
        how = rng.random()
        if how < 0.1:  # two plans of one state, run in either order, either one committed
            sub = rng.permutation(len(pick))[: int(rng.integers(1, len(pick) + 1))]
            newer = [kv.plan([b[i] for i in sub]) for kv, b in zip(tw.kvs, batch)]
            part = range(int(rng.integers(1, LAYERS + 1)))
            if rng.random() < 0.5:
                run_layers(steps, gen)
                run_layers(newer, gen, layers=part)
            else:  # the pool ends with the older step's rows, the lanes with the newer's
                run_layers(newer, gen, layers=part)
                run_layers(steps, gen)
            keep = steps if rng.random() < 0.5 else newer
            for kv, s in zip(tw.kvs, keep):
                kv.commit(s)
            continue
        run_layers(steps, gen)
        if how < 0.18:
            continue  # not committed: the next step computes these rows again
        if how < 0.24:  # committed outside KVCache.commit: the mirror must not trust the rows
            for kv, s in zip(tw.kvs, steps):
                kv.cache.commit_many(s.requests, s.kv_len_list)
            continue
        for kv, s in zip(tw.kvs, steps):
            kv.commit(s)
    assert decode_steps >= 10 and served >= decode_steps // 2, (decode_steps, served)
    on, off, small = tw.kvs
    assert on.mirror.nbytes > 0 and off.mirror.nbytes == 0
    assert small.mirror.lanes * small.mirror.capacity <= 96
    for reqs in list(tw.live):
        tw.close(reqs, "finish")
    for c in tw.caches:
        c.check()


def test_a_window_layer_past_its_window_writes_around_the_lanes_and_shortens_them():
    tw = Twins(CACHES[0].values[0])
    gen = torch.Generator().manual_seed(3)
    a, b = tw.admit(np.arange(10)), tw.admit(np.arange(30) + 50)

    def step(batch, commit=True):
        steps = [kv.plan([r[i] for r in batch]) for i, kv in enumerate(tw.kvs)]
        run_layers(steps, gen)
        if commit:
            for kv, s in zip(tw.kvs, steps):
                kv.commit(s)
        return steps[0]

    step([a, b])
    tw.extend(a, [1])
    assert lanes_used(step([a], commit=False))  # 11 keys: layer 2's window of 24 is off
    tw.extend(b, [2])
    step([a, b])  # 31 keys: layer 2 attends its window, through the gather, row 10 again
    tw.extend(a, [3])
    assert lanes_used(step([a]))  # layer 2 through the lanes, which must not hold the old row
    for reqs in list(tw.live):
        tw.close(reqs, "finish")


def test_lanes_stay_packed_and_follow_the_group():
    cache = radixkv.RadixCache(4096, page_size=4)
    kv = radixkv.KVCache(cache, 1, HKV, D, attention="sdpa")
    gen = torch.Generator().manual_seed(0)
    reqs = [cache.admit(np.arange(10 + 3 * i) + 100 * i) for i in range(5)]

    def step(batch):
        for r in batch:
            if r.num_computed == r.num_tokens:
                cache.extend(r, [7])
        s = kv.plan(batch)
        t = s.num_tokens
        s.attention(0, torch.randn(t, HQ, D, generator=gen), *torch.randn(2, t, HKV, D))
        kv.commit(s)
        return s

    step(reqs)  # the prefill: no lanes
    assert kv.mirror.lanes == 0
    s = step(reqs)
    lanes = s._groups[0][1].state["lanes"]
    assert sorted(lanes.lane_of.tolist()) == [0, 1, 2, 3, 4]
    assert kv.mirror.lanes == 8  # a power of two: room for the group to grow
    s = step([reqs[4], reqs[1]])  # lanes 4 and 1 -> the one past the group moves below 2
    lanes = s._groups[0][1].state["lanes"]
    assert sorted(lanes.lane_of.tolist()) == [0, 1] and lanes.lane_of[1] == 1
    assert [r is not None for r in kv.mirror._refs].count(True) == 2
    # The moved lane holds its request's keys: the next step copies no row from the pool.
    filled = []
    orig = kv.mirror._fill
    kv.mirror._fill = lambda *a: filled.append(a[2]) or orig(*a)
    step([reqs[4], reqs[1]])
    assert filled == []
    for r in reqs:
        cache.finish(r)


def plain_layers(steps, gen: torch.Generator, layers=range(LAYERS), window_layer=None) -> None:
    """Like :func:`run_layers` without softcaps and sinks: every layer through the lanes
    (``window_layer``: that one with a window of 4 keys, written around them)."""
    t = steps[0].num_tokens
    for layer in layers:
        q = torch.randn(t, HQ, D, generator=gen)
        k = torch.randn(t, HKV, D, generator=gen)
        v = torch.randn(t, HKV, D, generator=gen)
        extra = {"window": 4} if layer == window_layer else {}
        outs = [s.attention(layer, q, k, v, **extra) for s in steps]
        for o in outs[1:]:
            assert torch.equal(outs[0], o), f"layer {layer}: mirror and gather differ"


@pytest.mark.parametrize("lengths", [(12, 12, 12), (5, 17, 9, 30)])
def test_a_steady_decode_shifts_its_last_plan_and_stays_exact(lengths):
    """A decode loop's plans after the first reuse the last one shifted by a row (no lane
    plan computed again); uncommitted, partial and window steps, and a smaller group, fall
    back to planning anew; attention stays bitwise equal to the gather's throughout."""
    tw = Twins(CACHES[0].values[0])
    gen = torch.Generator().manual_seed(4)
    batch = [tw.admit(np.arange(n) + 100 * i) for i, n in enumerate(lengths)]
    mirror = tw.kvs[0].mirror
    computed, filled = [], []
    orig, orig_fill = mirror._lanes, mirror._fill
    mirror._lanes = lambda *a: computed.append(1) or orig(*a)
    mirror._fill = lambda *a: filled.append(a[0]) or orig_fill(*a)  # the layer

    def step(group, commit=True, layers=range(LAYERS), window_layer=None, grow=True):
        if grow:
            for reqs in group:
                if reqs[0].num_computed == reqs[0].num_tokens:
                    tw.extend(reqs, [int(reqs[0].num_tokens) % VOCAB])
        steps = [kv.plan([r[i] for r in group]) for i, kv in enumerate(tw.kvs)]
        plain_layers(steps, gen, layers, window_layer)
        if commit:
            for kv, s in zip(tw.kvs, steps):
                kv.commit(s)
        return steps[0]

    step(batch)  # the prefill
    for _ in range(40):  # past the rows made ahead (ROWS_AHEAD): they are made again
        assert lanes_used(step(batch))
    assert len(computed) == 1, "only the first decode step plans its lanes"
    assert filled == list(range(LAYERS)), "the first decode step fills each layer once"
    step(batch, commit=False)  # planned, run, not committed: the same tokens again
    step(batch, grow=False)
    assert len(computed) == 2
    step(batch, commit=False, layers=[0])  # one layer only, then the whole step again
    step(batch, grow=False)
    assert len(computed) == 3
    step(batch)  # steady again
    assert len(computed) == 3
    assert filled == list(range(LAYERS)), "the lanes kept what every step wrote"
    step(batch, window_layer=1)  # layer 1 written around the lanes (bypass)
    step(batch)
    assert len(computed) == 4
    assert filled == [*range(LAYERS), 1], "layer 1 lacked the bypassed row, and only it"
    step(batch[1:])  # a smaller group: packed again, then steady
    step(batch[1:])
    assert len(computed) == 5
    step(batch)
    step(batch)
    assert len(computed) == 6
    for reqs in list(tw.live):
        tw.close(reqs, "finish")


def test_a_request_dropped_while_it_holds_a_lane_is_still_aborted():
    cache = radixkv.RadixCache(256, page_size=1)
    kv = radixkv.KVCache(cache, 1, HKV, D, attention="sdpa")
    r = cache.admit(np.arange(12))
    for _ in range(2):
        s = kv.plan([r])
        t = s.num_tokens
        s.attention(0, torch.randn(t, HQ, D), torch.randn(t, HKV, D), torch.randn(t, HKV, D))
        kv.commit(s)
        cache.extend(r, [5])
    assert kv.mirror._lane, "the request holds a lane"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del r, s
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    assert cache.stats.used_pages == 0  # aborted: nothing pinned
    cache.check()


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, ValueError, "decode_mirror must be >= 0.*got -1"),
        (1.5, TypeError, "decode_mirror must be an int, got float"),
        (True, TypeError, "decode_mirror must be an int, got bool"),
        ("big", TypeError, "decode_mirror must be an int, got str"),
    ],
)
def test_bad_decode_mirror_is_named(value, error, match):
    cache = radixkv.RadixCache(64, page_size=1)
    with pytest.raises(error, match=match):
        radixkv.KVCache(cache, 1, HKV, D, decode_mirror=value)


def test_lanes_made_under_inference_mode_serve_a_step_outside_it():
    tw = Twins(CACHES[1].values[0])
    gen = torch.Generator().manual_seed(4)
    reqs = tw.admit(np.arange(9))
    for mode in (True, True, False, True, False):
        steps = [kv.plan([r]) for kv, r in zip(tw.kvs, reqs)]
        with torch.inference_mode(mode):
            run_layers(steps, gen)
        for kv, s in zip(tw.kvs, steps):
            kv.commit(s)
        tw.extend(reqs, [1])
    assert tw.kvs[0].mirror.nbytes > 0
    tw.close(reqs, "finish")
