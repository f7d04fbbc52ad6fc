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
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"{name} must be a 1-D sequence of ints, got {type(tokens).__name__}")
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as e:  # ragged nesting, unconvertible items
        raise ValueError(f"{name} must be a 1-D sequence of ints: {e}") from None
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


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
    """One token per row of ``logits [N, vocab]``: argmax where the row's sequence has
    temperature 0, else a draw from ``softmax(logits / temperature)`` with that sequence's own
    generator (so a request's samples do not depend on what it was batched with). A row holding
    NaN, or whose draw raises, gets an exception in place of a token (greedy or not: argmax
    would pick the NaN); the other rows are unaffected."""
    tokens: list[int | Exception] = list(logits.argmax(dim=-1).tolist())
    for i, bad in enumerate(torch.isnan(logits).any(dim=-1).tolist()):
        if bad:
            tokens[i] = ValueError(f"the model's logits for request {seqs[i].id} hold NaN")
    hot = [i for i, s in enumerate(seqs) if s.temperature > 0]
    if hot:
        rows = logits[hot].float().cpu()
        for j, i in enumerate(hot):
            if isinstance(tokens[i], Exception):
                continue
            try:
                probs = torch.softmax(rows[j] / seqs[i].temperature, dim=-1)
                tokens[i] = int(torch.multinomial(probs, 1, generator=generator_of(seqs[i])))
            except Exception as e:  # reported on the row's request
                tokens[i] = e
    return tokens
