"""Prometheus metrics of a cache, its scheduler and an engine (extra ``radixkv[metrics]``).

:class:`CacheCollector` is a prometheus_client collector: register it in any
``CollectorRegistry`` and it reads snapshots when scraped (``cache.stats``, the scheduler's queue
and wait histogram, the engine's finished requests), so it costs nothing between scrapes.

- ``radixkv_prefix_cache_queries_total`` and ``radixkv_prefix_cache_hits_total`` count tokens,
  as vLLM's ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` do: the prompt tokens of
  every admission (``admit`` and ``fork``; a preempted request admitted again counts again) and,
  of those, the tokens served from the cache; so ``rate(hits) / rate(queries)`` ported from a
  vLLM dashboard is the token hit rate. ``radixkv_prefix_cache_query_tokens_total`` and
  ``radixkv_prefix_cache_hit_tokens_total`` are the same two counters under their first names;
  ``radixkv_prefix_cache_requests_total`` counts admissions (requests, not tokens).
- ``radixkv_kv_pages{state="free"|"evictable"|"used"}``, ``radixkv_kv_page_size_tokens``,
  ``radixkv_evicted_pages_total``, and ``radixkv_kv_cache_usage_perc``: the fraction (0 to 1) of
  the pool's pages pinned by live requests, as vLLM's ``vllm:kv_cache_usage_perc`` (cached pages
  no request uses count as free there too).
- Retention (``finish(..., retain=...)``): ``radixkv_retentions`` (live),
  ``radixkv_retained_evicted_pages_total`` (device pages evicted while retained) and
  ``radixkv_retentions_expired_total``.
- With a host tier (``host_pages > 0``; a cache without one exports none of these):
  ``radixkv_prefix_cache_host_hit_tokens_total`` (of the hit tokens, those loaded back from the
  host), ``radixkv_kv_host_pages{state="free"|"cached"}`` (host pages holding nothing / holding
  KV), ``radixkv_kv_offloaded_pages_total`` (device pages whose KV went to the host instead of
  being dropped), ``radixkv_kv_loaded_pages_total`` (host pages loaded back to the device) and
  ``radixkv_kv_host_evicted_pages_total`` (pages dropped from the host tier).
- With a disk tier (``disk_pages > 0``): ``radixkv_kv_disk_pages{state="free"|"cached"}``,
  ``radixkv_kv_disk_written_pages_total``, ``radixkv_kv_disk_fetched_pages_total`` (read back
  for a prompt), ``radixkv_kv_disk_evicted_pages_total`` and ``radixkv_kv_disk_bad_pages_total``
  (read back torn or corrupted, recomputed).
- With an engine whose ``KVCache`` has a shared tier (``shared_store=``):
  ``radixkv_kv_shared_hit_pages_total`` (pages fetched from the shared store and entered for a
  prompt), ``radixkv_kv_shared_put_pages_total`` (pages sent to it),
  ``radixkv_kv_shared_dropped_pages_total`` (not sent: queue full, store failing),
  ``radixkv_kv_shared_bad_pages_total`` (failed their header, checksum or MAC: recomputed,
  never served), ``radixkv_kv_shared_errors_total`` (failed store calls) and
  ``radixkv_kv_shared_breaker_open`` (1 while the breaker skips the store, else 0). The
  store's address and credentials are never exported.
- With a window group (``window_pages > 0``): ``radixkv_kv_window_pages{state="free"|
  "evictable"|"used"}``, ``radixkv_prefix_cache_window_cut_hits_total`` and
  ``radixkv_prefix_cache_window_cut_tokens_total`` (hits the window cut short, and the tokens
  recomputed for it: what a window costs in reuse), ``radixkv_kv_window_evicted_pages_total``;
  with its host tier also ``radixkv_kv_window_host_used_pages``,
  ``radixkv_kv_window_offloaded_pages_total`` and ``radixkv_kv_window_loaded_pages_total``.
- With state slots (``state_slots > 0``, a hybrid model's recurrent-state snapshots):
  ``radixkv_state_slots{state="free"|"pinned"|"held"}`` (holding nothing / pinned by a request
  restoring from it / holding a snapshot or one pending),
  ``radixkv_prefix_cache_state_hit_tokens_total`` (hit tokens, each hit ending at a snapshot),
  ``radixkv_taken_states_total`` (snapshots taken) and ``radixkv_evicted_states_total``
  (snapshots evicted: for room, or with a page they needed); with an engine over them also
  ``radixkv_restored_states_total`` (snapshots restored into a request's state at admission).
- With a scheduler: ``radixkv_scheduler_waiting`` (requests waiting) and the histogram
  ``radixkv_scheduler_wait_calls`` (schedule calls each admitted request waited through).
- With an engine: ``radixkv_engine_requests_total`` (finished requests), the histograms
  ``radixkv_engine_time_to_first_token_seconds`` and ``radixkv_engine_request_prompt_tokens``,
  and ``radixkv_engine_{prompt,cached,computed}_tokens_total`` (prompt tokens, those found
  cached at admission, tokens computed until the first token); and under vLLM's names:
  ``radixkv_num_requests_running`` and ``radixkv_num_requests_waiting`` (requests being
  computed, and queued: new, preempted, or branches whose context is not computed yet),
  ``radixkv_num_preemptions_total``, ``radixkv_generation_tokens_total`` (tokens sampled so far,
  unfinished requests' included), and the histograms of finished requests
  ``radixkv_e2e_request_latency_seconds`` (submission to the end) and
  ``radixkv_request_time_per_output_token_seconds`` (time from the first token to the last over
  the tokens after the first; requests of two tokens or more),
  ``radixkv_inter_token_latency_seconds`` (each gap between two tokens of a finished request)
  and ``radixkv_request_queue_time_seconds`` (submission to first admission). The README maps
  every vLLM metric to its radixkv name. vLLM's ``model_name`` label is a constant label
  (``labels={"model_name": ...}``; ``radixkv serve`` sets it to its served model name).

The hit rate over a window is ``rate(hit_tokens) / rate(query_tokens)``, the host tier's share
of it ``rate(host_hit_tokens) / rate(query_tokens)``; ``docs/grafana`` has a dashboard and alert
rules built on these names. The host families follow the pattern of vLLM's CPU offloading
metrics (``vllm:simple_kv_offload_load_blocks_total``, ``vllm:simple_kv_offload_used_blocks``):
counters of pages moved per direction beside a gauge of the host pool.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.registry import Collector
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "radixkv.metrics needs prometheus_client: pip install 'radixkv[metrics]' "
        "(or pip install prometheus_client)"
    ) from e

__all__ = ["TTFT_BUCKETS", "CacheCollector", "serve"]

#: Histogram bounds of time to first token, seconds.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Histogram bounds of prompt tokens per request.
PROMPT_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144)
#: Histogram bounds of end-to-end request latency, seconds.
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: Histogram bounds of time per output token, seconds (and of inter-token latency).
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Histogram bounds of queue time, seconds.
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
#: ``Sequence.status`` values (``radixkv.engine.sequence.Status``, compared by value so that this
#: module imports nothing of the torch layer).
_RUNNING_VALUE, _WAITING_VALUE = "running", "waiting"
_RESERVED = {"state", "le", "quantile"}


class _Histogram:
    """Cumulative bucket counts and a sum, fed one value at a time."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, x: float) -> None:
        i = 0
        while i < len(self.bounds) and x > self.bounds[i]:
            i += 1
        self.counts[i] += 1
        self.sum += x

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        acc = 0
        for b, c in zip([*self.bounds, float("inf")], self.counts):
            acc += c
            out.append((_le(b), acc))
        return out


