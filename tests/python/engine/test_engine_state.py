"""A state machine over :class:`radixkv.Engine`: random submits, branches, session turns,
cancels and steps, with injected failures (a forward pass that raises an error or is
interrupted, arguments that must be refused, a cache or scheduler call of the step packer that
raises ``OutOfPages``, ``InvalidRequest`` or ``ValueError``) in small pools that preempt. The
failing calls are injected by wrapping the real Rust cache and scheduler the engine's batcher
uses (:class:`OneShot`): every call goes to them, but an armed method raises once instead.

Checked throughout: every finished request's output against a dense greedy recompute of its
prompt (a prefix of it for a request cancelled or failed midway), a refused call registers
nothing, ``run()`` returns within a bounded number of steps, the cache stays consistent, and
every page is returned once all requests are done.
"""

from __future__ import annotations

import functools
import gc

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import budget
import radixkv
from tiny_model import VOCAB, dense_greedy, tiny_model

pytestmark = pytest.mark.robust

MODEL = tiny_model(seed=3)
TRUNK = np.random.default_rng(0).integers(0, VOCAB, 24).astype(np.uint32)
MAX_STEPS = 400  # a run() of this machine's requests takes far fewer


class InjectedError(RuntimeError):
    """What the flaky model raises."""


class FlakyModel(torch.nn.Module):
    """The tiny model; ``armed`` makes its next forward pass raise that exception, or return
    NaN logits (``"nan"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.config = MODEL, MODEL.config
        self.armed: type[BaseException] | str | None = None

    def forward(self, step):
        armed, self.armed = self.armed, None
        if armed == "nan":  # logits of every request NaN: sampling must refuse them
            return torch.full_like(self.inner(step), float("nan"))
        if armed is not None:
            raise armed("injected failure")
        return self.inner(step)


class InjectedOutOfPages(radixkv.OutOfPages):
    """What an armed cache call raises (as the pool running short would)."""


class InjectedInvalidRequest(radixkv.InvalidRequest):
    """What an armed cache call raises (as a closed request would)."""


class InjectedValueError(ValueError):
    """What an armed cache call raises (as a value the Rust side refuses would)."""


CALL_FAULTS = (InjectedOutOfPages, InjectedInvalidRequest, InjectedValueError)


class OneShot:
    """The real cache or scheduler ``real``; a method named in ``armed`` raises that exception
    on its next call, once, instead of running (the raising frame keeps no reference to the
    arguments); everything else goes to ``real``."""

    def __init__(self, real) -> None:
        self.real = real
        self.armed: dict[str, type[Exception]] = {}

    def __getattr__(self, name):
        attr = getattr(self.real, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            exc = self.armed.pop(name, None)
            if exc is None:
                return attr(*args, **kwargs)
            del args, kwargs
            raise exc(f"injected failure of {name}")

        return call


@functools.lru_cache(maxsize=4096)
def dense(prompt: tuple[int, ...], max_new_tokens: int, stop: frozenset[int]) -> list[int]:
    return dense_greedy(MODEL, np.asarray(prompt, dtype=np.uint32), max_new_tokens, stop)


CACHES = {
    "radix-p1": lambda: radixkv.RadixCache(72, page_size=1),
    "radix-p4": lambda: radixkv.RadixCache(20, page_size=4),
    "block-p8": lambda: radixkv.BlockCache(12, page_size=8),
}

prompts = st.builds(
    lambda k, tail: np.concatenate([TRUNK[:k], np.asarray(tail, dtype=np.uint32)]),
    st.integers(0, len(TRUNK)),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
)
suffixes = st.lists(st.integers(0, VOCAB - 1), max_size=4)
namespaces = st.sampled_from([None, "a", b"b"])
BAD = st.sampled_from(
    [
        {"seed": 2**70},
        {"seed": 1.5},
        {"seed": None},
        {"namespace": 5},
        {"priority": 2**40},
        {"max_new_tokens": -1},
        {"temperature": float("nan")},
        {"stop": [VOCAB]},
        {"stop": ["x"]},
        {"prompt": [VOCAB]},
        {"prompt": []},
    ]
)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.eng: radixkv.Engine | None = None
        #: request id -> (prompt, max_new_tokens, stop) as this machine submitted it
        self.want: dict[int, tuple[tuple[int, ...], int, frozenset[int]]] = {}
        self.sessions: list[radixkv.Session] = []
        self.injected: list[BaseException] = []

    @initialize(
        cache=st.sampled_from(sorted(CACHES)),
        budget=st.sampled_from([8, 16, 64]),
        max_batch=st.sampled_from([1, 3, 16]),
        policy=st.sampled_from(["fcfs", "lpm", "dfs-weight"]),
        caching=st.booleans(),
    )
    def setup(self, cache, budget, max_batch, policy, caching):
        self.model = FlakyModel()
        kv = MODEL.make_kv_cache(CACHES[cache]())
        self.eng = radixkv.Engine(
            self.model,
            kv,
            token_budget=budget,
            max_batch=max_batch,
            policy=policy,
            prefix_caching=caching,
        )
        b = self.eng.batcher
        b.cache, b.scheduler = OneShot(b.cache), OneShot(b.scheduler)
        step, self.steps = self.eng.step, [0]

        def counted():
            self.steps[0] += 1
            assert self.steps[0] <= MAX_STEPS, "the engine did not finish in time"
            return step()

        self.eng.step = counted

    # ---- requests in --------------------------------------------------------------------

    @rule(
        prompt=prompts,
        n=st.integers(0, 4),
        stop_at=st.none() | st.integers(0, 3),
        ns=namespaces,
        priority=st.integers(-2, 2),
    )
    def submit(self, prompt, n, stop_at, ns, priority):
        stop = frozenset()
        if stop_at is not None and stop_at < n:
            stop = frozenset([dense(tuple(int(t) for t in prompt), n, frozenset())[stop_at]])
        before = (dict(self.eng.sequences), self.eng.batcher.num_waiting)
        try:
            i = self.eng.submit(prompt, n, stop=stop, namespace=ns, priority=priority)
        except CALL_FAULTS:  # an armed Scheduler.add: refused, nothing registered
            assert (dict(self.eng.sequences), self.eng.batcher.num_waiting) == before
            return
        self.want[i] = (tuple(int(t) for t in prompt), n, stop)

    @rule(bad=BAD, prompt=prompts)
    def refuse(self, bad, prompt):
        before = (dict(self.eng.sequences), self.eng.batcher.num_waiting)
        args = {"prompt": prompt, "max_new_tokens": 2, **bad}
        try:
            self.eng.submit(**args)
        except ValueError:
            pass
        else:
            raise AssertionError(f"submit accepted {bad}")
        if not {"prompt", "priority"} & set(bad):  # branch takes no priority
            args.pop("prompt")
            try:
                self.eng.branch(prompt, [[1], []], **args)
            except ValueError:
                pass
            else:
                raise AssertionError(f"branch accepted {bad}")
        assert (dict(self.eng.sequences), self.eng.batcher.num_waiting) == before

    @rule(context=prompts, tails=st.lists(suffixes, min_size=1, max_size=3), n=st.integers(1, 3))
    def branch(self, context, tails, n):
        before = (dict(self.eng.sequences), self.eng.batcher.num_waiting)
        try:
            got = self.eng.branch(context, tails, max_new_tokens=n)
        except CALL_FAULTS:  # an armed Scheduler.add for the context: nothing registered
            assert (dict(self.eng.sequences), self.eng.batcher.num_waiting) == before
            return
        for i, tail in zip(got, tails):
            full = tuple(int(t) for t in context) + tuple(tail)
            self.want[i] = (full, n, frozenset())

    @rule(system=prompts)
    def new_session(self, system):
        if len(self.sessions) < 3:
            self.sessions.append(radixkv.Session(self.eng, system=system, namespace="chat"))

    @precondition(lambda self: self.sessions)
    @rule(k=st.integers(0, 2), message=suffixes, n=st.integers(1, 3))
    def session_turn(self, k, message, n):
        s = self.sessions[k % len(self.sessions)]
        if len(s.history) + len(message) + n > 40:
            return  # keep every prompt well inside the pool
        before = s.history.copy()
        prompt = tuple(int(t) for t in np.concatenate([before, np.asarray(message, np.uint32)]))
        if not prompt:
            return
        known = set(self.eng.sequences)
        try:
            r = s.send(message, max_new_tokens=n)
        except (InjectedError, KeyboardInterrupt, ValueError, *CALL_FAULTS):
            assert np.array_equal(s.history, before)
            new = set(self.eng.sequences) - known  # none if an armed Scheduler.add refused it
            assert len(new) <= 1
            for i in new:
                self.want[i] = (prompt, n, frozenset())
            return
        assert set(self.eng.sequences) - known == {r.id}
        i = r.id
        assert r.output == dense(prompt, n, frozenset())
        assert np.array_equal(s.history, np.asarray(prompt + tuple(r.output), dtype=np.uint32))
        self.want[i] = (prompt, n, frozenset())

    @precondition(lambda self: self.want)
    @rule(k=st.integers(0, 10**6))
    def cancel(self, k):
        ids = sorted(self.want)
        i = ids[k % len(ids)]
        was_done = self.eng.sequences[i].done
        assert self.eng.cancel(i) == (not was_done)

    # ---- steps and failures -------------------------------------------------------------

    @rule(kind=st.sampled_from([InjectedError, KeyboardInterrupt, "nan"]))
    def arm(self, kind):
        self.model.armed = kind

    @rule(
        call=st.sampled_from(
            [
                ("cache", "extend_many"),
                ("cache", "finish"),
                ("cache", "abort"),
                ("scheduler", "schedule"),
                ("scheduler", "add"),
            ]
        ),
        exc=st.sampled_from(CALL_FAULTS),
    )
    def arm_call(self, call, exc):
        target, method = call
        getattr(self.eng.batcher, target).armed[method] = exc

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            try:
                self.eng.step()
            except KeyboardInterrupt:
                pass

    @invariant()
    def consistent(self):
        if self.eng is None:
            return
        self.eng.cache.check()
        for seq in self.eng.batcher.running + self.eng.batcher.held:
            assert (seq.num_tokens, seq.num_computed) == (seq.req.num_tokens, seq.req.num_computed)
            # Between steps a running request is fully computed (an interrupted step undone).
            assert (
                seq.num_computed == seq.num_tokens < seq.target_len or seq in self.eng.batcher.held
            )
        for i, (prompt, n, stop) in self.want.items():
            seq = self.eng.sequences[i]
            assert tuple(int(t) for t in seq.prompt) == prompt
            if seq.done:
                self.check_result(self.eng.result(i), prompt, n, stop)

    def check_result(self, r, prompt, n, stop) -> None:
        want = dense(prompt, n, stop)
        if r.finish_reason in ("length", "stop"):
            assert r.output == want, (r, want)
            assert r.error is None
        else:
            assert r.finish_reason in ("cancelled", "error"), r
            assert r.output == want[: len(r.output)], (r, want)
            nan = isinstance(r.error, ValueError) and "hold NaN" in str(r.error)
            injected = isinstance(r.error, (InjectedError, *CALL_FAULTS))
            assert (r.finish_reason == "error") == (injected or nan), r

    def teardown(self):
        if self.eng is None:
            return
        self.model.armed = None
        try:
            self.eng.run()
        except KeyboardInterrupt:  # an interrupt armed by the last rule
            self.eng.run()
        assert not self.eng.has_work
        self.consistent()
        gc.collect()  # a request whose abort was made to fail is aborted when collected
        assert self.eng.cache.stats.used_pages == 0


EngineMachine.TestCase.settings = settings(
    max_examples=budget.examples(40, 12),
    derandomize=budget.derandomize(),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestEngineMachine = EngineMachine.TestCase
