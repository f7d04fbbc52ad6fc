"""Trace replay: a cache and a scheduler over a request trace, without a model.

A discrete-event simulation of one server that works in batches. Requests arrive at their trace
times and are queued in a :class:`radixkv.Scheduler`; one that the pool could never hold (its
prompt and output together) is dropped. Whenever the server is idle it forms a batch under a
token budget: first the next chunks of prompts admitted in part by earlier batches (oldest first),
then admissions with the budget left, where a prompt longer than what is left is admitted in part
(chunked prefill). Computing a batch takes ``tokens / prefill_tps`` seconds; then its KV is
committed (published for later requests). A request whose whole prompt is computed has its first
token (TTFT), then decodes its ``output_length`` tokens at ``decode_tps`` tokens per second
(concurrently with others), holding pages for them (reserved when the pool has room), and
finishes: its pages are released. Output tokens are not published: a trace's later prompts name
their content by token ids or block hashes, which synthetic outputs would never match.

Prompts in progress grow before anything new is admitted, so at most one is in progress at a
time (the last one a batch admitted). Short of pages, its next chunk waits, and admissions with
it, for decodes to finish and release theirs; it fits the pool alone, so it never waits forever.

Out: hit rate, evictions, tokens computed, queue waits, time to first token.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

import radixkv
from radixkv.apps.args import progress_bar
from radixkv.apps.caches import make_cache
from radixkv.apps.trace import TraceRequest

OUTPUT_BASE = 2**31  # output token ids live above every Mooncake prompt id


@dataclass
class ReplayConfig:
    """Knobs of one simulated server."""

    cache: str = "radix"
    page_size: int = 16
    num_pages: int = 65536
    policy: str = "lpm"
    max_wait: int = 256
    prefill_tps: float = 50_000.0
    decode_tps: float = 50.0
    token_budget: int = 131_072
    max_running: int = 64


@dataclass
class ReplayResult:
    """What one replay measured. Times in seconds of simulated time.

    ``requests``: requests admitted; ``prompt_tokens``, ``cached_tokens`` and
    ``computed_tokens``: their prompt tokens, those found cached at admission and those computed
    (``cached + computed == prompt``); ``dropped``: requests the pool could never hold."""

    config: ReplayConfig
    requests: int = 0
    dropped: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    evicted_pages: int = 0
    queue_waits: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    #: (simulated time, cumulative hit rate) after each batch
    hit_curve: list[tuple[float, float]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens of the admitted requests."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def percentile(self, which: str, q: float) -> float:
        """A percentile (0-100) of ``queue_waits`` or ``ttfts``."""
        xs = getattr(self, which)
        return float(np.percentile(xs, q)) if xs else 0.0


@dataclass(eq=False)
class _Prefill:
    """A prompt being computed: its trace index, its request and the request's counts."""

    idx: int
    req: radixkv.Request
    num_tokens: int
    num_computed: int


