"""Sampling on a GPU (``pytest -m cuda``): every knob on the logits' device, one wait for the
device a step, a seed that repeats there, and greedy rows that pick on CUDA what they pick on
the CPU. Skipped without CUDA (the CPU's equality with the host sampler is
``tests/python/engine/test_sampling_device.py``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from radixkv.engine.sampling import check_sampling, sample_tokens
from radixkv.engine.sequence import Sequence
from triton_device import DEVICE

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE != "cuda", reason="samples on a GPU"),
]

VOCAB = 32_000
KNOBS = [
    (0.0, {}),
    (0.9, {}),
    (0.8, dict(top_k=50, top_p=0.9, min_p=0.02)),
    (1.0, dict(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias={3: 5.0})),
    (0.0, dict(repetition_penalty=1.5, presence_penalty=0.7)),
    (0.7, dict(logprobs=True, top_logprobs=4)),
]


def batch(seed: int) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    out = []
    for i, (t, knobs) in enumerate(KNOBS):
        sp = check_sampling(**knobs)
        out.append(
            Sequence(
                i,
                rng.integers(0, VOCAB, 40).astype(np.uint32),
                32,
                temperature=t,
                seed=seed + i,
                sampling=sp if sp.used(t) else None,
            )
        )
    return out


def steps(device: str, seed: int, n: int = 4) -> list[list]:
    g = torch.Generator().manual_seed(seed)
    seqs = batch(seed)
    base = torch.randn(len(seqs), VOCAB, generator=g) * 4
    seen = []
    for _ in range(n):
        logits = (base + torch.randn(len(seqs), VOCAB, generator=g) * 0.3).to(device)
        tokens, _ = sample_tokens(logits, seqs)
        seen.append(tokens)
        for s, t in zip(seqs, tokens):
            s.output.append(t)
    return seen


def test_a_step_waits_for_the_device_once():
    seqs = batch(0)
    logits = torch.randn(len(seqs), VOCAB, device="cuda")
    sample_tokens(logits, seqs)  # generators and prompt ids made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tokens, _ = sample_tokens(logits, seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs
    assert all(isinstance(t, int) for t in tokens)


def test_a_seed_repeats_on_cuda_and_greedy_rows_match_the_cpu():
    a, b = steps("cuda", 5), steps("cuda", 5)
    assert a == b
    cpu = steps("cpu", 5)
    for i, (t, _) in enumerate(KNOBS):
        if t == 0.0:  # greedy, with or without penalties: the same picks on both devices
            assert [s[i] for s in a] == [s[i] for s in cpu], i
