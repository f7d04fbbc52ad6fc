"""Random operation sequences against the pure-Python reference models (support/reference.py).

Each state machine drives a real cache and its reference model side by side through every
operation (admit, extend, commit, fork, finish, abort, match_prefix, evict, reset, misuse of a
closed request). Prompts share a few trunks and use a four-token alphabet for their tails, so
hits, splits, concurrent duplicates, evictions and ``OutOfPages`` all happen often in pools of
8-40 pages. After every step both must agree exactly: the same exception type, the same
``num_cached``, the same page tables (page ids included), the same stats; and the real cache's
``check()`` must pass. A seeded run in pools of thousands of pages does the same with long
prompts, so that page ids far from 0 are allocated, evicted and reused.

With a host tier (small device pools; host pools of one page, a few pages, or more than the
device pool) both sides must also log the same copies: after every operation each side's
``drain_copies()`` must return the same rows (kind, src, dst) in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import budget
import radixkv
import reference
from reference import RefBlockCache, RefRadixCache
from reference_window import RefWindowBlockCache, RefWindowRadixCache

NAMESPACES = st.sampled_from([None, "a", b"a", "b", ""])
MAX_LIVE = 12
HOST_STATS = (
    "host_pages",
    "host_free_pages",
    "host_hit_tokens",
    "offloaded_pages",
    "loaded_pages",
    "host_evicted_pages",
)


class Raised:
    """An exception one side raised, compared by type."""

    def __init__(self, exc: BaseException):
        self.exc = exc

    def __repr__(self) -> str:
        return f"Raised({type(self.exc).__name__}: {self.exc})"


def attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (radixkv.Error, ValueError, TypeError) as e:
        return Raised(e)


def request_state(req: Any) -> dict[str, Any]:
    return {
        "num_tokens": req.num_tokens,
        "num_cached": req.num_cached,
        "num_computed": req.num_computed,
        "pages": [int(x) for x in req.pages],
        "slots": [int(x) for x in req.slots],
        "tokens": [int(x) for x in req.tokens],
        "window_pages": [int(x) for x in req.window_pages],
    }


def make_machine(
    kind: str,
    page_size: int,
    trunk_pages: int,
    pool: tuple[int, int],
    host: tuple[int, int] = (0, 0),
    window: tuple[int, int] | None = None,
) -> type[RuleBasedStateMachine]:
    """A state machine class for one cache kind and page size; ``host`` bounds ``host_pages``;
    ``window`` bounds the window of a window group, whose pool is drawn from ``pool`` as well
    and whose host tier (with ``host``) from ``host`` too (reference_window.py is its
    model)."""
    real_cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    ref_cls: Any = RefRadixCache if kind == "radix" else RefBlockCache
    if window is not None:
        ref_cls = RefWindowRadixCache if kind == "radix" else RefWindowBlockCache
    p = page_size
    trunk_len = trunk_pages * p
    trunks = [[1000 * (j + 1) + i for i in range(trunk_len)] for j in range(3)]
    tails = st.lists(st.integers(0, 3), max_size=2 * p + 1)
    prompts = st.builds(
        lambda j, cut, tail: (trunks[j][:cut] + tail) or [0],
        st.integers(0, 2),
        st.integers(0, trunk_len),
        tails,
    )
    picks = st.integers(0, 10**6)

    class Machine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.real: Any = None
            self.ref: Any = None
            self.live: list[tuple[Any, Any]] = []
            self.closed: list[tuple[Any, Any]] = []
            # Prompts seen lately: probing them after every step makes each eviction visible.
            self.seen: list[tuple[list[int], Any]] = []

        def both(self, op: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
            """Runs ``op(cache, side)`` on the model, then on the real cache; same outcome."""
            want = attempt(lambda: op(self.ref, 1))
            got = attempt(lambda: op(self.real, 0))
            if isinstance(want, Raised) or isinstance(got, Raised):
                assert type(getattr(got, "exc", None)) is type(getattr(want, "exc", None)), (
                    f"real {got!r}, reference {want!r}"
                )
            self.same_copies()
            return got, want

        def same_copies(self) -> None:
            """Both sides logged the same copies since the last drain (none without a tier)."""
            got, want = self.real.drain_copies(), self.ref.drain_copies()
            assert isinstance(got, np.ndarray) and got.dtype == np.int32, repr(got)
            assert got.shape == want.shape and got.flags.c_contiguous, (got, want)
            assert got.tolist() == want.tolist(), (
                f"real copies {got.tolist()}, reference {want.tolist()}"
            )
            if not self.ref.host_pages:
                assert got.shape == (0, 3)

        def pick(self, i: int) -> tuple[Any, Any]:
            return self.live[i % len(self.live)]

        def admitted(self, got: Any, want: Any) -> None:
            if not isinstance(want, Raised):
                assert request_state(got) == request_state(want)
                self.live.append((got, want))

        def closing(self, i: int, how: str) -> None:
            pair = self.pick(i)
            # One token more, so that the probe reaches the request's last full page too.
            self.seen = [*self.seen[-7:], ([*pair[1].tokens, 0], pair[1].namespace)]
            self.both(lambda c, s: getattr(c, how)(pair[s]))
            self.live.remove(pair)
            self.closed.append(pair)

        @initialize(
            num_pages=st.integers(*pool),
            host_pages=st.integers(*host),
            win=st.integers(*(window or (0, 0))),
            window_pages=st.integers(*pool),
            window_host=st.integers(*host),
        )
        def create(
            self,
            num_pages: int,
            host_pages: int = 0,
            win: int = 0,
            window_pages: int = 0,
            window_host: int = 0,
        ) -> None:
            if window is not None:
                wh = window_host if host_pages else 0
                args = dict(window=win, window_pages=window_pages, window_host_pages=wh)
                self.real = real_cls(num_pages, p, host_pages, **args)
                self.ref = ref_cls(num_pages, p, host_pages, **args)
                assert (self.real.window, self.real.window_pages) == (win, window_pages)
                assert self.real.window_host_pages == wh
                return
            self.real = real_cls(num_pages, p, host_pages=host_pages)
            self.ref = ref_cls(num_pages, p, host_pages=host_pages)
            assert self.real.host_pages == host_pages

        @precondition(lambda self: len(self.live) < MAX_LIVE)
        @rule(prompt=prompts, ns=NAMESPACES)
        def admit(self, prompt: list[int], ns: Any) -> None:
            self.admitted(*self.both(lambda c, s: c.admit(prompt, ns)))

        @precondition(lambda self: len(self.live) < MAX_LIVE)
        @rule(prompt=prompts, ns=NAMESPACES)
        def admit_and_compute(self, prompt: list[int], ns: Any) -> None:
            """Admit, then commit every token: a prefill that publishes all its full pages."""
            got, want = self.both(lambda c, s: c.admit(prompt, ns))
            self.admitted(got, want)
            if not isinstance(want, Raised):
                self.both(lambda c, s: c.commit((got, want)[s], len(prompt)))

        @precondition(lambda self: self.seen and len(self.live) < MAX_LIVE)
        @rule(i=picks)
        def admit_seen(self, i: int) -> None:
            """A prompt of a closed request again: after evictions, a hit from the host tier."""
            tokens, ns = self.seen[i % len(self.seen)]
            self.admitted(*self.both(lambda c, s: c.admit(tokens, ns)))

        @precondition(lambda self: self.seen and len(self.live) < MAX_LIVE)
        @rule(i=picks, k=st.integers(1, 16), again=st.booleans())
        def evict_then_admit_seen(self, i: int, k: int, again: bool) -> None:
            """Pages go down (to the host, with a tier), then a prompt that had them comes back.
            With ``again``, the very tokens of a closed request, computed in full: the match limit
            leaves its last full page out, so that page is published again (over a host copy)."""
            got, want = self.both(lambda c, s: c.evict(k))
            assert got == want
            if not again:
                self.admit_seen(i)
                return
            tokens, ns = self.seen[i % len(self.seen)]
            got, want = self.both(lambda c, s: c.admit(tokens[:-1], ns))
            self.admitted(got, want)
            if not isinstance(want, Raised):
                self.both(lambda c, s: c.commit((got, want)[s], len(tokens) - 1))

        @precondition(lambda self: 0 < len(self.live) < MAX_LIVE)
        @rule(i=picks, tail=tails)
        def admit_next_turn(self, i: int, tail: list[int]) -> None:
            """A new turn: a live request's tokens plus more, in its namespace."""
            pair = self.pick(i)
            prompt = [int(t) for t in pair[0].tokens] + tail
            ns = pair[0].namespace
            self.admitted(*self.both(lambda c, s: c.admit(prompt, ns)))

        @precondition(lambda self: self.live)
        @rule(i=picks, toks=st.lists(st.integers(0, 3), max_size=p + 2))
        def extend(self, i: int, toks: list[int]) -> None:
            pair = self.pick(i)
            self.both(lambda c, s: c.extend(pair[s], toks))

        @precondition(lambda self: self.live)
        @rule(
            i=picks, eighths=st.integers(0, 8), mode=st.sampled_from(["ok"] * 6 + ["over", "under"])
        )
        def commit(self, i: int, eighths: int, mode: str) -> None:
            pair = self.pick(i)
            n, done = pair[1].num_tokens, pair[1].num_computed
            c = {"ok": done + (n - done) * eighths // 8, "over": n + 1, "under": done - 1}[mode]
            self.both(lambda cache, s: cache.commit(pair[s], c))

        @precondition(lambda self: self.live)
        @rule(i=picks)
        def commit_all(self, i: int) -> None:
            """Everything computed: the common case that makes later admissions hit."""
            pair = self.pick(i)
            self.both(lambda c, s: c.commit(pair[s], pair[s].num_tokens))

        @precondition(lambda self: 0 < len(self.live) < MAX_LIVE)
        @rule(i=picks)
        def fork(self, i: int) -> None:
            pair = self.pick(i)
            self.admitted(*self.both(lambda c, s: c.fork(pair[s])))

        @precondition(lambda self: self.live)
        @rule(i=picks)
        def finish(self, i: int) -> None:
            self.closing(i, "finish")

        @precondition(lambda self: self.live)
        @rule(i=picks)
        def abort(self, i: int) -> None:
            self.closing(i, "abort")

        @rule(prompt=prompts, ns=NAMESPACES)
        def match_prefix(self, prompt: list[int], ns: Any) -> None:
            before = self.real.stats
            got, want = self.both(lambda c, s: c.match_prefix(prompt, ns))
            assert got == want
            assert self.real.stats == before

        @rule(k=st.integers(0, 6))
        def evict(self, k: int) -> None:
            got, want = self.both(lambda c, s: c.evict(k))
            assert got == want

        @rule()
        def reset(self) -> None:
            got, want = self.both(lambda c, s: c.reset())
            assert got == want
            s = self.real.stats
            assert s.host_free_pages == s.host_pages, "reset keeps no host page"

        @precondition(lambda self: self.closed)
        @rule(
            i=st.integers(0, 10**6),
            op=st.sampled_from(["extend", "commit", "fork", "finish", "abort"]),
        )
        def use_closed(self, i: int, op: str) -> None:
            pair = self.closed[i % len(self.closed)]
            args = {"extend": ([1],), "commit": (0,)}.get(op, ())
            got, _ = self.both(lambda c, s: getattr(c, op)(pair[s], *args))
            assert isinstance(got, Raised) and isinstance(got.exc, radixkv.InvalidRequest)
            assert pair[0].closed

        @invariant()
        def agree(self) -> None:
            if self.real is None:
                return
            self.real.check()
            self.ref.check()
            assert self.real.stats.as_dict() == self.ref.stats.as_dict()
            assert set(HOST_STATS) <= self.real.stats.as_dict().keys()
            for got, want in self.live:
                assert request_state(got) == request_state(want)
            for tokens, ns in self.seen:
                assert self.real.match_prefix(tokens, ns) == self.ref.match_prefix(tokens, ns)

    Machine.__name__ = (
        f"{kind.title()}P{p}Host{host[1]}Machine" if host[1] else f"{kind.title()}P{p}Machine"
    )
    if window is not None:
        Machine.__name__ = f"{kind.title()}P{p}Window{window[1]}Machine"
    return Machine


#: ``make test`` runs a derandomized slice of each machine (50 runs); ``make test-long`` the
#: full 250 (300 with a host tier), random.
SETTINGS = settings(
    max_examples=budget.examples(250, 50),
    stateful_step_count=50,
    derandomize=budget.derandomize(),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestRadixP1 = make_machine("radix", 1, trunk_pages=12, pool=(8, 40)).TestCase
TestRadixP1.settings = SETTINGS
TestRadixP2 = make_machine("radix", 2, trunk_pages=8, pool=(8, 32)).TestCase
TestRadixP2.settings = SETTINGS
TestRadixP4 = make_machine("radix", 4, trunk_pages=6, pool=(8, 32)).TestCase
TestRadixP4.settings = SETTINGS
TestBlockP4 = make_machine("block", 4, trunk_pages=6, pool=(8, 32)).TestCase
TestBlockP4.settings = SETTINGS
TestBlockP16 = make_machine("block", 16, trunk_pages=4, pool=(8, 20)).TestCase
TestBlockP16.settings = SETTINGS

# With a host tier: small device pools so that pages go down and come back all the time; host
# pools of one page (every offload evicts the last one), a few pages, and more than the device.
HOST_SETTINGS = settings(SETTINGS, max_examples=budget.examples(300, 50))


def host_case(kind: str, p: int, trunk_pages: int, pool: tuple[int, int], host: tuple[int, int]):
    """The TestCase of a machine with a host tier, under ``HOST_SETTINGS``."""
    case = make_machine(kind, p, trunk_pages=trunk_pages, pool=pool, host=host).TestCase
    case.settings = HOST_SETTINGS
    return case


TestRadixP1Host1 = host_case("radix", 1, 8, pool=(4, 12), host=(1, 1))
TestRadixP1HostLarge = host_case("radix", 1, 8, pool=(4, 12), host=(6, 40))
TestRadixP2HostSmall = host_case("radix", 2, 6, pool=(4, 12), host=(1, 6))
TestRadixP4HostSmall = host_case("radix", 4, 4, pool=(4, 10), host=(1, 4))
TestRadixP4HostLarge = host_case("radix", 4, 4, pool=(4, 10), host=(10, 30))
TestBlockP4Host1 = host_case("block", 4, 4, pool=(4, 10), host=(1, 1))
TestBlockP4HostSmall = host_case("block", 4, 4, pool=(4, 12), host=(1, 6))
TestBlockP16HostLarge = host_case("block", 16, 3, pool=(4, 10), host=(8, 30))


LARGE = [("radix", 1, 4500, 0), ("radix", 16, 600, 0), ("block", 4, 5000, 0)]
LARGE_HOST = [("radix", 4, 900, 300), ("block", 4, 900, 300)]


@pytest.mark.parametrize(
    "kind,p,num_pages,host_pages",
    LARGE + LARGE_HOST,
    ids=[f"{k}-p{p}" + (f"-host{h}" if h else "") for k, p, _, h in LARGE + LARGE_HOST],
)
def test_large_pool_against_the_reference(kind, p, num_pages, host_pages):
    """Long prompts in a pool of thousands of pages: page ids far from 0 (past the first 4096 at
    P=1) are allocated, evicted and reused in the same order as the reference model's; with a
    host tier, hundreds of pages go down and come back with the same copies."""
    rng = random.Random(f"{kind}-{p}-{host_pages}")
    machine = make_machine(kind, p, trunk_pages=1, pool=(num_pages, num_pages))()
    machine.create(num_pages=num_pages, host_pages=host_pages)
    span = num_pages * p // 3
    trunks = [[rng.randrange(1 << 32) for _ in range(span)] for _ in range(3)]

    def prompt() -> list[int]:
        cut = rng.randint(1, span)
        return rng.choice(trunks)[:cut] + [rng.randint(0, 3) for _ in range(rng.randint(0, 2 * p))]

    for _ in range(150):
        op = rng.choice(
            [
                "admit",
                "admit",
                "turn",
                "commit_all",
                "commit",
                "extend",
                "fork",
                "finish",
                "finish",
                "abort",
                "match_prefix",
                "evict",
                "again",
            ]
        )
        live = bool(machine.live)
        i = rng.randrange(10**6)
        if op == "admit" and len(machine.live) < MAX_LIVE:
            machine.admit(prompt(), rng.choice([None, "x"]))
        elif op == "turn" and live and len(machine.live) < MAX_LIVE:
            machine.admit_next_turn(i, [rng.randint(0, 3) for _ in range(rng.randint(0, 3 * p))])
        elif op == "commit_all" and live:
            machine.commit_all(i)
        elif op == "commit" and live:
            machine.commit(i, rng.randint(0, 8), "ok")
        elif op == "extend" and live:
            machine.extend(i, [rng.randint(0, 3) for _ in range(rng.randint(1, 3 * p))])
        elif op == "fork" and live and len(machine.live) < MAX_LIVE:
            machine.fork(i)
        elif op in ("finish", "abort") and live:
            machine.closing(i, op)
        elif op == "match_prefix":
            machine.match_prefix(prompt(), None)
        elif op == "again" and machine.seen and len(machine.live) < MAX_LIVE:
            machine.admit_seen(i)
        elif op == "evict":
            machine.evict(rng.randint(0, 6) * rng.choice([1, 100]))
        machine.agree()
    s = machine.real.stats
    assert s.evicted_pages > 0
    assert s.hit_tokens > 0
    if host_pages:
        assert s.offloaded_pages > 0 and s.loaded_pages > 0 and s.host_hit_tokens > 0


def test_copy_kinds_are_the_module_constants():
    """The models log the kinds that ``drain_copies`` documents."""
    assert (reference.OFFLOAD, reference.LOAD) == (radixkv.COPY_OFFLOAD, radixkv.COPY_LOAD)
    assert (radixkv.COPY_OFFLOAD, radixkv.COPY_LOAD) == (0, 1)


@pytest.mark.parametrize("kind", ["radix", "block"])
@pytest.mark.parametrize("host_pages", [-1, 2**31 - 4, 1.5, True])
def test_bad_host_pages_are_refused_alike(kind, host_pages):
    """A bad ``host_pages`` raises the same error, with the same message naming the value."""
    real_cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    ref_cls = RefRadixCache if kind == "radix" else RefBlockCache
    with pytest.raises((TypeError, ValueError)) as want:
        ref_cls(4, 4, host_pages=host_pages)
    with pytest.raises(want.type) as got:
        real_cls(4, 4, host_pages=host_pages)
    assert str(got.value) == str(want.value)
    assert repr(host_pages) in str(want.value) or type(host_pages).__name__ in str(want.value)


# With a window group: windows shorter and longer than a page, pools from tight (every admission
# evicts window pages, hits are cut) to roomy. The window pages, their ids, the hit lengths and
# the window counters of the real caches must be those of reference_window.py.
def window_case(kind: str, p: int, trunk_pages: int, pool: tuple[int, int], window: tuple):
    """The TestCase of a machine with a window group, under ``SETTINGS``."""
    case = make_machine(kind, p, trunk_pages=trunk_pages, pool=pool, window=window).TestCase
    case.settings = SETTINGS
    return case


TestRadixP1Window = window_case("radix", 1, 12, pool=(6, 40), window=(1, 10))
TestRadixP4Window = window_case("radix", 4, 6, pool=(4, 24), window=(1, 14))
TestBlockP4Window = window_case("block", 4, 6, pool=(4, 24), window=(1, 14))
TestBlockP16Window = window_case("block", 16, 4, pool=(4, 16), window=(4, 40))


# Both groups' host tiers: full pages and window pages go down and come back; every window copy,
# its page ids and order, must be reference_window.py's.
def window_host_case(kind: str, p: int, trunk_pages: int, pool: tuple, window: tuple, host: tuple):
    case = make_machine(
        kind, p, trunk_pages=trunk_pages, pool=pool, host=host, window=window
    ).TestCase
    case.settings = SETTINGS
    return case


TestRadixP1WindowHost = window_host_case("radix", 1, 12, (6, 40), (1, 10), (1, 24))
TestRadixP4WindowHost = window_host_case("radix", 4, 6, (4, 24), (1, 14), (1, 12))
TestBlockP4WindowHost = window_host_case("block", 4, 6, (4, 24), (1, 14), (1, 12))
