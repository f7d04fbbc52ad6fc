"""`Breaker`: the circuit breaker in front of a shared KV store.

A store that is down or hung must cost a bounded time, not a timeout per request: after
``failures`` failed calls in a row the breaker *opens* and every call is skipped at once (the
request computes what the store would have given) for ``cooldown_s`` seconds; then one call is
let through (*half open*): its success closes the breaker, its failure opens it again for
another ``cooldown_s``. So a dead store costs at most one failed call per cooldown per thread
that uses it, and the tier comes back by itself once the store does.

Thread-safe: the engine's thread (reads) and the tier's writer thread share one breaker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: The breaker's states, as the metrics report them (0, 1, 2).
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATES = (CLOSED, OPEN, HALF_OPEN)


class Breaker:
    """A circuit breaker: :meth:`allow` before each call, then :meth:`success` or
    :meth:`failure` after it. ``clock``: seconds, monotonic (a test may pass its own)."""

    def __init__(
        self,
        failures: int = 1,
        cooldown_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise ValueError(f"failures must be a positive int, got {failures!r}")
        if isinstance(cooldown_s, bool) or not isinstance(cooldown_s, (int, float)):
            raise ValueError(f"cooldown_s must be a number of seconds, got {cooldown_s!r}")
        if not cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
        self.failures, self.cooldown_s, self._clock = failures, float(cooldown_s), clock
        self._lock = threading.Lock()
        self.state = CLOSED
        self._failed = 0  # failures in a row
        self._opened_at = 0.0
        #: Times the breaker opened.
        self.trips = 0

    def allow(self) -> bool:
        """Whether to call the store now (False: skip it, the store is taken as failing)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            if self.state == OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self.state = HALF_OPEN
                return True  # the one probe
            return False

    def ready(self) -> bool:
        """Whether :meth:`allow` would let a call through now, without taking the probe (the
        engine's thread asks before handing work to the thread that calls the store)."""
        with self._lock:
            if self.state == CLOSED:
                return True
            return self.state == OPEN and self._clock() - self._opened_at >= self.cooldown_s

    def success(self) -> None:
        """The call answered: the breaker closes."""
        with self._lock:
            self.state, self._failed = CLOSED, 0

    def failure(self) -> None:
        """The call failed: the breaker opens after ``failures`` in a row, or at once when
        half open (the probe failed)."""
        with self._lock:
            self._failed += 1
            if self.state == HALF_OPEN or self._failed >= self.failures:
                if self.state != OPEN:
                    self.trips += 1
                self.state, self._opened_at = OPEN, self._clock()

    def __repr__(self) -> str:
        return f"Breaker(state={self.state!r}, trips={self.trips})"
