"""The step-packing half of :class:`radixkv.Engine`: which sequences a forward pass computes.

Every step packs, under the engine's token budget and request limit:

1. running sequences, oldest first: decodes (one token each) and the next chunks of prefills
   that did not fit earlier steps (a request holds only the tokens it computes this step; the
   next chunk is appended with ``cache.extend``);
2. admission (:meth:`Batching._admit`, the one place a scheduling policy plugs in) of waiting
   sequences, whose cached prefixes cost nothing and whose uncached suffixes are chunked to the
   budget left; branches of a computed context are forked from it.

Out of pages: admission waits (the queue head keeps its place); a running sequence that cannot
grow preempts the newest running sequence not yet in the batch (possibly itself): that one is
aborted and re-queued, and resumes later from whatever of its prefix is still cached. No
sequence's pages are ever touched by another's forward pass, so preemption never corrupts. If
nothing at all can run, held contexts are released, and then a request that an empty pool cannot
hold ends with ``finish_reason="out_of_pages"``.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import TYPE_CHECKING

import numpy as np

import radixkv
from radixkv.sequence import Result, Sequence, Status

if TYPE_CHECKING:
    from radixkv.admission import Admission, Admitted
    from radixkv.engine import EngineStats


class Batching:
    """Base of :class:`radixkv.Engine` holding its scheduling and sequence life cycle. The state
    it works on (``cache``, ``admission``, ``running``, ``held``, ``sequences``, ``stats``,
    ``token_budget``, ``max_batch``, ``prefix_caching``) is set up by ``Engine.__init__``."""

    cache: radixkv.RadixCache | radixkv.BlockCache
    admission: Admission
    running: list[Sequence]
    held: list[Sequence]
    sequences: dict[int, Sequence]
    stats: EngineStats
    token_budget: int
    max_batch: int
    prefix_caching: bool
    _private: itertools.count
    _generators: dict

    def _schedule(self) -> list[Sequence]:
        budget, batch = self.token_budget, []
        in_batch: set[int] = set()
        for seq in list(self.running):
            if len(batch) >= self.max_batch or budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            pending = self._grow(seq, budget, in_batch)
            if pending:
                batch.append(seq)
                in_batch.add(seq.id)
                budget -= pending
        if len(batch) < self.max_batch and budget > 0:
            for seq, req in self._admit(budget, self.max_batch - len(batch)):
                self._start(seq, req)
                batch.append(seq)
                budget -= req.num_tokens - req.num_computed
        self._release_held()
        return batch

    def _admit(self, token_budget: int, max_requests: int) -> Admitted:
        """The one admission hook: asks the policy object which waiting sequences enter."""
        return self.admission.admit(self, token_budget, max_requests)

    def open_request(self, seq: Sequence, token_budget: int) -> radixkv.Request | None:
        """Opens ``seq``'s cache request with at most ``token_budget`` tokens to compute (a fork
        tail may exceed it), or returns None when the pool cannot supply the pages. Forks the
        context of a held parent; else admits the target's cached prefix plus a chunk."""
        target = seq.target
        try:
            parent = seq.parent
            if parent is not None and parent.status is Status.HELD:
                req = self.cache.fork(parent.req)
            elif len(target) <= token_budget:
                req = self.cache.admit(target, seq.cache_namespace)
            else:
                cached = self.cache.match_prefix(target, seq.cache_namespace)
                req = self.cache.admit(target[: cached + token_budget], seq.cache_namespace)
        except radixkv.OutOfPages:
            return None
        n = req.num_tokens
        more = min(len(target) - n, token_budget - (n - req.num_computed))
        if more > 0:
            try:
                self.cache.extend(req, target[n : n + more])
            except radixkv.OutOfPages:
                self.cache.abort(req)
                return None
        return req

    def _grow(self, seq: Sequence, budget: int, in_batch: set[int]) -> int:
        """Extends a running sequence's request by what the budget allows; returns its pending
        tokens (0: not scheduled this step)."""
        req = seq.req
        n = req.num_tokens
        pending = n - req.num_computed
        if pending > budget and in_batch:
            return 0
        more = min(len(seq.target) - n, budget - pending)
        if more > 0:
            if not self._extend(seq, seq.target[n : n + more], in_batch):
                return 0
            pending += more
        return pending

    def _extend(self, seq: Sequence, tokens: np.ndarray, in_batch: set[int]) -> bool:
        """``cache.extend``, preempting the newest running sequence outside the batch while the
        pool is short (``seq`` itself when it is the newest). Returns whether ``seq`` grew."""
        while True:
            try:
                self.cache.extend(seq.req, tokens)
                return True
            except radixkv.OutOfPages:
                victim = max((s for s in self.running if s.id not in in_batch), key=lambda s: s.id)
                self._preempt(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        self.cache.abort(seq.req)
        seq.req = None
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.stats.preemptions += 1
        self._enqueue(seq, again=True)

    def _start(self, seq: Sequence, req: radixkv.Request) -> None:
        seq.req, seq.status = req, Status.RUNNING
        if seq.admissions == 0:
            seq.cached_tokens = req.num_cached
        seq.admissions += 1
        at = bisect.bisect([s.id for s in self.running], seq.id)
        self.running.insert(at, seq)

    def _hold(self, parent: Sequence) -> None:
        """A branch context is computed: keep it pinned and queue its branches."""
        self.running.remove(parent)
        parent.status = Status.HELD
        self.held.append(parent)
        for child in parent.children:
            if not child.done:  # a branch may have been cancelled meanwhile
                self._enqueue(child)

    def _release_held(self) -> None:
        for parent in list(self.held):
            if all(c.admissions or c.done for c in parent.children):
                self._finish(parent, "context")

    def _stalled(self) -> list[Result]:
        """Nothing could be scheduled although work is left."""
        if self.held:
            for parent in list(self.held):
                self._finish(parent, "context")  # unpin contexts so that branches can enter
            return []
        waiting = [s for s in self.sequences.values() if s.status is Status.WAITING]
        if not waiting or self.running:
            return []
        # An empty pool cannot hold the oldest waiting request: it can never run.
        head = min(waiting, key=lambda s: s.id)
        self.admission.cancel(head)
        self._finish(head, "out_of_pages")
        return [head.result()]

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.req is not None:
            self.cache.finish(seq.req)
            seq.req = None
        was = seq.status
        if was is Status.RUNNING:
            self.running.remove(seq)
        elif was is Status.HELD:
            self.held.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.finished_at = time.perf_counter()
        self._generators.pop(seq.id, None)
        if was is not Status.HELD:
            # A context that ended before it was computed: its branches are queued whole.
            for child in seq.children:
                if not child.done:
                    self._enqueue(child)

    def _enqueue(self, seq: Sequence, again: bool = False) -> None:
        if self.prefix_caching:
            seq.cache_namespace = seq.namespace
        else:
            seq.cache_namespace = f"radixkv.no-cache.{next(self._private)}"
        (self.admission.requeue if again else self.admission.add)(seq)
