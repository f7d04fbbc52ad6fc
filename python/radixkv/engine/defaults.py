"""The engine's defaults, each named once: what :class:`~radixkv.Engine`, its
:class:`~radixkv.engine.batcher.Batcher` and :class:`~radixkv.Session` use when not told.

- :data:`DEFAULT_POLICY` (``"lpm"``): the admission order of waiting requests, the same as
  :class:`radixkv.Scheduler`'s own default.
- :data:`DEFAULT_MAX_NEW_TOKENS` (16): how many tokens a request generates at most, the same
  for ``Engine.submit``, ``Engine.branch``, ``Engine.generate``, ``Session.send`` and
  ``Session.branch``.
- :func:`sharing_threshold`: from how many shared uncached tokens on the cache-aware policies
  hold back a request so that its prefix is computed once (the scheduler's chunk).
"""

from __future__ import annotations

#: Admission order of waiting requests: longest cached prefix first. Why: when nothing waits
#: (a light load) every policy admits the same requests; when requests queue up, admitting the
#: ones whose prefix is cached first computes the fewest tokens and keeps hot prefixes from
#: being evicted before their next hit (``benches/bench_scheduler.py``: 95% of the best hit rate
#: where first-come-first-served gets 4.5%), and ``max_wait`` (256 steps by default) bounds how
#: long any request can be passed over. ``"fcfs"`` keeps strict arrival order.
DEFAULT_POLICY = "lpm"

#: Tokens a request generates at most when ``max_new_tokens`` is not given. Why 16: it is the
#: default of OpenAI's completions API and of vLLM's ``SamplingParams.max_tokens``, so code
#: ported from either generates as much; a chat reply usually wants more, and says so
#: (``max_new_tokens=...``), and generation still ends earlier at a stop token.
DEFAULT_MAX_NEW_TOKENS = 16

#: The scheduler's chunk before rounding to whole pages (tokens); see :func:`sharing_threshold`.
SHARING_CHUNK_TOKENS = 64


def sharing_threshold(page_size: int) -> int:
    """In-batch prefix sharing: under ``"lpm"`` and ``"dfs-weight"``, when waiting requests
    share an uncached prefix of at least this many tokens, one ``schedule`` call admits only the
    first of them; the others wait one call and then find the shared part cached, so it is
    computed once. A shorter shared prefix is computed by each of them in the same step (holding
    a request back costs more than recomputing fewer tokens). ``"fcfs"`` never holds one back.

    The threshold is the scheduler's chunk: :data:`SHARING_CHUNK_TOKENS` (64) rounded up to
    whole pages, ``page_size * ceil(64 / page_size)``: 64 tokens at page sizes 1, 16 or 64, 96 at
    page size 48. It is fixed by the Rust core (``rust/sched/mod.rs``); this function states it.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    return page_size * -(-SHARING_CHUNK_TOKENS // page_size)
