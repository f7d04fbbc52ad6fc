"""The thread that drives ``radixkv serve``'s :class:`~radixkv.Engine`, and what the app waits
for of each request (:class:`Pending`).

Every engine call runs on the engine thread: the app hands it closures through a queue and
waits for their answers, so the engine is never used from two threads. Tokens reach the app as
they are sampled (the engine's ``on_token`` events, moved onto the event loop with
``call_soon_threadsafe``).

```text
  HTTP handler ── closure ──> EngineLoop thread: submit / cancel / step
               <── asyncio.Queue <── on_token events, finished Results
```
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import radixkv
from radixkv.engine import DivergedError, StreamEvent


@dataclass
class Pending:
    """What the app waits for of one HTTP request: its engine ids (one per choice), the
    events of each as they come, and each one's final result."""

    loop: asyncio.AbstractEventLoop
    ids: list[int] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    results: dict[int, Any] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class QueueFull(Exception):
    """More requests wait than the server's bound (answered 429)."""


#: Seconds an idle tensor-parallel engine goes without a step: rank 0 then steps an empty
#: one, so that the other ranks, waiting in the broadcast of its next step, never reach their
#: collectives' timeout, and a rank that died is found while nothing is asked.
HEARTBEAT_S = 5.0


class EngineLoop:
    """Owns ``engine`` and steps it on a thread of its own until :meth:`stop`.

    ``max_waiting``: sequences submitted and not yet finished at most (a request of ``n``
    choices over ``k`` prompts is ``n * k`` of them); a request that would pass it is refused
    with :class:`QueueFull`. Finished requests are released from the engine as soon as their results
    are handed over, so memory stays flat however long the server runs.

    A tensor-parallel engine (``Engine(group=...)``, rank 0) is stepped at once and then every
    ``heartbeat_s`` seconds when idle (None: never; the other ranks then time out in their
    collectives after the group's timeout). Once its ranks part (``radixkv.engine.DivergedError``:
    a rank died, stopped answering, or disagreed) it takes no more steps: every request in
    flight fails with the error (a final event with ``finish_reason="error"``, so a stream ends
    with OpenAI's error object), so does every call waiting for the thread or made later, the
    thread ends (``/health`` answers 503) and :attr:`on_fatal`'s callbacks get the error.

    ``overdue_s``: a step that has run for longer is overdue (:meth:`overdue`; ``/health``
    answers 503 while it lasts); None: never."""

    def __init__(
        self,
        engine: radixkv.Engine,
        max_waiting: int = 256,
        heartbeat_s: float | None = HEARTBEAT_S,
        overdue_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.overdue_s = overdue_s
        self.max_waiting = max_waiting
        # Each call with what fails it unrun (None: nobody waits for it).
        self._inbox: queue.Queue[tuple[Callable[[], None], Callable[[BaseException], None] | None]]
        self._inbox = queue.Queue()
        # Held while a call is queued and while the thread, ending, fails the calls left, so
        # that none is queued after that and never run.
        self._gate = threading.Lock()
        self._ended: BaseException | None = None  # why the thread ended, once it has
        self._pending: dict[int, Pending] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-engine", daemon=True)
        self.steps = 0
        #: ``time.monotonic()`` when the step now running began; None between steps.
        self.step_started: float | None = None
        self.error: BaseException | None = None
        #: Called on the engine thread after every step (a KV event publisher's ``publish``).
        self.after_step: list[Callable[[], Any]] = []
        #: Called on the engine thread when it wakes with nothing to step (at least every half
        #: second while idle): a KV event publisher's ``publish``, so that what changed outside
        #: a step (pages the shared tier stored, a flush) is announced without waiting for one.
        self.on_idle: list[Callable[[], Any]] = []
        #: ``hint(prompt, namespace, key)``, called on the engine thread before a request with
        #: a ``prompt_cache_key`` is submitted: the KV event publisher's
        #: :meth:`~radixkv.events.ZmqPublisher.hint` (None: no events published).
        self.hint: Callable[[Any, Any, str], Any] | None = None
        #: Called on the engine thread with the error that parted a tensor-parallel engine's
        #: ranks, as the thread ends (``radixkv serve`` stops the server).
        self.on_fatal: list[Callable[[BaseException], Any]] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finishes the requests in flight (up to ``timeout`` seconds), then ends the thread."""
        self._stop.set()
        self._inbox.put((lambda: None, None))  # wakes it
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def overdue(self) -> str | None:
        """Why the engine is late, if it is: the step now running has run for longer than
        ``overdue_s`` (a rank of a tensor-parallel engine stopped answering, say); else None."""
        started = self.step_started
        if self.overdue_s is None or started is None:
            return None
        took = time.monotonic() - started
        if took <= self.overdue_s:
            return None
        return (
            f"the engine's step has run for {took:.1f} s, more than {self.overdue_s:g} s: "
            "it is overdue"
        )

    def _queue(self, run: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        """Queues ``run`` for the engine thread, or calls ``fail`` with why it will never run."""
        with self._gate:
            ended = self._ended
            if ended is None and not self.alive:
                ended = radixkv.Error("the engine thread is not running")
            if ended is None:
                self._inbox.put((run, fail))
                return
        fail(ended)

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Runs ``fn()`` on the engine thread; a future (of the running event loop) for what it
        returns or raises."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                value = fn()
            except BaseException as e:  # handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, value, None)

        def fail(error: BaseException) -> None:
            loop.call_soon_threadsafe(_settle, fut, None, error)

        self._queue(run, fail)
        return fut

    def call_blocking(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs ``fn()`` on the engine thread from any other thread and returns what it returns
        (raises what it raises)."""
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append((fn(), None))
            except BaseException as e:  # handed to the caller
                box.append((None, e))
            done.set()

        def fail(error: BaseException) -> None:
            box.append((None, error))
            done.set()

        self._queue(run, fail)
        if not done.wait(timeout):
            raise TimeoutError("the engine thread did not run the call in time")
        value, error = box[0]
        if error is not None:
            raise error
        return value

    def submit(
        self, pending: Pending, submit: Callable[[Callable], list[int]], sequences: int = 1
    ) -> None:
        """Engine thread: ``submit(on_token)`` makes the request's ``sequences`` sequences;
        their events and results go to ``pending``. Raises :class:`QueueFull` when they would
        take the sequences in flight past ``max_waiting``."""
        if len(self._pending) + sequences > self.max_waiting:
            raise QueueFull(
                f"{len(self._pending)} sequences are in flight and this request adds "
                f"{sequences}, past the server's bound (--max-waiting {self.max_waiting}): "
                "retry later"
            )
        loop = pending.loop

        def on_token(event: Any) -> None:
            loop.call_soon_threadsafe(pending.events.put_nowait, event)

        ids = submit(on_token)
        pending.ids = list(ids)
        for i in ids:
            self._pending[i] = pending

    def cancel(self, pending: Pending) -> None:
        """Engine thread: cancels every unfinished request of ``pending`` and forgets them."""
        for i in pending.ids:
            if self._pending.pop(i, None) is not None:
                self.engine.cancel(i)
        self.engine.forget_finished()

    def _run(self) -> None:
        fatal = None
        try:
            fatal = self._loop()
        finally:
            with self._gate:  # calls left, or queued as it ended, are failed, not lost
                self._ended = fatal or radixkv.Error("the engine thread stopped")
                while True:
                    try:
                        _, fail = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if fail is not None:
                        fail(self._ended)

    def _loop(self) -> BaseException | None:
        """Steps until stopped (None) or until the ranks part (the error that parted them)."""
        eng = self.engine
        heartbeat = self.heartbeat_s if eng.lockstep is not None else None
        last = -float("inf")  # the first heartbeat at once: the other ranks wait for it
        while True:
            block = not eng.has_work
            if block and self._stop.is_set() and not self._pending:
                return None
            try:
                fn, _ = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                fn()
                while True:  # every call waiting, before the next step
                    self._inbox.get_nowait()[0]()
            except queue.Empty:
                pass
            due = heartbeat is not None and time.monotonic() - last >= heartbeat
            if not eng.has_work and not due:
                for hook in self.on_idle:
                    hook()
                continue
            self.step_started = time.monotonic()
            try:
                results = eng.step()
            except BaseException as e:  # a bug: every waiter is told, the server stays up
                self.error = e
                results = []
                for waiting in {id(p): p for p in self._pending.values()}.values():
                    waiting.loop.call_soon_threadsafe(_fail_pending, waiting, e)
                self._pending.clear()
                if isinstance(e, DivergedError):  # the ranks parted: no step can follow
                    for fatal in self.on_fatal:
                        fatal(e)
                    return e
            finally:
                self.step_started = None
            last = time.monotonic()
            self.steps += 1
            for r in results:
                pending = self._pending.pop(r.id, None)
                if pending is not None:
                    pending.loop.call_soon_threadsafe(_deliver, pending, r)
            if results:
                eng.forget_finished()  # every finished result was handed over above
            for hook in self.after_step:
                hook()


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _deliver(pending: Pending, result: Any) -> None:
    pending.results[result.id] = result
    if all(i in pending.results for i in pending.ids):
        pending.done.set()


def _fail_pending(pending: Pending, error: BaseException) -> None:
    """Every request of ``pending`` not finished yet fails with ``error``: its result, and a
    final event with ``finish_reason="error"`` (a stream then ends with the error object, not
    as if complete)."""
    for i in pending.ids:
        if i not in pending.results:
            pending.results[i] = error
            pending.events.put_nowait(StreamEvent(i, None, "", None, "error"))
    pending.done.set()
