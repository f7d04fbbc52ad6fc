"""Token ids in (validated arrays) and out (greedy or temperature sampling of a batch)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from radixkv.engine.sequence import Sequence


def to_token_array(
    tokens: Seq[int] | np.ndarray | torch.Tensor,
    name: str,
    vocab_size: int,
    allow_empty: bool = False,
) -> np.ndarray:
    """``tokens`` as a 1-D uint32 array, each id checked against ``vocab_size``."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.size == 0:
        if allow_empty:
            return np.zeros(0, dtype=np.uint32)
        raise ValueError(f"{name} must hold at least one token, got none")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{name} must be a 1-D sequence of ints, got shape {arr.shape} of {arr.dtype}"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.uint32, copy=False)


def generator_of(seq: Sequence) -> torch.Generator:
    """``seq``'s own generator, seeded with ``seq.seed`` on first use."""
    if seq.generator is None:
        seq.generator = torch.Generator().manual_seed(seq.seed)
    return seq.generator


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of ``logits [N, vocab]``: argmax where the row's sequence has
    temperature 0, else a draw from ``softmax(logits / temperature)`` with that sequence's own
    generator (so a request's samples do not depend on what it was batched with)."""
    tokens = logits.argmax(dim=-1).tolist()
    hot = [i for i, s in enumerate(seqs) if s.temperature > 0]
    if hot:
        rows = logits[hot].float().cpu()
        for j, i in enumerate(hot):
            probs = torch.softmax(rows[j] / seqs[i].temperature, dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=generator_of(seqs[i])))
    return tokens
