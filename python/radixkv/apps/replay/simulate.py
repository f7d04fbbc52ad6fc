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

Host tier (``host_pages > 0``): each cache gets a second pool of host pages (see the host tier
section of ``docs/SEMANTICS.md``): pages it would evict go down to the host, and a prefix found
there is copied back at admission. The replay owns no tensors: after every cache call that can
allocate it drains the cache's copy log (``drain_copies()``) and counts the loads and offloads.
A batch takes ``loads * page_bytes / host_bandwidth + tokens / prefill_tps`` seconds, where
``loads`` are the host pages its admissions brought back and ``page_bytes = page_size *
kv_bytes_per_token``: loading a cached prefix costs ``kv_bytes_per_token / host_bandwidth``
seconds per token against ``1 / prefill_tps`` to compute it again. The loads are not overlapped
with the batch's compute (conservative: ``KVCache`` overlaps them layer by layer). Offloads are
not costed: they go the other way over the link, at most ``prefill_tps * kv_bytes_per_token``
bytes per second in the long run (6.6 GB/s at the defaults), and ``KVCache`` runs them on a side
stream beside the compute. With ``host_pages == 0`` none of this runs and every figure is as
without the tier.

Disk tier (``disk_pages > 0``, with a host tier): pages the host tier drops go to disk (see
``docs/SEMANTICS.md``, "Disk tier"). As :class:`radixkv.Engine` does, a request's pages on disk
past the device and host match are read back into the host tier when it arrives
(``disk_prefetch``, every page taken as good), and again before each admission for the requests
at the head of the queue (arrival order, up to the token budget: what went back to disk while
they waited), so that the admission finds them as host hits. The batch waits for
the reads as well, at ``disk_bandwidth`` (``reads * page_bytes / disk_bandwidth``, not
overlapped: conservative); the spills to disk are not costed (written in the background).
``disk_hit_tokens``: of a batch's host hits, the tokens read back for its admitted requests (at
most each one's hit).

Replicas (:func:`replay_replicas`): K such servers, each with its own cache and pool, behind a
router that sends each request, at its arrival, to one of them. The servers run side by side in
simulated time: before a request is routed every server has run up to its arrival, so the router
sees each one's cache and load as they are then. The load of a replica is its *outstanding
tokens*: the prompt tokens of the requests routed to it whose first token has not come yet
(queued, or in a batch that has not ended): the prefill work a new request would find ahead of
it, which is what its time to first token waits for. The routers (:data:`ROUTERS`):

- ``round-robin``: replica ``i mod K`` for the ``i``-th request in arrival order.
- ``least-loaded``: the replica with the fewest outstanding tokens (ties: the lower index).
- ``prefix``: the replica whose cache holds the longest prefix of the prompt
  (``cache.match_prefix``, which changes nothing; ties: the lower load, then the lower index),
  unless its load exceeds the least-loaded replica's by more than ``balance_threshold`` tokens:
  then the least-loaded one. SGLang's router documents the same rule for its cache-aware policy
  (with loads counted in requests).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

import radixkv
from radixkv.apps.common.args import progress_bar
from radixkv.apps.common.caches import make_cache
from radixkv.apps.common.trace import TraceRequest

OUTPUT_BASE = 2**31  # output token ids live above every Mooncake prompt id

#: The routers of :func:`replay_replicas`.
ROUTERS = ("round-robin", "prefix", "least-loaded")

#: Default of ``balance_threshold``, in outstanding tokens: one full batch at the default token
#: budget, about 2.6 s of prefill at the default 50,000 tokens/s. The replica holding the longest
#: prefix is kept while it has at most one batch more of prefill ahead than the least-loaded one.
DEFAULT_BALANCE_THRESHOLD = 131_072.0

#: Default of ``host_bandwidth``, in bytes per second host to device: 25 GB/s. An assumption, not
#: a measurement: about what host-to-device copies from pinned memory sustain over a PCIe 4.0 x16
#: link, whose nominal rate is about 31.5 GB/s per direction (16 GT/s x 16 lanes, 128b/130b).
DEFAULT_HOST_BANDWIDTH = 25e9

