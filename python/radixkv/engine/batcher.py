"""`Batcher`: the step packer of :class:`radixkv.Engine`: which sequences a forward pass computes.

It owns the waiting queue (one Rust :class:`radixkv.Scheduler`), the running and held sequences,
and every cache call that opens, grows or closes a sequence's request. Each
:meth:`Batcher.next_batch` packs, under the token budget and the request limit:

1. running sequences, oldest first: decodes (one token each) and the next chunks of prefills that
   did not fit earlier steps, all appended with one ``cache.extend_many`` call;
2. admissions: one ``Scheduler.schedule`` call with the budget left, in the policy's order. A
   request whose uncached part exceeds what is left is admitted in part; step 1 of later steps
   appends the rest (chunked prefill), so no prompt blocks the queue.

Branches of a context are queued as plain prompts once the context is computed and *held*: they
hit the pages it pins. A held context is finished once every branch has been admitted.

Out of pages: a running sequence that cannot grow preempts the newest running sequence not yet
in the batch (possibly itself): that one is aborted and queued again with its whole target, its
remaining ``max_new_tokens`` and its priority raised by one, and resumes later from whatever of
its prefix is still cached. No sequence's pages are ever touched by another's forward pass, so
preemption never corrupts. When nothing at all can run, :meth:`Batcher.release_held` unpins the
held contexts so that their branches can enter.

Between steps every running sequence's request is fully computed (``num_computed ==
num_tokens``) and shorter than its target, so it grows by at least one token when scheduled.
"""

from __future__ import annotations

import bisect
import itertools
import time

import radixkv
from radixkv.engine.sequence import Sequence, Status

#: Namespace prefix of the private namespaces used when prefix caching is off.
NO_CACHE_NAMESPACE = "radixkv.no-cache"
#: The highest priority the scheduler takes (a preempted sequence's is raised up to it).
PRIORITY_MAX = 2**31 - 1


