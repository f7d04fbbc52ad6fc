"""Time to first token from recomputed prompt tokens alone: a prefill queue without pages.

The offline simulations (:mod:`radixkv.apps.replay.belady`) give each request its cached and
computed prompt tokens but run no server; this turns those counts into times to first token with the
batch model of :mod:`radixkv.apps.replay.simulate`, less its pages and decode slots. One server
computes batches back to back: whenever it is idle it takes, oldest first, the next chunks of the
requests that have arrived and still have prompt tokens to compute, up to ``token_budget`` tokens (a
longer prompt goes in chunks over several batches); a batch of ``T`` tokens takes ``T /
prefill_tps`` seconds; a request's first token comes when the batch computing its last chunk ends.
Comparing policies through it isolates what they recompute from everything else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np


def prefill_ttfts(
    arrivals: Sequence[float] | np.ndarray,
    computed: Sequence[int] | np.ndarray,
    prefill_tps: float = 50_000.0,
    token_budget: int = 131_072,
) -> np.ndarray:
    """Each request's time to first token (seconds, float64, in the order given) when request
    ``i`` arrives at ``arrivals[i]`` (non-decreasing) and computes ``computed[i] >= 1`` prompt
    tokens, in the model of the module docstring."""
    t_arr = np.asarray(arrivals, dtype=np.float64)
    work = np.asarray(computed, dtype=np.int64)
    if t_arr.shape != work.shape or t_arr.ndim != 1:
        raise ValueError(
            f"arrivals and computed must be 1-D of one length, got {t_arr.shape} and {work.shape}"
        )
    if len(work) and work.min() < 1:
        raise ValueError(f"computed must be >= 1 for every request, got {int(work.min())}")
    if len(t_arr) > 1 and np.any(np.diff(t_arr) < 0):
        raise ValueError("arrivals must be sorted (non-decreasing)")
    if not prefill_tps > 0:
        raise ValueError(f"prefill_tps must be > 0, got {prefill_tps!r}")
    if isinstance(token_budget, bool) or not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be an int >= 1, got {token_budget!r}")
    out = np.zeros(len(work), dtype=np.float64)
    queue: deque[list[int]] = deque()  # [request, tokens left], oldest first
    now, nxt, n = 0.0, 0, len(work)
    while nxt < n or queue:
        if not queue:
            now = max(now, float(t_arr[nxt]))
        while nxt < n and t_arr[nxt] <= now:
            queue.append([nxt, int(work[nxt])])
            nxt += 1
        budget, done = token_budget, []
        for item in queue:
            take = min(item[1], budget)
            item[1] -= take
            budget -= take
            if item[1] == 0:
                done.append(item[0])
            if budget == 0:
                break
        now += (token_budget - budget) / prefill_tps
        for i in done:
            out[i] = now - t_arr[i]
        while queue and queue[0][1] == 0:
            queue.popleft()
    return out
