"""A planned step builds nothing on the device until it is used: a decode step that a CUDA graph
replays reads its plan from fixed buffers, so ``KVCache.plan`` makes no device tensor and runs
no torch operation; the first attention builds the step's tensors (two pinned, non-blocking
copies on CUDA) and backend groups, and the step then attends as before."""

from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

import radixkv
from tiny_model import dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=3)


class TorchCalls(TorchFunctionMode):
    """Every torch function and tensor method called while active (tensor constructions on the
    device among them: ``from_numpy`` alone is invisible, and makes no copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def decode_step(kv, cache, rng, n=3):
    reqs = [cache.admit(ids(rng, 5 + 4 * i)) for i in range(n)]
    step = kv.plan(reqs)
    MODEL(step)
    kv.commit(step)
    for r in reqs:
        cache.extend(r, [7])
    return reqs


def test_a_plan_runs_no_torch_operation_until_used():
    cache = radixkv.RadixCache(128, page_size=4)
    kv = MODEL.make_kv_cache(cache)
    reqs = decode_step(kv, cache, np.random.default_rng(0))
    with TorchCalls() as mode:
        step = kv.plan(reqs)
    assert mode.calls == []
    assert not step.built and "input_ids" not in step.__dict__
    assert step.is_decode and step.num_tokens == 3  # the host side is there
    logits = MODEL(step)  # the first attention builds it
    assert step.built and step.backends
    assert step.block_table.shape == (3, step.max_pages)
    kv.commit(step)
    assert logits.shape[0] == 3


def test_an_attribute_set_before_the_build_is_kept():
    """The engine points ``last_token_index`` at a draft's rows before the forward."""
    cache = radixkv.RadixCache(128, page_size=4)
    kv = MODEL.make_kv_cache(cache)
    rng = np.random.default_rng(1)
    reqs = [cache.admit(ids(rng, n)) for n in (5, 7)]
    every = MODEL(kv.plan(reqs), all_logits=True)  # writes the same K/V as the step below
    step = kv.plan(reqs)
    rows = torch.tensor([1, 9])
    step.last_token_index = rows
    logits = MODEL(step)
    assert step.built and step.last_token_index is rows
    assert torch.allclose(logits, every[rows], atol=1e-5)
    assert not torch.allclose(logits, every[[4, 11]], atol=1e-2)  # not the default rows
    kv.commit(step)


def test_a_lazily_built_step_decodes_as_before():
    cache = radixkv.RadixCache(256, page_size=4)
    kv = MODEL.make_kv_cache(cache)
    eng = radixkv.Engine(MODEL, kv, max_batch=4)
    rng = np.random.default_rng(2)
    prompts = [ids(rng, n) for n in (6, 13, 3)]
    got = [r.output for r in eng.generate(prompts, max_new_tokens=6)]
    assert got == [dense_greedy(MODEL, p, 6) for p in prompts]
