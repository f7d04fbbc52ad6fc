"""radixkv Engines as Ray Serve replicas behind a prefix-aware request router.

Each replica of the ``EngineReplica`` deployment owns one :class:`radixkv.Engine` (a tiny random
:class:`radixkv.models.CausalLM` on CPU, the same seed on every replica, so every replica gives
the same greedy output for a prompt). Which replica serves a request is decided by a custom
Ray Serve request router (``ray.serve.request_router.RequestRouter``, set per deployment with
``RequestRouterConfig(request_router_class=...)``):

- :class:`PrefixAwareRouter` keeps its own view of each replica's cache: the chained hashes of
  the full pages of every prompt it routed there, bounded to the replica's pool size and aged
  out least-recently-used first, like the cache itself. A request goes to the replica whose view
  holds its longest prefix, unless that replica has more than ``load_threshold`` requests in
  flight beyond the least loaded one; ties go to the replica with the fewest requests in flight,
  then to the one holding the fewest pages (so new prefixes spread over the replicas).
- :class:`RoundRobinRouter` is the baseline: replicas in turn, whatever the prompt.

The example deploys both, each over its own replicas with equal settings, sends the same
multi-tenant stream to each (a few tenants, each with its own long shared prefix, interleaved
round by round) and prints each replica's token hit rate (prompt tokens whose KV came from the
cache) and the overall one. With pools too small to hold every tenant's prefix on every replica,
round robin makes each replica cycle through every tenant and evict what it will need next;
prefix routing keeps each tenant on one replica.

Requirements: radixkv installed (the wheel, or ``make develop``), ``ray[serve]`` (the Ray
Serve ``RequestRouter`` API is alpha; written against 2.60) and ``torch``, all CPU only.
``make test-cluster`` installs them into its own environment (``requirements-cluster.txt``) and
runs this example through ``tests/cluster/test_ray_serve_example.py``. By hand::

    python examples/ray_serve_router.py
    python examples/ray_serve_router.py --tenants 3 --rounds 6 --prefix-pages 8 --json out.json

It starts a local Ray instance (2 CPUs, no dashboard) and shuts Serve and Ray down at the end,
also when something fails; run inside a process that already called ``ray.init()``, it deletes
only the applications it deployed and leaves Ray running. ``--help`` lists the sizes.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "this example needs Ray Serve: pip install 'ray[serve]==2.60.0' "
        "(or run `make test-cluster`, which installs requirements-cluster.txt)"
    ) from exc

#: The tiny model every replica serves (the one the radixkv tests use).
MODEL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
)


def make_engine(seed: int, num_pages: int, page_size: int, prefix_caching: bool = True) -> Any:
    """A :class:`radixkv.Engine` on CPU over the tiny random model drawn from ``seed`` and a
    ``RadixCache`` of ``num_pages`` pages of ``page_size`` tokens."""
    import torch

    import radixkv
    from radixkv.models import CausalLM, ModelConfig

    torch.set_num_threads(1)  # tiny tensors: a second thread only adds synchronisation
    model = CausalLM.random(ModelConfig(**MODEL), seed=seed, dtype=torch.float32, device="cpu")
    kv = model.make_kv_cache(radixkv.RadixCache(num_pages, page_size=page_size))
    return radixkv.Engine(model, kv, prefix_caching=prefix_caching)


def page_hashes(prompt: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of the full pages of ``prompt``: the ``i``-th names the first ``i + 1``
    pages, so two prompts share the first ``k`` hashes exactly when they share ``k`` pages."""
    out: list[int] = []
    h = 0
    for start in range(0, len(prompt) - page_size + 1, page_size):
        h = hash((h, tuple(int(t) for t in prompt[start : start + page_size])))
        out.append(h)
    return out


def _prompt_of(pending_request: PendingRequest | None) -> list[int] | None:
    """The token ids a request to ``EngineReplica.generate`` carries (its first argument)."""
    if pending_request is None or not pending_request.args:
        return None
    prompt = pending_request.args[0]
    return prompt if isinstance(prompt, list) else None


