"""Admission policies: which waiting sequences enter the cache at each engine step.

The engine hands every admission decision to one object with four methods (``add``, ``requeue``,
``cancel``, ``admit``); swapping it changes the scheduling policy and nothing else.

- :class:`FcfsAdmission` (default): arrival order; the head of the queue waits when the pool is
  full, and nobody overtakes it. Admits long prompts in chunks and forks branches.
- :class:`SchedulerAdmission`: the Rust :class:`radixkv.Scheduler` (``fcfs``, ``lpm`` or
  ``dfs-weight``), which admits whole prompts in cache-aware order.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import radixkv
    from radixkv.engine import Engine
    from radixkv.sequence import Sequence

Admitted = list[tuple["Sequence", "radixkv.Request"]]


class Admission(Protocol):
    """What the engine needs from an admission policy."""

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence."""

    def requeue(self, seq: Sequence) -> None:
        """Queues a preempted sequence again (its target includes the tokens sampled so far)."""

    def cancel(self, seq: Sequence) -> bool:
        """Drops a waiting sequence; returns whether it was waiting."""

    def admit(self, engine: Engine, token_budget: int, max_requests: int) -> Admitted:
        """Opens cache requests for waiting sequences whose uncached tokens fit ``token_budget``
        (the first may exceed it only by its pending fork tail) and at most ``max_requests`` of
        them; returns them in admission order."""

    def __len__(self) -> int:
        """Sequences waiting."""


class FcfsAdmission:
    """First come, first served, by arrival id (a preempted sequence goes back to its place)."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._seqs: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        """Queues ``seq`` at its arrival place."""
        bisect.insort(self._ids, seq.id)
        self._seqs[seq.id] = seq

    requeue = add

    def cancel(self, seq: Sequence) -> bool:
        """Drops ``seq`` if it waits."""
        if self._seqs.pop(seq.id, None) is None:
            return False
        self._ids.remove(seq.id)
        return True

    def admit(self, engine: Engine, token_budget: int, max_requests: int) -> Admitted:
        """Admits from the head while the budget, the request limit and the pool allow."""
        out: Admitted = []
        while self._ids and len(out) < max_requests and token_budget > 0:
            seq = self._seqs[self._ids[0]]
            req = engine.open_request(seq, token_budget)
            if req is None:
                break  # out of pages: the head waits for pages, later arrivals wait behind it
            self._ids.pop(0)
            del self._seqs[seq.id]
            out.append((seq, req))
            token_budget -= req.num_tokens - req.num_computed
        return out

    def __len__(self) -> int:
        return len(self._ids)


class SchedulerAdmission:
    """Admission through the Rust :class:`radixkv.Scheduler` (``policy``: ``fcfs``, ``lpm`` or
    ``dfs-weight``). The scheduler admits whole targets (no chunked prefill) and never one whose
    uncached part exceeds the budget, so when the engine is idle and nothing fits, the best
    ranked request is admitted alone over budget. Branches are admitted as plain prompts (they
    hit the context their parent pins) rather than forked; a preempted sequence is queued again
    with its priority raised by one, so that it goes ahead of new arrivals of its priority.
    """

    def __init__(
        self,
        cache: radixkv.RadixCache | radixkv.BlockCache,
        policy: str = "lpm",
        max_wait: int = 256,
    ) -> None:
        import radixkv

        self.scheduler = radixkv.Scheduler(cache, policy=policy, max_wait=max_wait)
        self._by_sid: dict[int, Sequence] = {}
        self._sid: dict[int, int] = {}  # sequence id -> scheduler id

    def add(self, seq: Sequence, priority_boost: int = 0) -> None:
        """Queues ``seq``'s whole target in the scheduler."""
        remaining = max(seq.max_new_tokens - len(seq.output), 0)
        sid = self.scheduler.add(
            seq.target,
            namespace=seq.cache_namespace,
            priority=seq.priority + priority_boost,
            max_new_tokens=remaining,
        )
        self._by_sid[sid] = seq
        self._sid[seq.id] = sid

    def requeue(self, seq: Sequence) -> None:
        """Queues a preempted sequence again, ahead of new arrivals of its priority."""
        self.add(seq, priority_boost=1)

    def cancel(self, seq: Sequence) -> bool:
        """Drops ``seq`` if it waits."""
        sid = self._sid.pop(seq.id, None)
        if sid is None:
            return False
        del self._by_sid[sid]
        return self.scheduler.cancel(sid)

    def admit(self, engine: Engine, token_budget: int, max_requests: int) -> Admitted:
        """One ``Scheduler.schedule`` call (a second, over budget, when the engine is idle)."""
        out: Admitted = []
        admitted = self.scheduler.schedule(token_budget, max_requests)
        if not admitted and self._sid and not engine.running:
            admitted = self.scheduler.schedule(2**62, 1)
        for sid, req in admitted:
            seq = self._by_sid.pop(sid)
            del self._sid[seq.id]
            out.append((seq, req))
        return out

    def __len__(self) -> int:
        return len(self._sid)
