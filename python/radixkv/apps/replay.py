"""Trace replay: a cache and a scheduler over a request trace, without a model.

A discrete-event simulation of one server. Requests arrive at their trace times and wait in a
:class:`radixkv.Scheduler`. Whenever the server is idle it schedules a batch under a token
budget; prefilling the batch's uncached tokens takes ``uncached / prefill_tps`` seconds, after
which the prompts' KV is committed (published for later requests). Each request then decodes
its ``output_length`` tokens at ``decode_tps`` tokens per second (concurrently with others),
holding pages for them (reserved at admission when the pool has room), and finishes: its pages
are released. Output tokens are not published: a trace's later prompts name their content by
token ids or block hashes, which synthetic outputs would never match.

Out: hit rate, evictions, tokens computed, queue waits, time to first token.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

import radixkv
from radixkv.caches import make_cache
from radixkv.trace import TraceRequest

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
    """What one replay measured. Times in seconds of simulated time."""

    config: ReplayConfig
    requests: int = 0
    dropped: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    evicted_pages: int = 0
    queue_waits: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    #: (simulated time, cumulative hit rate) after each admission batch
    hit_curve: list[tuple[float, float]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens of the admitted requests."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def percentile(self, which: str, q: float) -> float:
        """A percentile (0-100) of ``queue_waits`` or ``ttfts``."""
        xs = getattr(self, which)
        return float(np.percentile(xs, q)) if xs else 0.0


def replay(
    requests: Sequence[TraceRequest], config: ReplayConfig, progress: bool = False
) -> ReplayResult:
    """Simulates ``config`` over ``requests`` (sorted by arrival) and returns the figures."""
    cache = make_cache(config.cache, config.num_pages, config.page_size)
    sched = radixkv.Scheduler(cache, config.policy, config.max_wait)
    res = ReplayResult(config)
    arrivals = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    meta: dict[int, int] = {}  # scheduler id -> trace index
    running: list[tuple[float, int, object]] = []  # (finish time, trace index, Request)
    now, nxt = 0.0, 0
    bar = _progress(len(requests), progress, config)

    def reserve_output(idx: int, req) -> None:
        out_len = requests[idx].output_length
        if out_len:
            out = (OUTPUT_BASE + (idx * 8192 + np.arange(out_len)) % OUTPUT_BASE).astype(np.uint32)
            try:
                cache.extend(req, out)
            except radixkv.OutOfPages:
                pass  # the pool is full of live requests: decode without a reservation

    while nxt < len(arrivals) or len(sched) or running:
        while nxt < len(arrivals) and requests[arrivals[nxt]].arrival <= now:
            r = requests[arrivals[nxt]]
            meta[sched.add(r.tokens, r.namespace)] = arrivals[nxt]
            nxt += 1
        while running and running[0][0] <= now:
            _, _, req = heapq.heappop(running)
            cache.finish(req)
        room = config.max_running - len(running)
        batch = sched.schedule(config.token_budget, room) if room > 0 and len(sched) else []
        if batch:
            uncached = sum(req.num_tokens - req.num_cached for _, req in batch)
            done = now + uncached / config.prefill_tps
            for sid, req in batch:
                idx = meta.pop(sid)
                r = requests[idx]
                res.requests += 1
                res.prompt_tokens += req.num_tokens
                res.cached_tokens += req.num_cached
                res.computed_tokens += req.num_tokens - req.num_cached
                res.queue_waits.append(now - r.arrival)
                res.ttfts.append(done - r.arrival)
                cache.commit(req, req.num_tokens)
                reserve_output(idx, req)
                heapq.heappush(running, (done + r.output_length / config.decode_tps, idx, req))
            now = done
            res.hit_curve.append((now, res.hit_rate))
            bar.update(len(batch))
            continue
        upcoming = [
            t
            for t in (_next_arrival(requests, arrivals, nxt), _next_finish(running))
            if t is not None
        ]
        if upcoming:
            now = max(now, min(upcoming))
            continue
        # Nothing runs, nothing arrives, and what waits cannot be admitted even into an empty
        # pool: those prompts are larger than the pool or the token budget.
        for sid in sched.waiting:
            sched.cancel(sid)
            meta.pop(sid)
            res.dropped += 1
            bar.update(1)
    bar.close()
    res.evicted_pages = cache.stats.evicted_pages
    cache.check()
    return res


def _next_arrival(requests: Sequence[TraceRequest], order: list[int], nxt: int) -> float | None:
    return requests[order[nxt]].arrival if nxt < len(order) else None


def _next_finish(running: list[tuple[float, int, object]]) -> float | None:
    return running[0][0] if running else None


def _progress(total: int, enabled: bool, config: ReplayConfig):
    if enabled:
        from tqdm import tqdm

        return tqdm(total=total, desc=f"{config.cache}/{config.policy}", unit="req", leave=False)
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
