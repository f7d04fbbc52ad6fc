"""radixkv.hf.engine under random batches: short and long prompts, shared prefixes, random token
budgets, batch sizes, page sizes and pools that evict, against transformers' ``generate`` on each
prompt alone (greedy tokens equal)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

import torch

import radixkv
import radixkv.hf
from hf_models import VOCAB, build_model, greedy_reference

torch.set_num_threads(1)

ARCHS = ["llama", "llama-yarn", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return build_model(request.param, seed=11)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_generate_alone(model, seed):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, int(rng.integers(1, 60))).astype(np.uint32)
    prompts = []
    for _ in range(int(rng.integers(2, 6))):
        n = int(rng.choice([rng.integers(1, 6), rng.integers(20, 120)]))
        own = rng.integers(0, VOCAB, n).astype(np.uint32)
        prompts.append(np.concatenate([shared, own]) if rng.random() < 0.6 else own)
    page = int(rng.choice([1, 4, 16]))
    # A pool between the largest request and all of them together: some runs evict.
    need = max(len(p) + 6 for p in prompts)
    total = sum(len(p) + 6 for p in prompts)
    pages = -(-int(rng.integers(need, total + 1)) // page) + 1
    cache = (
        radixkv.RadixCache(pages, page_size=page)
        if rng.random() < 0.5
        else radixkv.BlockCache(pages, page_size=page)
    )
    eng = radixkv.hf.engine(
        model,
        cache,
        token_budget=int(rng.integers(8, 160)),
        max_batch=int(rng.integers(1, 6)),
        policy=str(rng.choice(["fcfs", "lpm"])),
    )
    ids = [eng.submit(p, max_new_tokens=int(rng.integers(1, 6))) for p in prompts]
    results = eng.run(ids)
    for rid, prompt, r in zip(ids, prompts, results):
        assert r.finish_reason == "length", (r.finish_reason, r.error)
        assert r.output == greedy_reference(model, prompt, len(r.output)), (seed, rid)
    eng.cache.check()