#: Default of ``disk_bandwidth``, in bytes per second disk to host: 5 GB/s. An assumption, not a
#: measurement: about what one PCIe 4.0 NVMe drive sustains in large sequential reads (drives
#: are sold at 5-7 GB/s); ``benches/bench_disk.py`` measures the disk it runs on.
DEFAULT_DISK_BANDWIDTH = 5e9

#: Default of ``kv_bytes_per_token``: the KV of one token of Llama-3-8B in bf16, 128 KiB
#: (32 layers x 8 KV heads x 128 dims x 2 tensors, K and V, x 2 bytes).
DEFAULT_KV_BYTES_PER_TOKEN = 131_072


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
    #: host tier size in pages (0: none); ``host_bandwidth`` (bytes per second host to device)
    #: and ``kv_bytes_per_token`` cost its loads
    host_pages: int = 0
    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    #: disk tier size in pages (0: none; needs a host tier); ``disk_bandwidth`` (bytes per
    #: second disk to host) costs its reads
    disk_pages: int = 0
    disk_bandwidth: float = DEFAULT_DISK_BANDWIDTH
    #: a window group (0: none): the sliding window of the model's window layers, in tokens,
    #: and the pages of their pool (see SEMANTICS.md, "Sliding-window layers")
    window: int = 0
    window_pages: int = 0
    #: with a host tier: the window group's own host tier, in pages (None: ``host_pages``)
    window_host_pages: int | None = None

    def __post_init__(self) -> None:
        for name in ("window", "window_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        wh = self.window_host_pages
        if wh is not None and (isinstance(wh, bool) or not isinstance(wh, int) or wh < 0):
            raise ValueError(f"window_host_pages must be an int >= 0 or None, got {wh!r}")
        if bool(self.window) != bool(self.window_pages):
            raise ValueError(
                f"window={self.window} and window_pages={self.window_pages}: give both or neither"
            )
        hp = self.host_pages
        if isinstance(hp, bool) or not isinstance(hp, int) or hp < 0:
            raise ValueError(f"host_pages must be an int >= 0, got {hp!r}")
        dp = self.disk_pages
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 0:
            raise ValueError(f"disk_pages must be an int >= 0, got {dp!r}")
        if dp and not hp:
            raise ValueError(f"disk_pages={dp} needs a host tier (host_pages > 0)")
        dbw = self.disk_bandwidth
        if isinstance(dbw, bool) or not isinstance(dbw, (int, float)) or not 0 < dbw < math.inf:
            raise ValueError(f"disk_bandwidth must be a finite number > 0, got {dbw!r}")
        bw = self.host_bandwidth
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 < bw < math.inf:
            raise ValueError(f"host_bandwidth must be a finite number > 0, got {bw!r}")
        kv = self.kv_bytes_per_token
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
            raise ValueError(f"kv_bytes_per_token must be an int >= 1, got {kv!r}")

    @property
    def page_load_seconds(self) -> float:
        """Seconds one page takes to load from the host tier."""
        return self.page_size * self.kv_bytes_per_token / self.host_bandwidth

    @property
    def page_read_seconds(self) -> float:
        """Seconds one page takes to read from the disk tier."""
        return self.page_size * self.kv_bytes_per_token / self.disk_bandwidth


class _HitRates:
    """The hit rates of a result that has ``prompt_tokens``, ``cached_tokens`` and
    ``host_hit_tokens``."""

    if TYPE_CHECKING:  # fields of ReplayResult, sums over replicas of RoutedResult

        @property
        def prompt_tokens(self) -> int: ...
        @property
        def cached_tokens(self) -> int: ...
        @property
        def host_hit_tokens(self) -> int: ...
        @property
        def disk_hit_tokens(self) -> int: ...

    @property
    def hit_rate(self) -> float:
        """Cached over prompt tokens of the admitted requests."""
        return _rate(self.cached_tokens, self.prompt_tokens)

    @property
    def device_hit_rate(self) -> float:
        """Prompt tokens found cached on the device, over prompt tokens."""
        return _rate(self.cached_tokens - self.host_hit_tokens, self.prompt_tokens)

    @property
    def host_hit_rate(self) -> float:
        """Prompt tokens found cached on the host (and loaded back) that were not read back
        from disk for the request, over prompt tokens."""
        return _rate(self.host_hit_tokens - self.disk_hit_tokens, self.prompt_tokens)

    @property
    def disk_hit_rate(self) -> float:
        """Prompt tokens read back from disk for the request and served to it, over prompt
        tokens."""
        return _rate(self.disk_hit_tokens, self.prompt_tokens)


@dataclass
class ReplayResult(_HitRates):
    """What one replay measured. Times in seconds of simulated time.

    ``requests``: requests admitted; ``prompt_tokens``, ``cached_tokens`` and
    ``computed_tokens``: their prompt tokens, those found cached at admission and those computed
    (``cached + computed == prompt``); ``dropped``: requests the pool could never hold.

    Host tier (all 0 without one): ``host_hit_tokens``, the cached tokens that were on the host
    (loaded back; the rest of ``cached_tokens`` were on the device); ``loaded_pages`` and
    ``offloaded_pages``, the copies drained from the cache's log; ``host_evicted_pages``, pages
    dropped from the host tier; ``load_seconds``, simulated time batches spent waiting for
    loads (included in ``ttfts``)."""

    config: ReplayConfig
    requests: int = 0
    dropped: int = 0
    #: prompts given back while in progress and queued again (a window pool's chunks)
    preempted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    evicted_pages: int = 0
    host_hit_tokens: int = 0
    loaded_pages: int = 0
    offloaded_pages: int = 0
    host_evicted_pages: int = 0
    load_seconds: float = 0.0
    #: Disk tier (all 0 without one): tokens read back and served (``disk_hit_tokens``, part
    #: of ``host_hit_tokens``), pages read and written, and the time batches waited for reads
    disk_hit_tokens: int = 0
    disk_read_pages: int = 0
    disk_written_pages: int = 0
    read_seconds: float = 0.0
    queue_waits: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    #: time to first token of each admitted request, by its index in the trace
    request_ttfts: dict[int, float] = field(default_factory=dict)
    #: (simulated time, cumulative hit rate) after each batch
    hit_curve: list[tuple[float, float]] = field(default_factory=list)

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
    #: tokens cached at admission, and the queue wait recorded then
    cached: int = 0
    wait: float = 0.0


class _Server:
    """The simulated server's state; :func:`replay` drives it through time."""

    def __init__(self, requests: Sequence[TraceRequest], config: ReplayConfig, bar) -> None:
        self.requests, self.config, self.bar = requests, config, bar
        self.cache = make_cache(
            config.cache,
            config.num_pages,
            config.page_size,
            config.host_pages,
            config.disk_pages,
            config.window,
            config.window_pages,
            config.window_host_pages,
        )
        self.host = config.host_pages > 0
        self.disk = config.disk_pages > 0
        # A window pool caps how much of one prompt a step computes (SEMANTICS.md).
        self.chunk = self.cache.window_chunk or config.token_budget
        self.loads = 0  # loads drained since the last batch started: it waits for them
        self.reads = 0  # disk reads since the last batch started: it waits for them too
        self.fetched: dict[int, int] = {}  # trace index -> tokens read back from disk for it
        self.sched = radixkv.Scheduler(self.cache, config.policy, config.max_wait)
        self.res = ReplayResult(config)
        self.waiting: dict[int, int] = {}  # scheduler id -> trace index
        self.prefilling: list[_Prefill] = []  # admission order
        self.decoding: list[tuple[float, int, radixkv.Request]] = []  # heap by finish time
        self.now = 0.0  # the server's clock: it has run every batch that starts before it
        self.outstanding = 0  # prompt tokens queued here whose first token is not yet settled
        self.assigned = 0  # prompt tokens of every request queued here
        self.first_tokens: list[tuple[float, int]] = []  # heap: (first token time, prompt)
        #: (time, cumulative cached tokens, cumulative prompt tokens) after each batch
        self.counts: list[tuple[float, int, int]] = []

    def queue(self, idx: int) -> bool:
        """Queues request ``idx``; False (and dropped) when the pool could never hold it."""
        r = self.requests[idx]
        try:
            sid = self.sched.add(r.tokens, r.namespace, max_new_tokens=r.output_length)
        except ValueError:
            self.res.dropped += 1
            self.bar.update(1)
            return False
        self.waiting[sid] = idx
        if self.disk:
            self._prefetch(idx)
        self.outstanding += len(r.tokens)
        self.assigned += len(r.tokens)
        return True

    def _prefetch(self, idx: int) -> None:
        """Reads back from disk, into the host tier, the pages of request ``idx`` past what
        memory holds (every page taken as good: no bytes here)."""
        r = self.requests[idx]
        fetch = self.cache.disk_prefetch(r.tokens, r.namespace)
        if fetch is not None:
            self._drain()  # the spills that made room
            n = self.cache.disk_confirm(fetch[0], len(fetch[2]))
            self.reads += len(fetch[2])
            self.res.disk_read_pages += len(fetch[2])
            self.fetched[idx] = self.fetched.get(idx, 0) + n * self.config.page_size

    def _prefetch_head(self, budget: int) -> None:
        """Before an admission, as the engine does: the waiting requests at the head of the
        queue (arrival order, up to ``budget`` prompt tokens) read back again what of theirs
        went to disk while they waited."""
        for idx in list(self.waiting.values()):
            r = self.requests[idx]
            self._prefetch(idx)
            budget -= len(r.tokens)
            if budget <= 0:
                break

    def load(self, t: float) -> int:
        """Outstanding tokens at time ``t`` (at or after the start of the server's last batch):
        prompt tokens of the requests queued here whose first token has not come by ``t``."""
        return self.outstanding - sum(n for when, n in self.first_tokens if when <= t)

    def release_decodes(self, now: float) -> None:
        """Finishes the requests whose decoding has ended by ``now``; settles the first tokens
        that have come by then."""
        while self.decoding and self.decoding[0][0] <= now:
            self.cache.finish(heapq.heappop(self.decoding)[2])
        while self.first_tokens and self.first_tokens[0][0] <= now:
            self.outstanding -= heapq.heappop(self.first_tokens)[1]

    def advance(self, until: float) -> None:
        """Runs the server while its clock is before ``until``: finishes decodes, computes
        batches, idles to the next finish or to ``until``. A batch started before ``until``
        may end after it. ``until=math.inf`` runs until all work is done."""
        while self.now < until:
            self.release_decodes(self.now)
            done = self.run_batch(self.now)
            if done is not None:
                self.now = done
                continue
            finish = _next_finish(self.decoding)
            if finish is not None and finish < until:
                self.now = finish
            elif until < math.inf:
                self.now = until
            elif self.waiting or self.prefilling:  # each fits the pool alone: never happens
                raise RuntimeError(
                    f"replay stalled on an idle pool: {len(self.waiting)} requests waiting, "
                    f"{len(self.prefilling)} in progress"
                )
            else:
                return

    def run_batch(self, now: float) -> float | None:
        """Forms one batch at ``now`` and computes it; returns when it is done (None: nothing
        could be computed)."""
        work, blocked = self._grow(self.config.token_budget)
        while blocked and not work and len(self.prefilling) > 1:
            # Prompts admitted in part (a window pool caps each step's chunk) hold pages the
            # oldest needs to go on: the newest gives them back, as an engine preempts.
            self._preempt_newest()
            work, blocked = self._grow(self.config.token_budget)
        budget = self.config.token_budget - sum(n for _, n in work)
        room = self.config.max_running - len(self.decoding) - len(self.prefilling)
        if not blocked and budget > 0 and room > 0 and self.waiting:
            if self.disk:
                self._prefetch_head(budget)
                host_before = self.cache.stats.host_hit_tokens
            admitted = self.sched.schedule(budget, room)
            if self.host:
                self._drain()
            fetched = 0
            for sid, req in admitted:
                idx = self.waiting.pop(sid)
                fetched += min(self.fetched.pop(idx, 0), req.num_cached)
                job = self._admit(idx, req, now)
                work.append((job, job.num_tokens - job.num_computed))
            if self.disk:
                host_hits = self.cache.stats.host_hit_tokens - host_before
                self.res.disk_hit_tokens += min(fetched, host_hits)
        if not work:
            return None
        tokens = sum(n for _, n in work)
        done = now + tokens / self.config.prefill_tps
        if self.host:
            load = self.loads * self.config.page_load_seconds
            self.loads = 0
            self.res.load_seconds += load
            done += load
        if self.disk:
            read = self.reads * self.config.page_read_seconds
            self.reads = 0
            self.res.read_seconds += read
            done += read
        self.cache.commit_many([j.req for j, _ in work], [j.num_tokens for j, _ in work])
        self.res.computed_tokens += tokens
        for job, _ in work:
            job.num_computed = job.num_tokens
            if job.num_tokens == len(self.requests[job.idx].tokens):
                self._decode(job, done)
        self.res.hit_curve.append((done, self.res.hit_rate))
        self.counts.append((done, self.res.cached_tokens, self.res.prompt_tokens))
        return done

    def _grow(self, budget: int) -> tuple[list[tuple[_Prefill, int]], bool]:
        """Appends the next chunk of each prompt in progress, oldest first, in one call; stops
        at the first the pool cannot supply. Returns ``(job, tokens)`` pairs and whether one
        was refused."""
        plan = []
        for job in self.prefilling:
            if budget <= 0:
                break
            n = min(len(self.requests[job.idx].tokens) - job.num_tokens, budget, self.chunk)
            plan.append((job, n))
            budget -= n
        chunks = [self.requests[j.idx].tokens[j.num_tokens : j.num_tokens + n] for j, n in plan]
        grown = self.cache.extend_many([j.req for j, _ in plan], chunks) if plan else 0
        if self.host and plan:
            self._drain()
        for job, n in plan[:grown]:
            job.num_tokens += n
        return plan[:grown], grown < len(plan)

    def _admit(self, idx: int, req: radixkv.Request, now: float) -> _Prefill:
        wait = now - self.requests[idx].arrival
        job = _Prefill(idx, req, req.num_tokens, req.num_computed, req.num_computed, wait)
        res = self.res
        res.requests += 1
        res.prompt_tokens += len(self.requests[idx].tokens)
        res.cached_tokens += job.num_computed
        res.queue_waits.append(wait)
        self.prefilling.append(job)
        return job

    def _preempt_newest(self) -> None:
        """Aborts the newest prompt in progress and queues it again, its admission uncounted
        (it counts when it is admitted again)."""
        job = self.prefilling.pop()
        self.cache.abort(job.req)
        r, res = self.requests[job.idx], self.res
        res.requests -= 1
        res.prompt_tokens -= len(r.tokens)
        res.cached_tokens -= job.cached
        res.queue_waits.remove(job.wait)
        res.preempted += 1
        sid = self.sched.add(r.tokens, r.namespace, max_new_tokens=r.output_length)
        self.waiting[sid] = job.idx

    def _drain(self) -> None:
        """Empties the cache's copy log and counts its loads (the next batch waits for them)
        and offloads."""
        kinds = self.cache.drain_copies()[:, 0]
        loads = int(np.count_nonzero(kinds == radixkv.COPY_LOAD))
        offloads = int(np.count_nonzero(kinds == radixkv.COPY_OFFLOAD))
        wloads = int(np.count_nonzero(kinds == radixkv.COPY_WINDOW_LOAD))
        wcopies = wloads + int(np.count_nonzero(kinds == radixkv.COPY_WINDOW_OFFLOAD))
        # A window page holds the window layers' KV only: costed as a whole page (an upper
        # bound), since the replay knows no layer mix.
        self.loads += loads + wloads
        self.res.loaded_pages += loads
        self.res.offloaded_pages += offloads
        self.res.disk_written_pages += len(kinds) - loads - offloads - wcopies

    def finish(self) -> None:
        """After the last batch: the cache's own totals into the result; checks the cache."""
        stats = self.cache.stats
        self.res.evicted_pages = stats.evicted_pages
        if self.host:
            self._drain()
            self.res.host_hit_tokens = stats.host_hit_tokens
            self.res.host_evicted_pages = stats.host_evicted_pages
        self.cache.check()

    def _decode(self, job: _Prefill, now: float) -> None:
        """The prompt of ``job`` is computed: first token at ``now``, then decoding."""
        self.prefilling.remove(job)
        r = self.requests[job.idx]
        self.res.ttfts.append(now - r.arrival)
        self.res.request_ttfts[job.idx] = now - r.arrival
        heapq.heappush(self.first_tokens, (now, len(r.tokens)))
        if r.output_length:
            ids = job.idx * 8192 + np.arange(r.output_length)
            out = (OUTPUT_BASE + ids % OUTPUT_BASE).astype(np.uint32)
            try:
                self.cache.extend(job.req, out)
            except radixkv.OutOfPages:
                pass  # the pool is full of live requests: decode without a reservation
            if self.host:
                self._drain()  # offloads for the reservation
        end = now + r.output_length / self.config.decode_tps
        heapq.heappush(self.decoding, (end, job.idx, job.req))
        self.bar.update(1)


def replay(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    progress: bool = False,
    on_start: Callable[[radixkv.Cache, radixkv.Scheduler], None] | None = None,
) -> ReplayResult:
    """Simulates ``config`` over ``requests`` and returns the figures. ``on_start(cache,
    scheduler)`` is called once the simulated server's cache and scheduler exist (to watch
    them, e.g. serve their metrics)."""
    server = _Server(requests, config, _progress(len(requests), progress, config.policy, config))
    if on_start is not None:
        on_start(server.cache, server.sched)
    _drive(requests, [server], lambda idx, t: 0)
    server.bar.close()
    return server.res


def _drive(
    requests: Sequence[TraceRequest],
    servers: list[_Server],
    route: Callable[[int, float], int],
) -> None:
    """Runs ``servers`` side by side over ``requests``: each request, in arrival order, goes to
    ``servers[route(index, arrival)]`` once every server has run up to its arrival; then all run
    until done. Fills in each server's evictions and checks its cache."""
    for idx in sorted(range(len(requests)), key=lambda i: requests[i].arrival):
        t = requests[idx].arrival
        for server in servers:
            server.advance(t)
        servers[route(idx, t)].queue(idx)
    for server in servers:
        server.advance(math.inf)
        server.finish()


@dataclass
class RoutedResult(_HitRates):
    """What one replay over replicas measured: one :class:`ReplayResult` per replica, and where
    each request went.

    ``assignment[i]``: the replica request ``i`` (trace order) was routed to; ``assigned_tokens``:
    per replica, prompt tokens of the requests it queued (dropped ones excluded)."""

    router: str
    balance_threshold: float
    replicas: list[ReplayResult]
    assignment: list[int]
    assigned_tokens: list[int]
    #: (simulated time, cumulative hit rate of all replicas) after each batch of any replica
    hit_curve: list[tuple[float, float]] = field(default_factory=list)

    @property
    def config(self) -> ReplayConfig:
        """The configuration every replica ran with."""
        return self.replicas[0].config

    def _sum(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.replicas)

    @property
    def requests(self) -> int:
        """Requests admitted, all replicas together."""
        return self._sum("requests")

    @property
    def dropped(self) -> int:
        """Requests no replica's pool could ever hold."""
        return self._sum("dropped")

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the admitted requests."""
        return self._sum("prompt_tokens")

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found cached at admission."""
        return self._sum("cached_tokens")

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens computed."""
        return self._sum("computed_tokens")

    @property
    def evicted_pages(self) -> int:
        """Pages evicted, all replicas together."""
        return self._sum("evicted_pages")

    @property
    def host_hit_tokens(self) -> int:
        """Cached tokens that were on a host tier, all replicas together."""
        return self._sum("host_hit_tokens")

    @property
    def disk_hit_tokens(self) -> int:
        """Cached tokens read back from a disk tier, all replicas together."""
        return self._sum("disk_hit_tokens")

    @property
    def loaded_pages(self) -> int:
        """Pages loaded from a host tier, all replicas together."""
        return self._sum("loaded_pages")

    @property
    def offloaded_pages(self) -> int:
        """Pages offloaded to a host tier, all replicas together."""
        return self._sum("offloaded_pages")

    @property
    def host_evicted_pages(self) -> int:
        """Pages dropped from a host tier, all replicas together."""
        return self._sum("host_evicted_pages")

    @property
    def load_seconds(self) -> float:
        """Simulated time batches waited for loads, all replicas together."""
        return sum(r.load_seconds for r in self.replicas)

    @property
    def load_spread(self) -> float:
        """Most over fewest assigned tokens of a replica (1.0: even; inf: one got nothing)."""
        lo, hi = min(self.assigned_tokens), max(self.assigned_tokens)
        if lo == 0:
            return math.inf if hi else 1.0
        return hi / lo

    def percentile(self, which: str, q: float) -> float:
        """A percentile (0-100) of ``queue_waits`` or ``ttfts`` over all replicas' requests."""
        xs = [x for r in self.replicas for x in getattr(r, which)]
        return float(np.percentile(xs, q)) if xs else 0.0


def replay_replicas(
    requests: Sequence[TraceRequest],
    config: ReplayConfig,
    replicas: int,
    router: str = "prefix",
    balance_threshold: float = DEFAULT_BALANCE_THRESHOLD,
    progress: bool = False,
    on_start: Callable[[radixkv.Cache, radixkv.Scheduler], None] | None = None,
) -> RoutedResult:
    """Simulates ``replicas`` servers, each configured by ``config`` (its own cache of
    ``config.num_pages`` pages), behind ``router`` (one of :data:`ROUTERS`; see the module
    docstring) over ``requests``, and returns the figures.

    ``balance_threshold`` (tokens, ``>= 0``, may be ``math.inf``: never rebalance): how many
    outstanding tokens more than the least-loaded replica the ``prefix`` router tolerates on the
    replica with the longest cached prefix. Raises ValueError for a bad ``replicas``, ``router``
    or ``balance_threshold``. ``on_start(cache, scheduler)`` is called once with the first
    replica's (to watch it, e.g. serve its metrics)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    if not balance_threshold >= 0:  # also refuses NaN
        raise ValueError(f"balance_threshold must be >= 0, got {balance_threshold!r}")
    bar = _progress(len(requests), progress, router, config)
    servers = [_Server(requests, config, bar) for _ in range(replicas)]
    if on_start is not None:
        on_start(servers[0].cache, servers[0].sched)
    assignment = [-1] * len(requests)
    turn = 0

    def route(idx: int, t: float) -> int:
        nonlocal turn
        if router == "round-robin":
            pick, turn = turn % replicas, turn + 1
        else:
            loads = [s.load(t) for s in servers]
            least = min(range(replicas), key=lambda i: (loads[i], i))
            pick = least
            if router == "prefix":
                r = requests[idx]
                match = [s.cache.match_prefix(r.tokens, r.namespace) for s in servers]
                best = min(range(replicas), key=lambda i: (-match[i], loads[i], i))
                if loads[best] - loads[least] <= balance_threshold:
                    pick = best
        assignment[idx] = pick
        return pick

    _drive(requests, servers, route)
    bar.close()
    return RoutedResult(
        router,
        float(balance_threshold),
        [s.res for s in servers],
        assignment,
        [s.assigned for s in servers],
        _merged_curve([s.counts for s in servers]),
    )


def _merged_curve(counts: list[list[tuple[float, int, int]]]) -> list[tuple[float, float]]:
    """The cumulative hit rate of all servers together after each batch of any of them, from
    each server's (time, cached, prompt) counts."""
    events = sorted((t, i, c, p) for i, cs in enumerate(counts) for t, c, p in cs)
    cached, prompt = [0] * len(counts), [0] * len(counts)
    curve = []
    for t, i, c, p in events:
        cached[i], prompt[i] = c, p
        total = sum(prompt)
        curve.append((t, sum(cached) / total if total else 0.0))
    return curve


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _next_finish(decoding: list[tuple[float, int, radixkv.Request]]) -> float | None:
    return decoding[0][0] if decoding else None


def _progress(total: int, enabled: bool, label: str, config: ReplayConfig):
    if enabled:
        return progress_bar(total=total, desc=f"{config.cache}/{label}", unit="req", leave=False)
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