class _Server:
    """The simulated server's state; :func:`replay` drives it through time."""

    def __init__(self, requests: Sequence[TraceRequest], config: ReplayConfig, bar) -> None:
        self.requests, self.config, self.bar = requests, config, bar
        self.cache = make_cache(config.cache, config.num_pages, config.page_size)
        self.sched = radixkv.Scheduler(self.cache, config.policy, config.max_wait)
        self.res = ReplayResult(config)
        self.waiting: dict[int, int] = {}  # scheduler id -> trace index
        self.prefilling: list[_Prefill] = []  # admission order
        self.decoding: list[tuple[float, int, radixkv.Request]] = []  # heap by finish time

    def queue(self, idx: int) -> None:
        """Queues request ``idx``, or drops it when the pool could never hold it."""
        r = self.requests[idx]
        try:
            sid = self.sched.add(r.tokens, r.namespace, max_new_tokens=r.output_length)
        except ValueError:
            self.res.dropped += 1
            self.bar.update(1)
            return
        self.waiting[sid] = idx

    def release_decodes(self, now: float) -> None:
        """Finishes the requests whose decoding has ended by ``now``."""
        while self.decoding and self.decoding[0][0] <= now:
            self.cache.finish(heapq.heappop(self.decoding)[2])

    def run_batch(self, now: float) -> float | None:
        """Forms one batch at ``now`` and computes it; returns when it is done (None: nothing
        could be computed)."""
        work, blocked = self._grow(self.config.token_budget)
        budget = self.config.token_budget - sum(n for _, n in work)
        room = self.config.max_running - len(self.decoding) - len(self.prefilling)
        if not blocked and budget > 0 and room > 0 and self.waiting:
            for sid, req in self.sched.schedule(budget, room):
                job = self._admit(self.waiting.pop(sid), req, now)
                work.append((job, job.num_tokens - job.num_computed))
        if not work:
            return None
        tokens = sum(n for _, n in work)
        done = now + tokens / self.config.prefill_tps
        self.cache.commit_many([j.req for j, _ in work], [j.num_tokens for j, _ in work])
        self.res.computed_tokens += tokens
        for job, _ in work:
            job.num_computed = job.num_tokens
            if job.num_tokens == len(self.requests[job.idx].tokens):
                self._decode(job, done)
        self.res.hit_curve.append((done, self.res.hit_rate))
        return done

    def _grow(self, budget: int) -> tuple[list[tuple[_Prefill, int]], bool]:
        """Appends the next chunk of each prompt in progress, oldest first, in one call; stops
        at the first the pool cannot supply. Returns ``(job, tokens)`` pairs and whether one
        was refused."""
        plan = []
        for job in self.prefilling:
            if budget <= 0:
                break
            n = min(len(self.requests[job.idx].tokens) - job.num_tokens, budget)
            plan.append((job, n))
            budget -= n
        chunks = [self.requests[j.idx].tokens[j.num_tokens : j.num_tokens + n] for j, n in plan]
        grown = self.cache.extend_many([j.req for j, _ in plan], chunks) if plan else 0
        for job, n in plan[:grown]:
            job.num_tokens += n
        return plan[:grown], grown < len(plan)

    def _admit(self, idx: int, req: radixkv.Request, now: float) -> _Prefill:
        job = _Prefill(idx, req, req.num_tokens, req.num_computed)
        res = self.res
        res.requests += 1
        res.prompt_tokens += len(self.requests[idx].tokens)
        res.cached_tokens += job.num_computed
        res.queue_waits.append(now - self.requests[idx].arrival)
        self.prefilling.append(job)
        return job

    def _decode(self, job: _Prefill, now: float) -> None:
        """The prompt of ``job`` is computed: first token at ``now``, then decoding."""
        self.prefilling.remove(job)
        r = self.requests[job.idx]
        self.res.ttfts.append(now - r.arrival)
        if r.output_length:
            ids = job.idx * 8192 + np.arange(r.output_length)
            out = (OUTPUT_BASE + ids % OUTPUT_BASE).astype(np.uint32)
            try:
                self.cache.extend(job.req, out)
            except radixkv.OutOfPages:
                pass  # the pool is full of live requests: decode without a reservation
        end = now + r.output_length / self.config.decode_tps
        heapq.heappush(self.decoding, (end, job.idx, job.req))
        self.bar.update(1)


def replay(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    progress: bool = False,
    on_start: Callable[[radixkv.RadixCache | radixkv.BlockCache, radixkv.Scheduler], None]
    | None = None,
) -> ReplayResult:
    """Simulates ``config`` over ``requests`` and returns the figures. ``on_start(cache,
    scheduler)`` is called once the simulated server's cache and scheduler exist (to watch
    them, e.g. serve their metrics)."""
    server = _Server(requests, config, _progress(len(requests), progress, config))
    if on_start is not None:
        on_start(server.cache, server.sched)
    arrivals = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    now, nxt = 0.0, 0
    while nxt < len(arrivals) or server.waiting or server.prefilling or server.decoding:
        while nxt < len(arrivals) and requests[arrivals[nxt]].arrival <= now:
            server.queue(arrivals[nxt])
            nxt += 1
        server.release_decodes(now)
        done = server.run_batch(now)
        if done is not None:
            now = done
            continue
        upcoming = [
            t
            for t in (_next_arrival(requests, arrivals, nxt), _next_finish(server.decoding))
            if t is not None
        ]
        if upcoming:
            now = max(now, min(upcoming))
        elif server.waiting or server.prefilling:  # each fits the pool alone: never happens
            raise RuntimeError(
                f"replay stalled on an idle pool: {len(server.waiting)} requests waiting, "
                f"{len(server.prefilling)} in progress"
            )
    server.bar.close()
    server.res.evicted_pages = server.cache.stats.evicted_pages
    server.cache.check()
    return server.res


def _next_arrival(requests: Sequence[TraceRequest], order: list[int], nxt: int) -> float | None:
    return requests[order[nxt]].arrival if nxt < len(order) else None


def _next_finish(decoding: list[tuple[float, int, radixkv.Request]]) -> float | None:
    return decoding[0][0] if decoding else None


def _progress(total: int, enabled: bool, config: ReplayConfig):
    if enabled:
        return progress_bar(
            total=total, desc=f"{config.cache}/{config.policy}", unit="req", leave=False
        )
    return _NoBar()


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def infinite_bound(requests: Iterable[TraceRequest], page_size: int) -> float:
    """Hit rate of an unbounded cache serving the requests one by one in arrival order: the
    most any policy or pool size can reach at this page size."""
    reqs = sorted(requests, key=lambda r: r.arrival)
    total = sum(len(r.tokens) for r in reqs)
    cache = radixkv.RadixCache(max(1, total // page_size + len(reqs)), page_size)
    for r in reqs:
        req = cache.admit(r.tokens, r.namespace)
        cache.commit(req, req.num_tokens)
        cache.finish(req)
    return cache.stats.hit_rate
