"""A step's sampled rows take their knobs all at once: the torch operations a step runs do not
grow with its rows but for one draw a sampled row (from the row's own generator), and a batch
whose every row samples, each with knobs of its own, still draws exactly what the host sampler
drew row by row."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpu_sampling_reference import sample_tokens as reference_sample_tokens
from radixkv.engine.sampling import check_sampling, sample_tokens
from radixkv.engine.sequence import Sequence

VOCAB = 2000

#: Sampled rows only, their knobs differing row to row (top_k, top_p, top_logprobs vary).
KINDS = [
    (0.9, {}),
    (0.7, dict(top_k=5)),
    (1.2, dict(top_k=300, min_p=0.01)),
    (1.1, dict(top_p=0.6)),
    (1.4, dict(top_p=0.995, top_k=900)),
    (0.8, dict(min_p=0.2)),
    (1.0, dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3)),
    (0.6, dict(logit_bias={3: 4.0, 11: -100.0}, repetition_penalty=0.8)),
    (0.9, dict(logprobs=True, top_logprobs=2, top_p=0.7)),
    (1.3, dict(logprobs=True, top_logprobs=6)),
    (0.5, dict(logprobs=True, frequency_penalty=-0.5)),
]


def batch(seed: int, n: int, kinds=KINDS) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        temperature, knobs = kinds[(i * 7 + seed) % len(kinds)]
        sp = check_sampling(**knobs)
        seq = Sequence(
            i,
            rng.integers(0, VOCAB, int(rng.integers(1, 60))).astype(np.uint32),
            99,
            temperature=temperature,
            seed=seed * 1000 + i,
            sampling=sp if sp.used(temperature) else None,
        )
        seq.output.extend(rng.integers(0, VOCAB, int(rng.integers(0, 12))).tolist())
        seqs.append(seq)
    return seqs


def run(sample, seed: int, n: int, steps: int = 4) -> list:
    g = torch.Generator().manual_seed(seed)
    seqs = batch(seed, n)
    base = torch.randn(n, VOCAB, generator=g) * 3
    seen = []
    for _ in range(steps):
        logits = base + torch.randn(n, VOCAB, generator=g) * 0.5
        tokens, lps = sample(logits, seqs)
        seen.append((tokens, lps, [s.last_top for s in seqs]))
        for s, t in zip(seqs, tokens):
            s.output.append(t)
    return seen


def test_a_batch_of_sampled_rows_draws_what_the_host_sampler_drew():
    for seed in range(3):
        assert run(sample_tokens, seed, 40) == run(reference_sample_tokens, seed, 40)


class Ops(TorchDispatchMode):
    """The aten operations run while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def ops_of_a_step(n: int, kinds) -> list[str]:
    seqs = batch(0, n, kinds)
    logits = torch.randn(n, VOCAB).to(torch.bfloat16)  # the GPU's path: no numpy argmax
    sample_tokens(logits, seqs)  # generators and prompt ids made
    with Ops() as mode:
        sample_tokens(logits, seqs)
    return mode.ops


def test_a_step_runs_one_draw_more_a_sampled_row_and_nothing_else_more():
    # Every kind of row at 8 and at 64 rows (the sampled ones among them): the only operation
    # that grows is each sampled row's draw from its own generator.
    kinds = [*KINDS, (0.0, {}), (0.0, dict(repetition_penalty=1.2, logprobs=True))]
    few = 2 * len(kinds)
    small, large = ops_of_a_step(few, kinds), ops_of_a_step(64, kinds)
    sampled = {n: sum(1 for s in batch(0, n, kinds) if s.temperature > 0) for n in (few, 64)}
    grown = [op for op in set(large) if large.count(op) != small.count(op)]
    assert grown == ["exponential_"], grown
    assert large.count("exponential_") - small.count("exponential_") == sampled[64] - sampled[few]
    assert len(large) - len(small) == sampled[64] - sampled[few]
