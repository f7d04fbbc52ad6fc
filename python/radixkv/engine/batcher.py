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
A decoding sequence may grow by its ``draft`` too (speculative decoding, set by the engine before
the step): appended after its token in the same chunk, cut to the budget, and dropped first when
the pool is short; the engine gives back the drafts it rejects (``cache.truncate``).

Failing cache calls: a cache or scheduler call made for one sequence (``extend``, ``finish``,
``abort``, ``Scheduler.add``) that raises one of :data:`CALL_ERRORS` ends that sequence alone
with ``finish_reason="error"`` and the exception (:meth:`Batcher.fail`): its request is aborted
(should the abort raise too, it is tried again every step until it closes), its queue entry
cancelled, and it is listed in :attr:`Batcher.failed` for the engine to report; every other
sequence runs on. A call made for several sequences at once (``extend_many``) that raises is
made again one sequence at a time, so that only the sequence at fault fails.
``Scheduler.schedule`` concerns no sequence in particular: when it raises, the step admits
nothing, the error is kept in :attr:`Batcher.last_error`, and the engine's no-progress guard
reports it if the queue stays stuck. Any other exception (a bug) propagates from
:meth:`Batcher.next_batch` after the sequences it had packed are put back in the queue (as a
preemption does), so the next step starts from a consistent state.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import TYPE_CHECKING

import radixkv
from radixkv.engine.defaults import DEFAULT_POLICY
from radixkv.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from radixkv.engine.fetch import TierFetch
    from radixkv.engine.states import EngineStates

#: Namespace prefix of the private namespaces used when prefix caching is off.
NO_CACHE_NAMESPACE = "radixkv.no-cache"
#: The highest priority the scheduler takes (a preempted sequence's is raised up to it).
PRIORITY_MAX = 2**31 - 1
#: What a cache or scheduler call may raise for one request (a pool that cannot supply it, a
#: closed request, a value the Rust side refuses): the request it was made for fails alone.
CALL_ERRORS: tuple[type[Exception], ...] = (radixkv.OutOfPages, radixkv.InvalidRequest, ValueError)


