"""Rank 0 records, the other ranks replay: the calls of a tensor-parallel engine.

Under ``Engine(group=...)`` rank 0 alone takes the calls that change the engine (``submit``,
``branch``, ``cancel``, ``release``, the clock, retention, ...). Each is applied on rank 0 and
kept as a picklable tuple ``(kind, *args)``; at the next step they are broadcast, and every other
rank applies them in order (:meth:`Replay.follow`) before stepping in lockstep. What each kind
does is the engine's: it hands :class:`Replay` a table of handlers (kind -> callable), so this
module knows the protocol (who may call, when the lockstep is over, what a failure ends) and
nothing of the engine.

Where things live: :mod:`radixkv.engine.lockstep` is the transport and the checks (the
collectives, the divergence verdicts, :class:`~radixkv.engine.lockstep.Lockstep.abandon`);
this module is the calls on top of it: rank 0's record, the other ranks' replay loop, the
guard that refuses a call on the wrong rank or after :meth:`Replay.close`, and the one error
that ends the lockstep (kept in :attr:`Replay.broken` and raised again by every later call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import radixkv
from radixkv.engine.lockstep import LeaderClosedError, Lockstep

T = TypeVar("T")


class Replay:
    """Rank 0's record of its calls, and the other ranks' replay of them, over ``lockstep``
    (None: no group; every call is taken and nothing is recorded). ``handlers``: what each kind
    of call does on this rank, given the call's arguments."""

    def __init__(
        self, lockstep: Lockstep | None, handlers: Mapping[str, Callable[..., Any]]
    ) -> None:
        self.lockstep = lockstep
        self.handlers = dict(handlers)
        #: Rank 0: the calls taken since its last step.
        self.calls: list[tuple] = []
        #: Whether rank 0 closed the engine.
        self.closed = False
        #: The error that stopped the lockstep, raised again by later calls.
        self.broken: radixkv.Error | None = None

    @property
    def rank(self) -> int:
        """This rank (0 without a group)."""
        return 0 if self.lockstep is None else self.lockstep.rank

    def lead(self, what: str) -> None:
        """Refuses ``Engine.what`` (a call that changes the engine) on ranks other than 0, after
        :meth:`close`, and once the ranks diverged."""
        if self.broken is not None:
            raise self.broken
        if self.lockstep is None:
            return
        if self.lockstep.rank != 0:
            raise radixkv.Error(
                f"Engine.{what} is taken by rank 0 only; rank {self.lockstep.rank} replays rank "
                "0's calls in Engine.follow()"
            )
        if self.closed:
            raise radixkv.Error(f"Engine.{what}: this engine is closed (Engine.close())")

    def record(self, call: tuple) -> None:
        """Rank 0: keeps ``call`` for the broadcast of the next step."""
        if self.lockstep is not None:
            self.calls.append(call)

    def replay(self, call: tuple) -> None:
        """Other ranks: applies one of rank 0's calls exactly as rank 0 did."""
        kind, *args = call
        handler = self.handlers.get(kind)
        if handler is None:
            raise radixkv.Error(f"rank {self.rank}: unknown call {kind!r} from rank 0")
        handler(*args)

    def step(self, step: Callable[[], T]) -> T:
        """Rank 0: broadcasts the calls taken since the last step, then runs ``step`` (this
        rank's forward pass and sampling); an error ends the lockstep (:meth:`leave`)."""
        assert self.lockstep is not None
        try:
            t = time.perf_counter()
            calls, self.calls = self.calls, []
            self.lockstep.send(calls)
            self.lockstep.send_s += time.perf_counter() - t
            return step()
        except BaseException as e:
            err = self.leave(e)
            if err is e:
                raise
            raise err from e

    def follow(self, step: Callable[[], object]) -> int:
        """Other ranks: replays rank 0's calls and runs ``step`` in lockstep with it until rank
        0 calls :meth:`close`; returns the number of steps taken."""
        lock = self.lockstep
        if lock is None or lock.rank == 0:
            raise radixkv.Error("Engine.follow is for ranks other than 0 of an engine's group")
        if self.broken is not None:
            raise self.broken
        if self.closed:
            raise LeaderClosedError(
                f"Engine.follow on rank {self.rank}: rank 0 closed this engine (Engine.close()), "
                "it sends no more steps"
            )
        steps = 0
        try:
            while True:
                calls, close = lock.receive()
                for call in calls:
                    self.replay(call)
                if close:
                    self.closed = True
                    lock.check_close()
                    return steps
                step()
                steps += 1
        except BaseException as e:
            err = self.leave(e)
            if err is e:
                raise
            raise err from e

    def close(self) -> None:
        """Rank 0: sends the calls taken since the last step and ends the other ranks'
        :meth:`follow`, whose last check it waits for; no more calls are taken. A no-op without
        a group, on other ranks, and when closed already."""
        if self.lockstep is None or self.closed:
            return
        self.closed = True
        if self.lockstep.rank == 0 and self.broken is None:
            calls, self.calls = self.calls, []
            try:
                self.lockstep.send(calls, close=True)
                self.lockstep.check_close()
            except BaseException as e:
                err = self.leave(e)
                if err is e:
                    raise
                raise err from e

    def leave(self, error: BaseException) -> BaseException:
        """``error`` left this rank's step, ``follow`` or ``close``. The lockstep ends on every
        rank (:meth:`Lockstep.abandon`: the others raise ``DivergedError``) and later calls
        raise it; returns what to raise (``error`` itself when it is the lockstep's error, or
        not an ``Exception``: an interrupt)."""
        assert self.lockstep is not None
        err = self.lockstep.abandon(error)
        self.broken = err
        return error if err is error or not isinstance(error, Exception) else err
