"""The sampler on the logits' own device: on the CPU it draws exactly what the host sampler
before it drew (``cpu_sampling_reference``) for every knob and seed, a seed repeats, and a step
reads the device back once, however many rows sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_sampling_reference import sample_tokens as reference_sample_tokens
from host_reads import HostReads
from radixkv.engine import sampling
from radixkv.engine.sampling import check_sampling, sample_tokens, top_p_threshold
from radixkv.engine.sequence import Sequence

VOCAB = 3000

#: One request of each kind a batch can hold: (temperature, knobs).
KINDS = [
    (0.0, {}),  # plain greedy
    (0.9, {}),  # temperature alone
    (0.7, dict(top_k=40)),
    (1.1, dict(top_p=0.8)),
    (1.3, dict(top_p=0.999)),  # past the 256 candidates: the full sort
    (0.8, dict(min_p=0.05, top_k=100, top_p=0.9)),
    (0.0, dict(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4)),
    (1.0, dict(repetition_penalty=1.3, presence_penalty=1.2)),
    (0.0, dict(logit_bias={5: 30.0, 77: -100.0})),
    (0.6, dict(logit_bias={9: 3.0}, frequency_penalty=1.1)),
    (0.0, dict(logprobs=True, top_logprobs=5)),
    (0.9, dict(logprobs=True, top_logprobs=3, top_k=20)),
    (0.5, dict(logprobs=True)),
]


def batch(seed: int) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i, (temperature, knobs) in enumerate(KINDS):
        sp = check_sampling(**knobs)
        prompt = rng.integers(0, VOCAB, 30).astype(np.uint32)
        seqs.append(
            Sequence(
                i,
                prompt,
                50,
                temperature=temperature,
                seed=seed * 100 + i,
                sampling=sp if sp.used(temperature) else None,
            )
        )
    return seqs


def run(sample, seed: int, steps: int = 6) -> list:
    """``steps`` steps of ``sample`` over one batch of every kind, each row's token appended to
    its output (so the penalties count them): every token, logprob and alternative list."""
    g = torch.Generator().manual_seed(seed)
    seqs = batch(seed)
    # Logits that change little from step to step, as a model's do: the tokens drawn before
    # stay likely, so the penalties decide.
    base = torch.randn(len(seqs), VOCAB, generator=g) * 4
    seen = []
    for _ in range(steps):
        logits = base + torch.randn(len(seqs), VOCAB, generator=g) * 0.3
        tokens, lps = sample(logits, seqs)
        seen.append((tokens, lps, [s.last_top for s in seqs]))
        for s, t in zip(seqs, tokens):
            s.output.append(t)
    return seen


@pytest.mark.parametrize("seed", range(8))
def test_the_cpu_draws_what_the_host_sampler_drew(seed):
    assert run(sample_tokens, seed) == run(reference_sample_tokens, seed)


def test_a_seed_repeats_and_another_draws_otherwise():
    assert run(sample_tokens, 3) == run(sample_tokens, 3)
    tokens = [t for step in run(sample_tokens, 3) for t in step[0]]
    other = [t for step in run(sample_tokens, 4) for t in step[0]]
    assert tokens != other


def test_a_step_reads_the_device_back_once():
    """bf16 logits take the path a GPU takes (the float32 fast path reads numpy on the CPU);
    top_p is left out: on the CPU it reads one value to skip the full sort
    (:func:`top_p_threshold`, checked below)."""
    seqs = [s for s in batch(0) if s.sampling is None or s.sampling.top_p == 1.0]
    logits = (torch.randn(len(seqs), VOCAB) * 4).to(torch.bfloat16)
    for s in seqs:
        s.output.extend([5, 9, 5])
    with HostReads() as mode:
        tokens, _ = sample_tokens(logits, seqs)
    assert all(isinstance(t, int) for t in tokens)
    assert mode.reads == ["cpu"]


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_without_the_shortcut_reads_nothing_and_agrees(top_p):
    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 2.0, 8.0):
        probs = torch.softmax(torch.randn(VOCAB, generator=g) * scale, -1)
        with HostReads() as mode:
            full = top_p_threshold(probs, top_p, shortcut=False)
        assert not mode.reads
        assert torch.equal(full, top_p_threshold(probs, top_p, shortcut=True))


def test_a_distribution_holding_nan_refuses_its_row_alone():
    """An infinite logit makes a sampled row's softmax NaN: that row gets an error naming its
    request (the draw runs on a safe stand-in, as a GPU's must), the others sample."""
    seqs = batch(1)[:3]
    logits = torch.randn(3, VOCAB)
    logits[1, 4] = float("inf")
    tokens, _ = sample_tokens(logits, seqs)
    assert isinstance(tokens[1], ValueError) and "request 1" in str(tokens[1])
    assert isinstance(tokens[0], int) and isinstance(tokens[2], int)


def test_generators_live_on_the_logits_device():
    seqs = batch(2)[1:2]
    sample_tokens(torch.randn(1, VOCAB), seqs)
    assert seqs[0].generator is not None and seqs[0].generator.device.type == "cpu"
    assert sampling.generator_of(seqs[0]) is seqs[0].generator
