"""Speculative decoding without a draft model: what a request guesses it will generate next.

Each step, a running request that decodes may carry up to ``K`` *draft* tokens. The batcher
plans its last sampled token and the drafts as one chunk; one forward pass scores all ``K + 1``
positions, and the engine keeps the drafts the target model agrees with plus one token of its
own (:func:`radixkv.engine.sampling.verify_draft`). Guessing costs no model: the drafts are
copied from what is already known.

```text
  target:   [ prompt ...................... | out_0 ... out_n ]
  step:                                       [ out_n  d_1 d_2 ... d_K ]   one chunk, K + 1 rows
  kept:                                       [ out_n  d_1 .. d_a ] + t    a drafts accepted, t new
  given back:                                               d_a+1 .. d_K   (cache.truncate)
```

Drafters (vLLM's ``method`` names):

- ``"ngram"`` (prompt lookup): the longest n-gram (``prompt_lookup_max`` down to
  ``prompt_lookup_min`` tokens) ending the request's tokens that occurred before in them; the
  tokens that followed its most recent occurrence are the draft. Code edits and tool output
  copy their context, so their replies repeat it.
- ``"suffix"``: first what the prefix cache holds after the request's tokens in its namespace
  (:meth:`radixkv.RadixCache.continuation`: an earlier reply to the same prompt, a retried
  request, a sibling branch that ran ahead), then, when the cache holds nothing there, the
  request's own longest repeated suffix (as ``"ngram"``). The walk starts at the request's own
  namespace's root, so a draft never carries another namespace's tokens.

Adaptive length, per request (:meth:`Drafter.accepted`): a request's first draft is
:data:`FIRST_DRAFT` tokens long; a draft accepted whole makes the next one twice as long (up to
``K``); one accepted in part (``a`` of its tokens) makes the next ``a + 1`` long; one of which
nothing was accepted pauses the request's drafting for a number of steps that doubles each time
(up to :data:`MAX_PAUSE`), after which it tries a short draft again; during a pause only strong
evidence drafts (what the cache holds after the request's tokens, or an n-gram of
``prompt_lookup_max`` tokens seen before: a reply that starts copying after some prose). So text
that nothing predicts decodes at about plain speed, and a reply the cache holds is drafted ``K``
tokens a step after a few steps.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

import radixkv
from radixkv.engine.sequence import DraftState, Sequence
from radixkv.spec_config import SpecConfig

__all__ = ["DraftState", "Drafter", "SpecConfig", "prompt_lookup"]

#: The length of a request's first draft, and of the first after a pause: a forward pass over a
#: few tokens costs about what one over one token does (on a CPU, 3 tokens 1.2x and 9 tokens
#: 2.4x one token's, SmolLM2-135M in float32), so a guess that fails costs little; drafts
#: that are accepted whole double in length up to K.
FIRST_DRAFT = 2
#: Steps in a row that accepted no draft before a request pauses drafting.
MISSES_TO_PAUSE = 1
#: The longest pause (steps) of a request whose drafts keep failing.
MAX_PAUSE = 64


class Drafter:
    """Proposes each decoding request's draft for the next step (see the module docstring)."""

    def __init__(self, config: SpecConfig, cache: radixkv.Cache) -> None:
        self.config = config
        self.cache = cache
        self.from_cache = config.method == "suffix"

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """Up to ``min(room, the request's draft length)`` draft tokens for ``seq`` (empty
        while it pauses)."""
        state = self._state(seq)
        paused = state.pause > 0
        if paused:
            state.pause -= 1
        k = min(state.k, room)
        if k <= 0:
            return []
        tokens = seq.target
        if self.from_cache:
            cont = self.cache.continuation(tokens, k, namespace=seq.cache_namespace)
            if len(cont):
                return cont.tolist()
        # A pause gives way to strong evidence only: the cache's continuation above, or an
        # n-gram of prompt_lookup_max tokens seen before (the reply started copying).
        hi = self.config.prompt_lookup_max
        return prompt_lookup(tokens, k, hi if paused else self.config.prompt_lookup_min, hi)

    def _state(self, seq: Sequence) -> DraftState:
        if seq.spec is None:
            seq.spec = DraftState(self._first)
        return seq.spec

    @property
    def _first(self) -> int:
        return min(FIRST_DRAFT, self.config.num_speculative_tokens)

    def accepted(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Adapts ``seq``'s next draft to a step that accepted ``accepted`` of ``drafted``: twice
        as long after a draft accepted whole (up to K), ``accepted + 1`` after one accepted in
        part, and after :data:`MISSES_TO_PAUSE` drafts in a row of which nothing was accepted
        a pause (1, 2, 4, ... steps, up to :data:`MAX_PAUSE`), then a short draft again."""
        state = self._state(seq)
        if accepted == drafted:
            state.k = min(2 * max(drafted, 1), self.config.num_speculative_tokens)
            state.misses = state.pauses = 0
            return
        state.k = accepted + 1
        state.misses = 0 if accepted else state.misses + 1
        if state.misses >= MISSES_TO_PAUSE:
            state.pause = min(2**state.pauses, MAX_PAUSE)
            state.pauses += 1
            state.misses, state.k = 0, self._first


def prompt_lookup(tokens: np.ndarray, k: int, lo: int, hi: int) -> list[int]:
    """Prompt lookup: for ``n`` from ``hi`` down to ``lo``, the last ``n`` tokens of ``tokens``
    looked up earlier in ``tokens``; the up to ``k`` tokens after their most recent earlier
    occurrence (empty when none occurs)."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        # Windows starting at 0 .. size - n - 1: each is followed by at least one token.
        windows = sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