class PrefixAwareRouter(RequestRouter):
    """Routes each request to the replica holding its longest cached prefix, within a load
    threshold (see the module docstring). Its state lives in the process that owns the
    deployment handle; Ray Serve calls :meth:`initialize_state` with the deployment's
    ``request_router_kwargs``, :meth:`choose_replicas` for each routing attempt, and the
    ``on_request_routed`` / ``on_request_completed`` hooks around each request."""

    def initialize_state(
        self, page_size: int = 16, capacity_pages: int = 64, load_threshold: int = 2
    ) -> None:
        """``page_size``: the replicas' page size; ``capacity_pages``: pages each replica's
        pool holds (the view of a replica forgets its least recently routed pages beyond that);
        ``load_threshold``: requests in flight a replica may have beyond the least loaded one
        and still get a request for its prefix."""
        for name, value, low in (
            ("page_size", page_size, 1),
            ("capacity_pages", capacity_pages, 1),
            ("load_threshold", load_threshold, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self.load_threshold = load_threshold
        self._views: dict[ReplicaID, OrderedDict[int, None]] = {}
        self._in_flight: dict[ReplicaID, int] = {}
        self._requests: dict[str, ReplicaID] = {}

    def _matched_pages(self, replica_id: ReplicaID, hashes: list[int]) -> int:
        view = self._views.get(replica_id, {})
        n = 0
        while n < len(hashes) and hashes[n] in view:
            n += 1
        return n

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Every candidate, best first, one per rank (Serve tries the ranks in order)."""
        prompt = _prompt_of(pending_request)
        hashes = page_hashes(prompt, self.page_size) if prompt is not None else []
        loads = {r.replica_id: self._in_flight.get(r.replica_id, 0) for r in candidate_replicas}
        least = min(loads.values(), default=0)

        def key(r: RunningReplica) -> tuple[int, int, int, str]:
            rid = r.replica_id
            matched = self._matched_pages(rid, hashes)
            if loads[rid] - least > self.load_threshold:
                matched = 0  # too busy: its prefix does not count
            return (-matched, loads[rid], len(self._views.get(rid, ())), rid.unique_id)

        return [[r] for r in sorted(candidate_replicas, key=key)]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Records the request's pages in the view of the replica it went to (Serve calls this
        once the replica has accepted the request)."""
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1
        self._requests[pending_request.metadata.internal_request_id] = replica_id
        prompt = _prompt_of(pending_request)
        if prompt is None:
            return
        view = self._views.setdefault(replica_id, OrderedDict())
        for h in page_hashes(prompt, self.page_size):
            view[h] = None
            view.move_to_end(h)
        while len(view) > self.capacity_pages:
            view.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """One request fewer in flight on ``replica_id``."""
        if self._requests.pop(internal_request_id, None) is not None:
            self._in_flight[replica_id] = max(0, self._in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forgets a dead replica's view (its cache died with it), then lets Serve drop it."""
        self._views.pop(replica_id, None)
        self._in_flight.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)


class RoundRobinRouter(RequestRouter):
    """The baseline: the replicas in turn (in a fixed order), whatever the prompt."""

    def initialize_state(self) -> None:
        """Starts at the first replica."""
        self._turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The next replica in turn first, then the others."""
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        i = self._turn % len(ordered)
        self._turn += 1
        return [[r] for r in ordered[i:] + ordered[:i]]


@serve.deployment(max_ongoing_requests=4, ray_actor_options={"num_cpus": 0})
class EngineReplica:
    """One radixkv Engine; ``generate`` runs one request to the end and reports it."""

    def __init__(self, seed: int, num_pages: int, page_size: int) -> None:
        self.engine = make_engine(seed, num_pages, page_size)
        self.lock = threading.Lock()  # the engine is not thread-safe
        self.name = serve.get_replica_context().replica_id.unique_id

    def generate(self, prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
        """Greedy decoding of ``prompt``: the output tokens, the prompt tokens whose KV came
        from this replica's cache, and this replica's name."""
        with self.lock:
            rid = self.engine.submit(np.asarray(prompt, dtype=np.uint32), max_new_tokens)
            (result,) = self.engine.run([rid], release=True)
        if result.finish_reason not in ("length", "stop"):
            raise RuntimeError(f"request failed ({result.finish_reason}): {result.error!r}")
        return {
            "replica": self.name,
            "output": [int(t) for t in result.output],
            "prompt_tokens": int(result.prompt_tokens),
            "cached_tokens": int(result.cached_tokens),
        }


def make_stream(
    tenants: int, rounds: int, prefix_len: int, suffix_len: int, vocab: int, seed: int
) -> list[tuple[int, list[int]]]:
    """``(tenant, prompt)`` pairs: round by round, one request per tenant, each its tenant's
    shared prefix followed by a suffix of its own."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, prefix_len).tolist() for _ in range(tenants)]
    return [
        (t, prefixes[t] + rng.integers(0, vocab, suffix_len).tolist())
        for _ in range(rounds)
        for t in range(tenants)
    ]


@dataclass
class ReplicaStats:
    """What one replica served in one arm."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache, as a fraction of all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class ArmReport:
    """One routing policy's run over the stream: per-replica totals (replicas named in the
    order they first served), the outputs in stream order."""

    replicas: dict[str, ReplicaStats] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list)
    served_by: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """The token hit rate over every replica."""
        prompt = sum(s.prompt_tokens for s in self.replicas.values())
        return sum(s.cached_tokens for s in self.replicas.values()) / prompt if prompt else 0.0


def run_arm(
    handle: Any, stream: list[tuple[int, list[int]]], max_new_tokens: int, window: int
) -> ArmReport:
    """Sends ``stream`` through ``handle``, ``window`` requests in flight at a time; waits for
    each window to finish before sending the next."""
    report = ArmReport()
    names: dict[str, str] = {}
    for start in range(0, len(stream), window):
        batch = stream[start : start + window]
        responses = [handle.generate.remote(p, max_new_tokens) for _, p in batch]
        for response in responses:
            r = response.result()
            name = names.setdefault(r["replica"], f"replica-{len(names)}")
            stats = report.replicas.setdefault(name, ReplicaStats())
            stats.requests += 1
            stats.prompt_tokens += r["prompt_tokens"]
            stats.cached_tokens += r["cached_tokens"]
            report.outputs.append(r["output"])
            report.served_by.append(name)
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (``sys.argv[1:]`` when ``argv`` is None); exits with a message naming
    the bad option and value when one is out of range."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="engine replicas per policy")
    p.add_argument("--tenants", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4, help="requests per tenant")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefix-pages", type=int, default=6, help="shared prefix, in pages")
    p.add_argument("--suffix-len", type=int, default=12, help="tokens of each request's own")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument(
        "--pool-pages",
        type=int,
        default=0,
        help="pages in each replica's pool (default: room for tenants/replicas prefixes + 3 "
        "requests, so no replica holds every tenant's prefix)",
    )
    p.add_argument("--window", type=int, default=2, help="requests in flight at a time")
    p.add_argument("--load-threshold", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the report (and the stream) to this file")
    args = p.parse_args(argv)
    for name in ("replicas", "tenants", "rounds", "page_size", "prefix_pages", "window"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("suffix_len", "max_new_tokens", "pool_pages", "load_threshold"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return args


def _deploy(app: Any, name: str) -> Any:
    """``serve.run`` for the application ``name``; a failed deployment raises a RuntimeError
    that carries the deployments' own messages (a replica's traceback; the example keeps Ray's
    worker logs off the console)."""
    try:
        return serve.run(app, name=name, route_prefix=None)
    except RuntimeError as exc:
        try:
            status = serve.status().applications.get(name)
            details = (
                [f"{d}: {s.message}" for d, s in status.deployments.items() if s.message]
                if status is not None
                else []
            )
        except Exception:  # the status is only a better message: keep the original error
            details = []
        if not details:
            raise
        raise RuntimeError(f"{exc}\n" + "\n".join(details)) from exc


def format_report(
    args: argparse.Namespace, pool: int, stream_len: int, reports: dict[str, ArmReport]
) -> str:
    """The text :func:`main` prints: the setup, each arm's replicas, and the comparison."""
    ps = args.page_size
    lines = [
        f"{stream_len} requests: {args.tenants} tenants x {args.rounds} rounds, each a shared "
        f"prefix of {args.prefix_pages * ps} tokens + {args.suffix_len} tokens of its own, "
        f"{args.max_new_tokens} generated",
        f"{args.replicas} replicas per router, each a pool of {pool} pages x {ps} tokens",
    ]
    for arm, report in reports.items():
        lines.append(f"{arm}:")
        for name, s in sorted(report.replicas.items()):
            lines.append(
                f"  {name}: {s.requests:3d} requests, token hit rate {s.hit_rate:6.1%} "
                f"({s.cached_tokens}/{s.prompt_tokens} prompt tokens from the cache)"
            )
        lines.append(f"  overall token hit rate {report.hit_rate:6.1%}")
    if {"prefix", "round_robin"} <= reports.keys():
        lines.append(
            f"prefix-aware routing: {reports['prefix'].hit_rate:.1%} token hit rate, "
            f"round robin: {reports['round_robin'].hit_rate:.1%}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the example and prints its report; returns it (``"stream"``: the prompts;
    ``"prefix"`` and ``"round_robin"``: an :class:`ArmReport` each). Raises ``ValueError`` for
    a pool too small for one request, before starting anything."""
    import ray
    from ray import cloudpickle

    args = parse_args(argv)
    ps = args.page_size
    request_pages = -(-(args.prefix_pages * ps + args.suffix_len + args.max_new_tokens) // ps)
    pool = args.pool_pages or (
        -(-args.tenants // args.replicas) * args.prefix_pages
        + 3 * (request_pages - args.prefix_pages)
        + 1
    )
    if pool < request_pages:
        raise ValueError(
            f"--pool-pages {pool} cannot hold one request ({request_pages} pages of {ps} tokens)"
        )
    stream = make_stream(
        args.tenants,
        args.rounds,
        args.prefix_pages * ps,
        args.suffix_len,
        MODEL["vocab_size"],
        args.seed,
    )
    # RequestRouterConfig pickles its router class by value when built (registering the class's
    # module for that, then unregistering it), so the configs are built first.
    routers = {
        "prefix": RequestRouterConfig(
            request_router_class=PrefixAwareRouter,
            request_router_kwargs={
                "page_size": ps,
                "capacity_pages": pool,
                "load_threshold": args.load_threshold,
            },
        ),
        "round_robin": RequestRouterConfig(request_router_class=RoundRobinRouter),
    }
    # The deployment class travels to the replicas by value too, so the example runs from any
    # folder, imported or as a script (a module Ray's workers cannot import by name).
    module = sys.modules[__name__]
    by_value = module.__name__ not in cloudpickle.list_registry_pickle_by_value()
    if by_value:
        cloudpickle.register_pickle_by_value(module)
    started = not ray.is_initialized()
    reports: dict[str, ArmReport] = {}
    deployed: list[str] = []
    try:
        if started:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        serve.start(proxy_location="Disabled")
        for arm, router in routers.items():
            app = EngineReplica.options(
                name=f"engine_{arm}", num_replicas=args.replicas, request_router_config=router
            ).bind(args.seed, pool, ps)
            deployed.append(arm)
            handle = _deploy(app, arm)
            reports[arm] = run_arm(handle, stream, args.max_new_tokens, args.window)
            serve.delete(arm)
            deployed.remove(arm)
    finally:
        try:
            if started:
                if ray.is_initialized():  # else serve.shutdown() would start a Ray instance
                    serve.shutdown()  # also deletes whatever is still deployed
            else:
                for arm in deployed:
                    serve.delete(arm)
        finally:
            if started:
                ray.shutdown()
            if by_value and module.__name__ in cloudpickle.list_registry_pickle_by_value():
                cloudpickle.unregister_pickle_by_value(module)

    print(format_report(args, pool, len(stream), reports))
    result: dict[str, Any] = {"stream": [p for _, p in stream], **reports}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "stream": result["stream"],
                    **{arm: {**asdict(r), "hit_rate": r.hit_rate} for arm, r in reports.items()},
                },
                f,
            )
    return result


if __name__ == "__main__":
    main()