class Batcher:
    """Packs each step's batch; see the module docstring. ``policy`` (``"fcfs"``, ``"lpm"`` or
    ``"dfs-weight"``) and ``max_wait`` configure the :class:`radixkv.Scheduler`. With
    ``prefix_caching=False`` every queued sequence gets a private namespace of its own, so no
    prompt ever finds a cached prefix."""

    def __init__(
        self,
        cache: radixkv.RadixCache | radixkv.BlockCache,
        token_budget: int,
        max_batch: int,
        prefix_caching: bool = True,
        policy: str = "fcfs",
        max_wait: int = 256,
    ) -> None:
        self.cache = cache
        self.scheduler = radixkv.Scheduler(cache, policy=policy, max_wait=max_wait)
        self.token_budget, self.max_batch = token_budget, max_batch
        self.prefix_caching = prefix_caching
        self.running: list[Sequence] = []  # by id: oldest first
        self.held: list[Sequence] = []
        self.preemptions = 0
        self._waiting: dict[int, Sequence] = {}  # scheduler id -> sequence
        self._sid: dict[int, int] = {}  # sequence id -> scheduler id
        self._private = itertools.count()
        self._page_size, self._num_pages = cache.page_size, cache.num_pages

    # ---- the queue --------------------------------------------------------------------------

    def check_fits(self, name: str, num_tokens: int, max_new_tokens: int) -> None:
        """Raises ``ValueError`` when a request of ``num_tokens`` prompt tokens could never run:
        its prompt and every generated token but the last need more pages than the pool has
        (the rule ``Scheduler.add`` enforces, checked before anything is queued)."""
        pages = -(-(num_tokens + max(max_new_tokens, 1) - 1) // self._page_size)
        if pages > self._num_pages:
            raise ValueError(
                f"{name} of {num_tokens} tokens with max_new_tokens={max_new_tokens} needs "
                f"{pages} pages of {self._page_size} tokens, but the pool has only "
                f"{self._num_pages} pages: it could never run"
            )

    def queue(self, seq: Sequence, again: bool = False) -> None:
        """Queues ``seq``'s whole target in the scheduler (``again``: after a preemption, with
        its priority raised by one so that it goes ahead of new arrivals of its priority)."""
        if self.prefix_caching:
            seq.cache_namespace = seq.namespace
        else:
            seq.cache_namespace = f"{NO_CACHE_NAMESPACE}.{next(self._private)}"
        sid = self.scheduler.add(
            seq.target,
            namespace=seq.cache_namespace,
            priority=min(seq.priority + int(again), PRIORITY_MAX),
            max_new_tokens=seq.remaining_new_tokens,
        )
        seq.status = Status.WAITING
        self._waiting[sid] = seq
        self._sid[seq.id] = sid

    @property
    def num_waiting(self) -> int:
        """Sequences queued in the scheduler."""
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        """Whether any sequence waits, runs or is held."""
        return bool(self.running or self.held or self._waiting)

    # ---- one step ---------------------------------------------------------------------------

    def next_batch(self) -> list[Sequence]:
        """The sequences of the next forward pass, in order: running ones, then admissions.
        Each one's request holds exactly the tokens it computes now past ``num_computed``."""
        batch = self._grow_running()
        budget = self.token_budget - sum(s.num_tokens - s.num_computed for s in batch)
        room = self.max_batch - len(batch)
        if room > 0 and budget > 0 and self._waiting:
            for sid, req in self.scheduler.schedule(budget, room):
                seq = self._waiting.pop(sid)
                del self._sid[seq.id]
                self._start(seq, req)
                batch.append(seq)
        for parent in list(self.held):
            if all(c.admissions or c.done for c in parent.children):
                self.finish(parent, "context")
        return batch

    def _grow_running(self) -> list[Sequence]:
        """Extends running sequences, oldest first, by what the budget allows: one
        ``extend_many`` call, one more after each preemption the pool forces."""
        batch: list[Sequence] = []
        budget = self.token_budget
        while True:
            room = self.max_batch - len(batch)
            plan = self._plan_growth(self.running[len(batch) :], budget, room)
            if not plan:
                return batch
            chunks = [seq.target[seq.num_tokens : seq.num_tokens + n] for seq, n in plan]
            done = self.cache.extend_many([seq.req for seq, _ in plan], chunks)
            for seq, n in plan[:done]:
                seq.num_tokens += n
                budget -= n
                batch.append(seq)
            if done == len(plan):
                return batch
            # The pool is short: the newest running sequence outside the batch makes room.
            self._preempt(self.running[-1])

    @staticmethod
    def _plan_growth(seqs: list[Sequence], budget: int, room: int) -> list[tuple[Sequence, int]]:
        """``(sequence, tokens to append)`` for the first of ``seqs`` that fit."""
        plan = []
        for seq in seqs:
            if len(plan) >= room or budget <= 0:
                break
            n = min(seq.target_len - seq.num_tokens, budget)
            plan.append((seq, n))
            budget -= n
        return plan

    def _start(self, seq: Sequence, req: radixkv.Request) -> None:
        seq.req, seq.status = req, Status.RUNNING
        seq.num_tokens, seq.num_computed = req.num_tokens, req.num_computed
        if seq.admissions == 0:
            seq.cached_tokens = seq.num_computed
        seq.admissions += 1
        bisect.insort(self.running, seq, key=_by_id)

    def requeue(self, batch: list[Sequence]) -> None:
        """Puts every sequence of ``batch`` (a step that was interrupted before its commit)
        back in the queue, as a preemption does: nothing of the step is kept."""
        for seq in reversed(batch):
            if seq.status is Status.RUNNING and seq.req is not None:
                self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.cache.abort(seq.req)
        self._close(seq)
        self.running.remove(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.queue(seq, again=True)

    # ---- life cycle -------------------------------------------------------------------------

    def hold(self, parent: Sequence) -> None:
        """A branch context is computed: keep it pinned and queue its branches."""
        self.running.remove(parent)
        parent.status = Status.HELD
        self.held.append(parent)
        for child in parent.children:
            if not child.done:  # a branch may have been cancelled meanwhile
                self.queue(child)

    def release_held(self) -> bool:
        """Finishes every held context (nothing could be scheduled: unpinning them lets their
        branches enter); returns whether there was one."""
        released = bool(self.held)
        for parent in list(self.held):
            self.finish(parent, "context")
        return released

    def finish(self, seq: Sequence, reason: str, abort: bool = False) -> None:
        """Ends ``seq`` wherever it is (waiting, running or held): its request is finished
        (publishing what it computed), or aborted with ``abort`` (publishing nothing more: a
        failed step). Branches of a context that ended before it was computed are queued
        whole."""
        was = seq.status
        sid = self._sid.pop(seq.id, None)
        if sid is not None:
            del self._waiting[sid]
            self.scheduler.cancel(sid)
        if seq.req is not None:
            if abort:
                self.cache.abort(seq.req)
            else:
                self.cache.finish(seq.req)
            self._close(seq)
        if was is Status.RUNNING:
            self.running.remove(seq)
        elif was is Status.HELD:
            self.held.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.finished_at = time.perf_counter()
        seq.generator = None
        if was is not Status.HELD:
            for child in seq.children:
                if not child.done and child.id not in self._sid:
                    self.queue(child)

    @staticmethod
    def _close(seq: Sequence) -> None:
        seq.req = None
        seq.num_tokens = seq.num_computed = 0


def _by_id(seq: Sequence) -> int:
    return seq.id