class Batcher:
    """Packs each step's batch; see the module docstring. ``policy`` (``"fcfs"``, ``"lpm"`` or
    ``"dfs-weight"``) and ``max_wait`` configure the :class:`radixkv.Scheduler`. With
    ``prefix_caching=False`` every queued sequence gets a private namespace of its own, so no
    prompt ever finds a cached prefix."""

    def __init__(
        self,
        cache: radixkv.Cache,
        token_budget: int,
        max_batch: int,
        prefix_caching: bool = True,
        policy: str = DEFAULT_POLICY,
        max_wait: int = 256,
        fetch: TierFetch | None = None,
    ) -> None:
        self.cache = cache
        self.scheduler = radixkv.Scheduler(cache, policy=policy, max_wait=max_wait)
        self.token_budget, self.max_batch = token_budget, max_batch
        self.prefix_caching = prefix_caching
        self.running: list[Sequence] = []  # by id: oldest first
        self.held: list[Sequence] = []
        self.preemptions = 0
        #: Sequences the batcher ended with an error (see :meth:`fail`), not yet reported.
        self.failed: list[Sequence] = []
        #: The last exception of a ``Scheduler.schedule`` call (None once one succeeds).
        self.last_error: Exception | None = None
        #: Sequences ended so far (any reason): a step that ends one made progress.
        self.num_ended = 0
        self._unclosed: list[radixkv.Request] = []  # requests whose abort raised
        self._waiting: dict[int, Sequence] = {}  # scheduler id -> sequence
        #: Brings a waiting sequence's pages back from the KV tiers (:mod:`radixkv.engine.fetch`):
        #: when it is submitted, and at the head of the queue before an admission; with a
        #: shared tier, a sequence whose fetch is out is held back from the scheduler. None:
        #: no tier (or prefix caching off).
        self.fetch = fetch
        self._holds_back = fetch is not None and fetch.holds_back
        #: Sequences held back from the scheduler: sequence id -> (sequence, queued again).
        self._held_back: dict[int, tuple[Sequence, bool]] = {}
        self._sid: dict[int, int] = {}  # sequence id -> scheduler id
        #: A hybrid model's recurrent states: each admission restores one, each end and
        #: preemption snapshots one (:mod:`radixkv.engine.states`). None for other models.
        self.states: EngineStates | None = None
        self._private = itertools.count()

    # ---- the queue --------------------------------------------------------------------------

    def check_fits(self, name: str, num_tokens: int, max_new_tokens: int) -> None:
        """Raises ``ValueError`` when a request of ``num_tokens`` prompt tokens could never run:
        its prompt and every generated token but the last need more pages than the pool has
        (``Scheduler.check_fits``, the rule ``Scheduler.add`` enforces, checked before anything
        is queued)."""
        self.scheduler.check_fits(num_tokens, max_new_tokens, name)

    def submit(self, seq: Sequence) -> None:
        """Queues a new sequence (:meth:`queue`), its pages on disk read back at once (and
        again, for what went back while it waited, when it reaches the head of the queue);
        with a shared tier :meth:`queue` started their fetch."""
        self.queue(seq)
        if self.fetch is not None and not self._holds_back:
            self.fetch(seq)

    def queue(self, seq: Sequence, again: bool = False) -> None:
        """Queues ``seq``'s whole target in the scheduler (``again``: after a preemption, with
        its priority raised by one so that it goes ahead of new arrivals of its priority), or
        holds it back while its pages are fetched from a shared tier (:attr:`fetch`; queued
        by a later step's :meth:`next_batch`)."""
        if self.prefix_caching:
            seq.cache_namespace = seq.namespace
        else:
            seq.cache_namespace = f"{NO_CACHE_NAMESPACE}.{next(self._private)}"
        # A preempted sequence is queued at once (it just held its pages; nothing to wait for).
        if self._holds_back and not again and self.fetch(seq):  # type: ignore[misc]
            seq.status = Status.WAITING
            self._held_back[seq.id] = (seq, again)
            return
        self._add(seq, again)

    def _add(self, seq: Sequence, again: bool) -> None:
        sid = self.scheduler.add(
            seq.target,
            namespace=seq.cache_namespace,
            priority=min(seq.priority + int(again), PRIORITY_MAX),
            max_new_tokens=seq.remaining_new_tokens,
        )
        seq.status = Status.WAITING
        self._waiting[sid] = seq
        self._sid[seq.id] = sid

    def is_queued(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits in the scheduler's queue (or is held back from it)."""
        return seq.id in self._sid or seq.id in self._held_back

    @property
    def num_waiting(self) -> int:
        """Sequences queued in the scheduler or held back from it."""
        return len(self._waiting) + len(self._held_back)

    @property
    def num_held_back(self) -> int:
        """Sequences held back from the scheduler while their pages are fetched."""
        return len(self._held_back)

    @property
    def has_work(self) -> bool:
        """Whether any sequence waits, runs or is held."""
        return bool(self.running or self.held or self._waiting or self._held_back)

    def _queue_held_back(self) -> None:
        """Queues the held-back sequences whose fetch is no longer out (one the scheduler
        refuses fails)."""
        for seq, again in list(self._held_back.values()):
            if self.fetch is not None and self.fetch(seq):
                continue
            del self._held_back[seq.id]
            try:
                self._add(seq, again)
            except CALL_ERRORS as e:
                self.fail(seq, e)

    # ---- one step ---------------------------------------------------------------------------

    def next_batch(self) -> list[Sequence]:
        """The sequences of the next forward pass, in order: running ones, then admissions.
        Each one's request holds exactly the tokens it computes now past ``num_computed``.
        Sequences that failed meanwhile are in :attr:`failed`. An exception other than
        :data:`CALL_ERRORS` (a bug) or an interrupt puts what was packed back in the queue
        and propagates."""
        batch: list[Sequence] = []
        if self._unclosed:
            self.retry_aborts()
        if self._held_back:
            self._queue_held_back()
        try:
            self._grow_running(batch)
            self._admit(batch)
            for parent in list(self.held):
                if all(c.admissions or c.done for c in parent.children):
                    self.finish(parent, "context")
        except BaseException:
            self.requeue(batch)
            raise
        return batch

    def committed(self, batch: list[Sequence]) -> list[int]:
        """After the forward pass of ``batch`` and its ``kv.commit``: each sequence's counters
        advance by what the step computed (its drafts aside: they are committed or given back
        once verified, ``KVCache.settle``); returns the rows whose whole target is now
        computed, whose logits are sampled."""
        ready = []
        for b, seq in enumerate(batch):
            q = seq.num_tokens - seq.num_computed
            seq.total_computed_tokens += q
            if seq.first_token_at is None:
                seq.computed_tokens += q
            if seq.draft:
                seq.num_tokens -= len(seq.draft)
            seq.num_computed = seq.num_tokens  # what kv.commit just recorded
            if seq.num_tokens == seq.target_len:
                ready.append(b)
        return ready

    def take_failed(self) -> list[Sequence]:
        """The sequences :meth:`fail` ended since the last call (each reported once)."""
        failed, self.failed = self.failed, []
        return failed

    def _admit(self, batch: list[Sequence]) -> None:
        """Admits waiting sequences into what is left of the step (one ``schedule`` call)."""
        budget = self.token_budget - sum(s.num_tokens - s.num_computed for s in batch)
        room = self.max_batch - len(batch)
        if room <= 0 or budget <= 0 or not self._waiting:
            return
        if self.fetch is not None:
            # The queue's head, up to the budget, gets what of it went to disk while it waited
            # read back first, so that the ranking and the admission see it as host hits.
            left = budget
            for seq in list(self._waiting.values()):
                self.fetch(seq)
                left -= len(seq.target)
                if left <= 0:
                    break
        try:
            admitted = self.scheduler.schedule(budget, room)
        except CALL_ERRORS as e:  # no sequence to blame: none admitted this step
            self.last_error = e
            return
        self.last_error = None
        for sid, req in admitted:
            seq = self._waiting.pop(sid, None)
            if seq is None:  # its cancel had failed: nobody wants it any more
                self._close_request(req)
                continue
            del self._sid[seq.id]
            self._start(seq, req)
            batch.append(seq)

    def _grow_running(self, batch: list[Sequence]) -> None:
        """Extends running sequences, oldest first, by what the budget allows, appending them
        to ``batch`` (always the first ``len(batch)`` running ones): one ``extend_many`` call,
        one more after each preemption the pool forces or each sequence that fails."""
        budget = self.token_budget
        while True:
            room = self.max_batch - len(batch)
            plan = self._plan_growth(
                self.running[len(batch) :], budget, room, getattr(self.cache, "window_chunk", None)
            )
            if not plan:
                return
            chunks = [
                seq.tokens(seq.num_tokens, n)
                if not seq.draft
                else [*seq.tokens(seq.num_tokens, n - len(seq.draft)), *seq.draft]
                for seq, n in plan
            ]
            failed = False
            try:
                done = self.cache.extend_many([seq.req for seq, _ in plan], chunks)
            except CALL_ERRORS:  # all or nothing: find the sequence at fault, one at a time
                done, failed = self._extend_one_by_one(plan, chunks)
            for seq, n in plan[:done]:
                seq.num_tokens += n
                budget -= n
                batch.append(seq)
            if failed:  # plan[done] failed and left the running list: plan again
                continue
            if done == len(plan):
                return
            if any(seq.draft for seq, _ in plan[done:]):
                # The pool is short: drafts are the first to go (a plain decode step needs
                # less), before any sequence is preempted for them.
                for seq, _ in plan[done:]:
                    seq.draft = []
                continue
            # The pool is short: the newest running sequence outside the batch makes room.
            self._preempt(self.running[-1])

    def _extend_one_by_one(
        self, plan: list[tuple[Sequence, int]], chunks: list
    ) -> tuple[int, bool]:
        """Extends ``plan``'s sequences one call each, in order, until the pool is short or one
        raises (that one fails); returns ``(how many were extended, whether one failed)``."""
        for k, ((seq, _), chunk) in enumerate(zip(plan, chunks)):
            try:
                got = self.cache.extend_many([seq.req], [chunk])
            except CALL_ERRORS as e:
                self.fail(seq, e)
                return k, True
            if got == 0:
                return k, False
        return len(plan), False

    @staticmethod
    def _plan_growth(
        seqs: list[Sequence], budget: int, room: int, chunk: int | None = None
    ) -> list[tuple[Sequence, int]]:
        """``(sequence, tokens to append)`` for the first of ``seqs`` that fit; ``chunk``
        caps one sequence's tokens (a window pool's ``window_chunk``). A decoding sequence's
        ``draft`` (speculative decoding) comes after its token, cut to what the budget leaves."""
        plan = []
        for seq in seqs:
            if len(plan) >= room or budget <= 0:
                break
            n = min(seq.target_len - seq.num_tokens, budget, chunk or budget)
            if seq.draft:
                seq.draft = seq.draft[: budget - n] if n == 1 else []
                n += len(seq.draft)
            plan.append((seq, n))
            budget -= n
        return plan

    def _start(self, seq: Sequence, req: radixkv.Request) -> None:
        seq.req, seq.status = req, Status.RUNNING
        seq.draft = []  # an admission computes the target, never a draft
        if seq.admitted_at is None:
            seq.admitted_at = time.perf_counter()
        seq.num_tokens, seq.num_computed = req.num_tokens, req.num_computed
        if self.states is not None:
            self.states.start(seq.id, req, len(seq.prompt), bool(seq.children))
        if seq.admissions == 0:  # prompt tokens only (a grammar's forced tokens may follow)
            seq.cached_tokens = min(seq.num_computed, len(seq.prompt))
        seq.admissions += 1
        bisect.insort(self.running, seq, key=_by_id)

    def requeue(self, batch: list[Sequence]) -> None:
        """Puts every sequence of ``batch`` (a step that was interrupted before its commit)
        back in the queue, as a preemption does: nothing of the step is kept."""
        for seq in reversed(batch):
            if seq.status is Status.RUNNING and seq.req is not None:
                self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Aborts ``seq``'s request and queues its whole target again (a sequence the
        scheduler refuses fails). A hybrid model's request that is fully computed (between
        steps) leaves a snapshot of its state first, published by a commit."""
        states, req = self.states, seq.req
        if states is not None and req is not None and seq.num_computed == seq.num_tokens:
            if states.snapshot(seq.id, req, seq.num_computed):
                self.cache.commit(req, seq.num_computed)
        self._close_request(seq.req)
        self._close(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        try:
            self.queue(seq, again=True)
        except CALL_ERRORS as e:
            self.fail(seq, e)

    def _close_request(self, req: radixkv.Request | None) -> None:
        """Aborts ``req``; should the abort raise, it is tried again at the start of every
        later step (:meth:`retry_aborts`) until the request is closed (the cache also aborts a
        request garbage-collected while open)."""
        if req is not None:
            try:
                self.cache.abort(req)
            except CALL_ERRORS:
                self._unclosed.append(req)

    def retry_aborts(self) -> None:
        """Aborts again the requests whose abort raised; forgets those now closed."""
        pending, self._unclosed = self._unclosed, []
        for req in pending:
            if not req.closed:
                self._close_request(req)

    # ---- life cycle -------------------------------------------------------------------------

    def hold(self, parent: Sequence) -> None:
        """A branch context is computed: keep it pinned and queue its branches."""
        self.running.remove(parent)
        if self.states is not None:  # computed: its snapshot was taken at its prompt's end
            self.states.free(parent.id)
        parent.status = Status.HELD
        self.held.append(parent)
        for child in parent.children:
            if not child.done:  # a branch may have been cancelled meanwhile
                self._queue_or_fail(child)

    def _queue_or_fail(self, seq: Sequence) -> None:
        """Queues ``seq``; a sequence the scheduler refuses fails (see :meth:`fail`)."""
        try:
            self.queue(seq)
        except CALL_ERRORS as e:
            self.fail(seq, e)

    def release_held(self) -> bool:
        """Finishes every held context (nothing could be scheduled: unpinning them lets their
        branches enter); returns whether there was one."""
        released = bool(self.held)
        for parent in list(self.held):
            self.finish(parent, "context")
        return released

    def fail(self, seq: Sequence, error: Exception) -> None:
        """Ends ``seq`` with ``finish_reason="error"`` and ``error`` (its request aborted) and
        lists it in :attr:`failed`."""
        if not seq.done:
            seq.error = error
            self.finish(seq, "error", abort=True)
            self.failed.append(seq)

    def finish(self, seq: Sequence, reason: str, abort: bool = False) -> None:
        """Ends ``seq`` wherever it is (waiting, running or held): its request is finished
        (publishing what it computed), or aborted with ``abort`` (publishing nothing more: a
        failed step). Branches of a context that ended before it was computed are queued
        whole. A ``finish`` call that raises one of :data:`CALL_ERRORS` aborts the request
        instead and ends ``seq`` with ``finish_reason="error"`` and that exception."""
        was = seq.status
        self._held_back.pop(seq.id, None)
        sid = self._sid.pop(seq.id, None)
        if sid is not None:
            del self._waiting[sid]
            try:
                self.scheduler.cancel(sid)
            except CALL_ERRORS:
                pass  # should the scheduler admit it later, _admit closes the request
        unexpected: Exception | None = None
        if seq.req is not None:
            if abort:
                self._close_request(seq.req)
            else:
                try:
                    if self.states is not None:  # before finish publishes what it computed
                        self.states.snapshot(seq.id, seq.req, seq.num_computed)
                    if seq.retain or seq.cache_class:
                        seq.retention = self.cache.finish(
                            seq.req, retain=seq.retain, priority=seq.cache_class
                        )
                    else:
                        self.cache.finish(seq.req)
                except Exception as e:  # ends it all the same; a bug propagates afterwards
                    self._close_request(seq.req)
                    reason, seq.error = "error", e
                    if not isinstance(e, CALL_ERRORS):
                        unexpected = e
            self._close(seq)
        if was is Status.RUNNING:
            self.running.remove(seq)
        elif was is Status.HELD:
            self.held.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.finished_at = time.perf_counter()
        seq.generator = None
        self.num_ended += 1
        if was is not Status.HELD:
            for child in seq.children:
                if not child.done and not self.is_queued(child):
                    self._queue_or_fail(child)
        if unexpected is not None:
            raise unexpected

    def _close(self, seq: Sequence) -> None:
        if self.states is not None:
            self.states.free(seq.id)
        seq.req = None
        seq.num_tokens = seq.num_computed = 0


def _by_id(seq: Sequence) -> int:
    return seq.id