def _le(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


class CacheCollector(Collector):
    """Prometheus metrics of ``cache`` (a ``RadixCache`` or ``BlockCache``), and optionally of a
    ``radixkv.Scheduler`` and a ``radixkv.Engine`` (whose own scheduler is used when
    ``scheduler`` is not given). ``labels``: constant labels put on every sample (e.g.
    ``{"worker": "0"}``).

    Register it with ``registry.register(CacheCollector(cache))``; everything is read when
    scraped. Safe to scrape from another thread while the cache and engine run. The host tier's
    families are exported when the cache has one (``host_tier``, fixed by ``cache.host_pages``).

    The engine families count each request once, when it is seen finished: every request
    submitted after the collector was made, and every one the engine still holds
    (``engine.sequences``) when it was made, finished or not, so a collector attached late
    (after the engine released requests, or after it ran some without releasing them) counts
    those still held and everything after. Requests released before it was made are gone and
    never counted; the engine's ``release_hooks`` let it count the others before their release.
    """

    def __init__(
        self,
        cache: Any,
        *,
        scheduler: Any = None,
        engine: Any = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        if not hasattr(cache, "stats") or not hasattr(cache, "admit"):
            raise TypeError(
                f"cache must be a radixkv RadixCache or BlockCache, got {type(cache).__name__}"
            )
        if scheduler is not None and not hasattr(scheduler, "wait_histogram"):
            raise TypeError(
                f"scheduler must be a radixkv.Scheduler, got {type(scheduler).__name__}"
            )
        if engine is not None and not hasattr(engine, "sequences"):
            raise TypeError(f"engine must be a radixkv.Engine, got {type(engine).__name__}")
        labels = dict(labels or {})
        for k, v in labels.items():
            if not isinstance(k, str) or not _LABEL.match(k) or k in _RESERVED:
                raise ValueError(
                    f"labels: {k!r} is not a usable label name (letters, digits and '_', not "
                    f"starting with a digit; not one of {sorted(_RESERVED)})"
                )
            if not isinstance(v, str):
                raise TypeError(f"labels: the value of {k!r} must be a str, got {v!r}")
        if scheduler is None and engine is not None:
            scheduler = engine.batcher.scheduler
        self.cache, self.scheduler, self.engine = cache, scheduler, engine
        # Fixed when the cache is built, so describe() knows the families without a snapshot.
        self.host_tier = int(getattr(cache, "host_pages", 0) or 0) > 0
        self.disk_tier = int(getattr(cache, "disk_pages", 0) or 0) > 0
        self.window_group = int(getattr(cache, "window_pages", 0) or 0) > 0
        self.window_host = int(getattr(cache, "window_host_pages", 0) or 0) > 0
        self.state_slots = int(getattr(cache.stats, "state_slots", 0) or 0) > 0
        self._names = list(labels)
        self._values = [labels[k] for k in self._names]
        # Engine requests are folded into these as they finish. Ids grow as requests are
        # submitted, but released ones leave gaps anywhere below the newest: _next_id is one
        # past the newest id seen, _pending the ids seen and not yet counted.
        self._lock = threading.Lock()
        self._next_id = 0
        self._pending: set[int] = set()
        if engine is not None and hasattr(engine, "release_hooks"):
            engine.release_hooks.append(self._fold_released)
        self._ttft = _Histogram(TTFT_BUCKETS)
        self._prompt_hist = _Histogram(PROMPT_BUCKETS)
        self._e2e = _Histogram(E2E_BUCKETS)
        self._tpot = _Histogram(TPOT_BUCKETS)
        self._itl = _Histogram(TPOT_BUCKETS)
        self._queue = _Histogram(QUEUE_BUCKETS)
        self._requests = self._prompt = self._cached = self._computed = 0
        #: Output tokens of the requests folded into the totals (finished ones).
        self._generated = 0

    # ---- prometheus_client ----------------------------------------------------------------

    def describe(self) -> Iterator[Any]:
        """The metric families (names only), without reading the cache."""
        return iter(self._families(None))

    def collect(self) -> Iterator[Any]:
        """One snapshot of every metric."""
        return iter(self._families(self.cache.stats))

    # ---- building the families --------------------------------------------------------------

    def _counter(self, name: str, doc: str, value: float | None) -> CounterMetricFamily:
        m = CounterMetricFamily(name, doc, labels=self._names)
        if value is not None:
            m.add_metric(self._values, value)
        return m

    def _gauge(self, name: str, doc: str, value: float | None) -> GaugeMetricFamily:
        m = GaugeMetricFamily(name, doc, labels=self._names)
        if value is not None:
            m.add_metric(self._values, value)
        return m

    def _families(self, s: Any) -> list[Any]:
        live = s is not None
        out: list[Any] = [
            self._counter(
                "radixkv_prefix_cache_queries",
                "Prefix cache queries in tokens: prompt tokens of the admissions, as vLLM's.",
                s.query_tokens if live else None,
            ),
            self._counter(
                "radixkv_prefix_cache_hits",
                "Prefix cache hits in tokens: prompt tokens served from the cache, as vLLM's.",
                s.hit_tokens if live else None,
            ),
            self._counter(
                "radixkv_prefix_cache_requests",
                "Admissions into the prefix cache (admit and fork), in requests.",
                s.queries if live else None,
            ),
            self._counter(
                "radixkv_prefix_cache_query_tokens",
                "Prompt tokens of the admissions.",
                s.query_tokens if live else None,
            ),
            self._counter(
                "radixkv_prefix_cache_hit_tokens",
                "Prompt tokens served from the cache at admission.",
                s.hit_tokens if live else None,
            ),
            self._counter(
                "radixkv_evicted_pages",
                "Pages evicted (by allocation, evict and reset).",
                s.evicted_pages if live else None,
            ),
            self._gauge(
                "radixkv_retentions",
                "Retentions live (finish with retain=, not yet expired or released).",
                s.retentions if live else None,
            ),
            self._counter(
                "radixkv_retained_evicted_pages",
                "Device pages evicted while retained (nothing else was left to evict).",
                s.forced_evictions if live else None,
            ),
            self._counter(
                "radixkv_retentions_expired",
                "Retentions whose time ran out on the cache's clock.",
                s.expired_retentions if live else None,
            ),
            self._gauge(
                "radixkv_kv_page_size_tokens", "Tokens per KV page.", s.page_size if live else None
            ),
            self._gauge(
                "radixkv_kv_cache_usage_perc",
                "Fraction of KV pages pinned by live requests (0 to 1), as vLLM's.",
                s.used_pages / s.num_pages if live else None,
            ),
        ]
        pages = GaugeMetricFamily(
            "radixkv_kv_pages",
            "KV pages by state: free (hold nothing), evictable (cached, unpinned), used (pinned).",
            labels=[*self._names, "state"],
        )
        if live:
            for state, n in (
                ("free", s.free_pages),
                ("evictable", s.evictable_pages),
                ("used", s.used_pages),
            ):
                pages.add_metric([*self._values, state], n)
        out.append(pages)
        if self.host_tier:
            out.extend(self._host_families(s))
        if self.disk_tier:
            out.extend(self._disk_families(s))
        if self.window_group:
            out.extend(self._window_families(s))
        if self.state_slots:
            out.extend(self._state_families(s))
        if self.scheduler is not None:
            out.append(
                self._gauge(
                    "radixkv_scheduler_waiting",
                    "Requests waiting in the scheduler.",
                    len(self.scheduler) if live else None,
                )
            )
            h = HistogramMetricFamily(
                "radixkv_scheduler_wait_calls",
                "How many schedule calls admitted requests waited through.",
                labels=self._names,
            )
            if live:
                pairs, total = self.scheduler.wait_histogram
                acc, buckets = 0, []
                for bound, count in pairs:
                    acc += count
                    buckets.append((_le(bound), acc))
                h.add_metric(self._values, buckets, total)
            out.append(h)
        if self.engine is not None:
            out.extend(self._engine_families(live))
        shared = getattr(getattr(self.engine, "kv", None), "shared", None)
        if shared is not None:
            out.extend(self._shared_families(shared.stats() if live else None))
        return out

    def _shared_families(self, s: dict[str, Any] | None) -> list[Any]:
        """The shared tier's families (``s``: its stats, or None for names only)."""
        live = s is not None
        return [
            self._counter(
                "radixkv_kv_shared_hit_pages",
                "Pages fetched from the shared store and entered for a prompt.",
                s["hit_pages"] if s is not None else None,
            ),
            self._counter(
                "radixkv_kv_shared_put_pages",
                "Pages sent to the shared store (those it held already are not).",
                s["put_pages"] if s is not None else None,
            ),
            self._counter(
                "radixkv_kv_shared_dropped_pages",
                "Pages not sent to the shared store (queue full, store failing).",
                s["dropped_pages"] if s is not None else None,
            ),
            self._counter(
                "radixkv_kv_shared_bad_pages",
                "Shared pages that failed their header, checksum or MAC (never served).",
                s["bad_pages"] if s is not None else None,
            ),
            self._counter(
                "radixkv_kv_shared_errors",
                "Calls to the shared store that failed.",
                s["errors"] if s is not None else None,
            ),
            self._gauge(
                "radixkv_kv_shared_breaker_open",
                "1 while the shared store's circuit breaker skips it (open or probing), else 0.",
                (1 if s["breaker"] != "closed" else 0) if live and s is not None else None,
            ),
        ]

    def _host_families(self, s: Any) -> list[Any]:
        """The host tier's families (``s``: a stats snapshot, or None for names only)."""
        live = s is not None
        pages = GaugeMetricFamily(
            "radixkv_kv_host_pages",
            "Host tier pages by state: free (hold nothing), cached (hold KV offloaded from the "
            "device).",
            labels=[*self._names, "state"],
        )
        if live:
            pages.add_metric([*self._values, "free"], s.host_free_pages)
            pages.add_metric([*self._values, "cached"], s.host_pages - s.host_free_pages)
        return [
            self._counter(
                "radixkv_prefix_cache_host_hit_tokens",
                "Prompt tokens served from the host tier at admission (also in hit_tokens).",
                s.host_hit_tokens if live else None,
            ),
            pages,
            self._counter(
                "radixkv_kv_offloaded_pages",
                "Device pages whose KV went to the host tier instead of being dropped.",
                s.offloaded_pages if live else None,
            ),
            self._counter(
                "radixkv_kv_loaded_pages",
                "Host tier pages loaded back to the device for an admission.",
                s.loaded_pages if live else None,
            ),
            self._counter(
                "radixkv_kv_host_evicted_pages",
                "Pages dropped from the host tier (to make room, and by reset).",
                s.host_evicted_pages if live else None,
            ),
        ]

    def _window_families(self, s: Any) -> list[Any]:
        """The window group's families (``s``: a stats snapshot, or None for names only)."""
        live = s is not None
        pages = GaugeMetricFamily(
            "radixkv_kv_window_pages",
            "Window pool pages by state: free (hold nothing), evictable (cached, no live "
            "request reads them), used (held by live requests).",
            labels=[*self._names, "state"],
        )
        if live:
            used = s.window_pages - s.window_free_pages - s.window_evictable_pages
            for state, n in (
                ("free", s.window_free_pages),
                ("evictable", s.window_evictable_pages),
                ("used", used),
            ):
                pages.add_metric([*self._values, state], n)
        out = [
            pages,
            self._counter(
                "radixkv_prefix_cache_window_cut_hits",
                "Admissions whose hit the window group cut short (full pages went further, but "
                "their last window's window pages were gone).",
                s.window_cut_hits if live else None,
            ),
            self._counter(
                "radixkv_prefix_cache_window_cut_tokens",
                "Tokens those admissions recomputed because of the cut.",
                s.window_cut_tokens if live else None,
            ),
            self._counter(
                "radixkv_kv_window_evicted_pages",
                "Cached window pages dropped from the window group (to make room, and by reset).",
                s.window_evicted_pages if live else None,
            ),
        ]
        if self.window_host:
            out += [
                self._gauge(
                    "radixkv_kv_window_host_used_pages",
                    "Window host tier pages holding a window page's KV.",
                    s.window_host_used_pages if live else None,
                ),
                self._counter(
                    "radixkv_kv_window_offloaded_pages",
                    "Window pages whose KV went to the window host tier instead of being dropped.",
                    s.window_offloaded_pages if live else None,
                ),
                self._counter(
                    "radixkv_kv_window_loaded_pages",
                    "Window host tier pages loaded back into the window pool for a hit.",
                    s.window_loaded_pages if live else None,
                ),
            ]
        return out

    def _state_families(self, s: Any) -> list[Any]:
        """The state slots' families (``s``: a stats snapshot, or None for names only)."""
        live = s is not None
        slots = GaugeMetricFamily(
            "radixkv_state_slots",
            "Recurrent-state slots by state: free (hold nothing), pinned (a request restores from "
            "it), held (a snapshot, or one pending until its request publishes its pages).",
            labels=[*self._names, "state"],
        )
        if live:
            held = s.state_slots - s.state_free_slots - s.state_pinned_slots
            for state, n in (
                ("free", s.state_free_slots),
                ("pinned", s.state_pinned_slots),
                ("held", held),
            ):
                slots.add_metric([*self._values, state], n)
        return [
            slots,
            self._counter(
                "radixkv_prefix_cache_state_hit_tokens",
                "Prompt tokens served from the cache at admission with their recurrent state "
                "restored from a snapshot.",
                s.state_hit_tokens if live else None,
            ),
            self._counter(
                "radixkv_taken_states",
                "Recurrent-state snapshots taken (slots handed out by take_state).",
                s.taken_states if live else None,
            ),
            self._counter(
                "radixkv_evicted_states",
                "Recurrent-state snapshots evicted (for room, or with a page they needed).",
                s.evicted_states if live else None,
            ),
        ]

    def _disk_families(self, s: Any) -> list[Any]:
        """The disk tier's families (``s``: a stats snapshot, or None for names only)."""
        live = s is not None
        pages = GaugeMetricFamily(
            "radixkv_kv_disk_pages",
            "Disk tier pages by state: free (hold nothing), cached (hold a page's KV).",
            labels=[*self._names, "state"],
        )
        if live:
            pages.add_metric([*self._values, "free"], s.disk_free_pages)
            pages.add_metric([*self._values, "cached"], s.disk_pages - s.disk_free_pages)
        return [
            pages,
            self._counter(
                "radixkv_kv_disk_written_pages",
                "Pages written to the disk tier (dropped by the host tier, or saved).",
                s.disk_written_pages if live else None,
            ),
            self._counter(
                "radixkv_kv_disk_fetched_pages",
                "Disk tier pages read back into the host tier for a prompt.",
                s.disk_fetched_pages if live else None,
            ),
            self._counter(
                "radixkv_kv_disk_evicted_pages",
                "Pages dropped from the disk tier (to make room, and by reset).",
                s.disk_evicted_pages if live else None,
            ),
            self._counter(
                "radixkv_kv_disk_bad_pages",
                "Disk tier pages that read back torn or corrupted (dropped, never served).",
                s.disk_bad_pages if live else None,
            ),
        ]

    def _fold_engine(self) -> None:
        """Folds the engine's requests that finished since the last scrape into the totals."""
        seqs = self.engine.sequences
        # A snapshot of the ids (one C call, so the engine thread cannot resize the dict under
        # it); any id past the newest seen is new, whatever was released below it.
        ids = list(seqs)
        for i in ids:
            if i >= self._next_id:
                self._pending.add(i)
        if ids:
            self._next_id = max(self._next_id, max(ids) + 1)
        for i in sorted(self._pending):
            seq = seqs.get(i)
            if seq is None:  # released without the hook (or dropped unqueued): never coming back
                self._pending.discard(i)
                continue
            if not seq.done:
                continue
            self._pending.discard(i)
            r = seq.result()
            if r.finish_reason == "context":  # a branch context, not a request of its own
                continue
            self._requests += 1
            self._prompt += r.prompt_tokens
            self._cached += r.cached_tokens
            self._computed += r.computed_tokens
            self._generated += len(r.output)
            self._prompt_hist.observe(r.prompt_tokens)
            self._e2e.observe(r.latency_s)
            if r.queue_s is not None:
                self._queue.observe(r.queue_s)
            for gap in seq.token_gaps:
                self._itl.observe(gap)
            if r.ttft_s is not None:
                self._ttft.observe(r.ttft_s)
                if len(r.output) > 1:
                    self._tpot.observe((r.latency_s - r.ttft_s) / (len(r.output) - 1))

    def _fold_released(self, seqs: list[Any]) -> None:
        """Counts requests the engine is about to release (``Engine.release_hooks``)."""
        with self._lock:
            self._fold_engine()

    def _live_requests(self) -> tuple[int, int, int]:
        """(running, waiting, tokens sampled by requests not yet folded) of the engine now.
        Branch contexts are the engine's own requests, not the user's: left out."""
        running = waiting = sampled = 0
        for seq in list(self.engine.sequences.values()):  # one C call: a snapshot
            if seq.done or seq.children:
                continue
            sampled += len(seq.output)
            status = seq.status.value
            if status == _RUNNING_VALUE:
                running += 1
            elif status == _WAITING_VALUE:
                waiting += 1
        return running, waiting, sampled

    def _engine_families(self, live: bool) -> list[Any]:
        running = waiting = sampled = 0
        if live:
            with self._lock:
                self._fold_engine()
                running, waiting, sampled = self._live_requests()
        names = (
            (
                "radixkv_engine_time_to_first_token_seconds",
                self._ttft,
                "Time from submission to the first sampled token.",
            ),
            (
                "radixkv_engine_request_prompt_tokens",
                self._prompt_hist,
                "Prompt tokens per finished request.",
            ),
            (
                "radixkv_e2e_request_latency_seconds",
                self._e2e,
                "Time from submission to the end of each finished request, as vLLM's.",
            ),
            (
                "radixkv_request_time_per_output_token_seconds",
                self._tpot,
                "Per finished request "
                "of two tokens or more: time from its first token to its last over the tokens "
                "after the first, as vLLM's.",
            ),
            (
                "radixkv_inter_token_latency_seconds",
                self._itl,
                "Time between each sampled token and the one before, per token of finished "
                "requests, as vLLM's.",
            ),
            (
                "radixkv_request_queue_time_seconds",
                self._queue,
                "Time from submission to first admission of each finished request, as vLLM's.",
            ),
        )
        histograms = []
        for name, hist, doc in names:
            h = HistogramMetricFamily(name, doc, labels=self._names)
            if live:
                h.add_metric(self._values, hist.buckets(), hist.sum)
            histograms.append(h)
        preemptions = self.engine.batcher.preemptions if live else None
        return [
            self._counter(
                "radixkv_engine_requests",
                "Requests the engine finished.",
                self._requests if live else None,
            ),
            self._counter(
                "radixkv_engine_prompt_tokens",
                "Prompt tokens of finished requests.",
                self._prompt if live else None,
            ),
            self._counter(
                "radixkv_engine_cached_tokens",
                "Prompt tokens of finished requests found cached at their first admission.",
                self._cached if live else None,
            ),
            self._counter(
                "radixkv_engine_computed_tokens",
                "Tokens computed until each finished request's first token (prefill work).",
                self._computed if live else None,
            ),
            self._gauge(
                "radixkv_num_requests_running",
                "Requests being computed (prefilling or decoding), as vLLM's.",
                running if live else None,
            ),
            self._gauge(
                "radixkv_num_requests_waiting",
                "Requests queued for admission (new, preempted, or branches whose context is "
                "not computed yet), as vLLM's.",
                waiting if live else None,
            ),
            self._counter(
                "radixkv_num_preemptions",
                "Requests preempted (their pages taken back, queued again), as vLLM's.",
                preemptions,
            ),
            self._counter(
                "radixkv_generation_tokens",
                "Tokens sampled, unfinished requests' included, as vLLM's.",
                self._generated + sampled if live else None,
            ),
            *histograms,
            *self._spec_families(live),
            *self._engine_state_families(live),
        ]

    def _engine_state_families(self, live: bool) -> list[Any]:
        """A hybrid model's snapshots as the engine used them (an engine with ``states``
        only; the cache's own state families say what it holds, took and evicted)."""
        if getattr(self.engine, "states", None) is None:
            return []
        st = self.engine.stats if live else None
        return [
            self._counter(
                "radixkv_restored_states",
                "Recurrent-state snapshots restored into a request's state at admission (each "
                "a hit ending at a snapshot).",
                None if st is None else st.state_restored,
            ),
        ]

    def _spec_families(self, live: bool) -> list[Any]:
        """Speculative decoding's counters, as vLLM's ``vllm:spec_decode_*`` (an engine made
        with ``speculative=`` only)."""
        if getattr(self.engine, "speculative", None) is None:
            return []
        st = self.engine.stats if live else None
        per_pos = CounterMetricFamily(
            "radixkv_spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by their position in the draft, as vLLM's.",
            labels=[*self._names, "position"],
        )
        if st is not None:
            for j, n in enumerate(list(st.spec_accepted_per_pos)):
                per_pos.add_metric([*self._values, str(j)], n)
        return [
            self._counter(
                "radixkv_spec_decode_num_drafts",
                "Drafts verified (one per request and step that carried one), as vLLM's.",
                None if st is None else st.spec_drafts,
            ),
            self._counter(
                "radixkv_spec_decode_num_draft_tokens",
                "Draft tokens verified, as vLLM's.",
                None if st is None else st.spec_draft_tokens,
            ),
            self._counter(
                "radixkv_spec_decode_num_accepted_tokens",
                "Draft tokens accepted, as vLLM's.",
                None if st is None else st.spec_accepted_tokens,
            ),
            per_pos,
        ]


def serve(collector: Collector | None, port: int, addr: str = "127.0.0.1") -> Any:
    """Serves ``collector`` on ``http://addr:port/metrics`` from a daemon thread, in a registry of
    its own; returns the HTTP server: ``.shutdown()`` stops it, ``.server_port`` is the port
    (useful with ``port=0``), ``.registry`` the registry (collectors can be swapped in it)."""
    from prometheus_client import CollectorRegistry, start_http_server

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"port must be an int in [0, 65536), got {port!r}")
    registry = CollectorRegistry()
    if collector is not None:
        registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    server.registry = registry  # type: ignore[attr-defined]
    return server
