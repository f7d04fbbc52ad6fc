"""Shared pieces of the torch-layer tests: the cache configurations under test, a tiny model,
and a dense greedy decoder that serves as the oracle (no cache, no batching)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from radixkv.models import CausalLM, ModelConfig

#: factory(num_tokens) -> a cache whose pool holds that many tokens: every index and page size
#: the tests must hold for.
CACHES = [
    pytest.param(lambda n: radixkv.RadixCache(n, page_size=1), id="radix-p1"),
    pytest.param(lambda n: radixkv.RadixCache(-(-n // 4), page_size=4), id="radix-p4"),
    pytest.param(lambda n: radixkv.BlockCache(-(-n // 16), page_size=16), id="block-p16"),
]

VOCAB = 512

# The tensors here are tiny: a second thread only adds synchronisation, and on a loaded 2-core
# machine every parallel region waits for a core (tests ran 5x slower).
torch.set_num_threads(1)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")


def tiny_config(**changes) -> ModelConfig:
    """2 layers, hidden 64, 4 query heads over 2 KV heads, vocab 512."""
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    return cfg.replace(**changes)


def tiny_model(seed: int = 0, dtype=torch.float32, device="cpu", **changes) -> CausalLM:
    """A random tiny model."""
    return CausalLM.random(tiny_config(**changes), seed=seed, dtype=dtype, device=device)


def ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` random token ids of the tiny vocabulary."""
    return rng.integers(0, VOCAB, n).astype(np.uint32)


def dense_greedy(model: CausalLM, prompt, max_new_tokens: int, stop=()) -> list[int]:
    """Greedy decoding by recomputing the whole sequence every step (no cache at all)."""
    seq = [int(t) for t in prompt]
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(model.forward_dense(seq)[-1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out
