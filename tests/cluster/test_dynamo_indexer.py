"""radixkv workers against a real KV-aware router: NVIDIA Dynamo's standalone KV indexer.

``python -m dynamo.indexer`` (package ``ai-dynamo-runtime``, run by ``make test-cluster``) runs on
CPU with no etcd or NATS: an HTTP server (``--port``) that subscribes to each worker's ZeroMQ KV
event stream (``POST /register`` with ``instance_id``, ``endpoint``, ``model_name``,
``block_size``), keeps a radix tree of every worker's blocks, and answers ``POST /query`` with
``token_ids`` by hashing the prompt itself and returning, per worker and data-parallel rank, the
length of the worker's cached prefix in tokens (matched blocks x block size).

What these tests pin down about that consumer (Dynamo 1.6.1):

- It rehashes the token ids of each ``BlockStored`` (its own hash of the tokens of each block) and
  queries by the tokens of the prompt, so our block hash is only the worker's name for a block:
  ``block_hash="blake3"`` and ``"sha256_cbor"`` both work, as long as all workers name the same
  content alike (identical hashes for identical blocks).
- Block hashes must be integers (``int_hashes=True``): a batch with 32-byte hashes fails to decode
  ("did not match any variant of untagged enum BlockHashValue").
- The batch must be msgpack in array form (``layout="array"``): a map-form batch fails to decode
  ("invalid type: map, expected a tuple of size 3").
- Both failures only reach the indexer's log; its HTTP API keeps the worker listed as active and
  scores nothing for it, so a misconfigured publisher is silently ignored.

The main test drives a BlockCache and a RadixCache (page size 16, small pools, so blocks are
evicted) and a larger BlockCache with prompts that share prefixes across workers, resets one of
them, and checks at each step that for every probe prompt the indexer's score for each worker is
exactly that worker's own ``match_prefix`` rounded down to whole blocks.
"""

import importlib.util
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import radixkv

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
if importlib.util.find_spec("dynamo") is None:
    pytest.skip(
        "needs NVIDIA Dynamo's indexer (pip install ai-dynamo-runtime; make test-cluster)",
        allow_module_level=True,
    )

from radixkv.events import ZmqPublisher

BLOCK = 16  # Dynamo's block size for these workers; every cache below has page_size 16
MODEL = "radixkv-test"
WATCHDOG_S = 240.0  # the indexer is killed after this long, whatever the test is doing
SETTLE_S = 20.0  # how long a check waits for the indexer to consume what was published
HTTP_TIMEOUT_S = 5.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ---- the indexer process -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Indexer:
    """A running ``python -m dynamo.indexer`` and its HTTP API."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("wb")
        # Version 1.6.1 has no host option: it listens on all interfaces, on a free port.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._watchdog = threading.Timer(WATCHDOG_S, self.proc.kill)
        self._watchdog.daemon = True
        self._watchdog.start()
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dynamo.indexer exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                if self.get("/health") is not None:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"dynamo.indexer did not answer /health:\n{self.log()}")
            time.sleep(0.1)

    def _call(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} {body!r}: HTTP {e.code}: {e.read().decode()}") from e
        return json.loads(text) if text else {}

    def get(self, path: str) -> Any:
        return self._call(path)

    def post(self, path: str, body: Any) -> Any:
        return self._call(path, body)

    def register(self, worker: "Worker") -> None:
        self.post(
            "/register",
            {
                "instance_id": worker.id,
                "endpoint": worker.pub.endpoint,
                "model_name": MODEL,
                "block_size": BLOCK,
            },
        )

    def scores(self, tokens: list[int]) -> dict[int, int]:
        """Matched tokens per worker (data-parallel rank 0) for a prompt; absent workers are 0."""
        got = self.post("/query", {"token_ids": tokens, "model_name": MODEL})
        return {int(w): int(ranks.get("0", 0)) for w, ranks in got["scores"].items()}

    def log(self) -> str:
        self._log.flush()
        return ANSI.sub("", self.log_path.read_text(errors="replace"))

    def close(self) -> None:
        self._watchdog.cancel()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[Indexer]:
    idx = Indexer(tmp_path / "dynamo-indexer.log")
    try:
        yield idx
    finally:
        idx.close()


# ---- radixkv workers -----------------------------------------------------------------------------


class Worker:
    """A radixkv cache with a KV event publisher on a loopback port."""

    def __init__(self, instance_id: int, cache: Any, **publisher: Any) -> None:
        self.id = instance_id
        self.cache = cache
        publisher.setdefault("int_hashes", True)
        self.pub = ZmqPublisher(cache, "tcp://127.0.0.1:*", **publisher)

    def serve(self, prompts: list[list[int]]) -> None:
        """One engine step: admits the prompts together, computes them, finishes them."""
        reqs = [self.cache.admit(p) for p in prompts]
        for r in reqs:
            self.cache.commit(r, r.num_tokens)
        for r in reqs:
            self.cache.finish(r)

    def expected(self, probe: list[int]) -> int:
        """What a router should score: the tokens ``admit`` would serve from the cache (the token
        appended lifts the one-token-computed limit), in whole blocks."""
        return self.cache.match_prefix([*probe, 0]) // BLOCK * BLOCK

    def close(self) -> None:
        self.pub.close()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for w in made:
        w.close()


def wait_for(what: str, cond: Callable[[], bool], timeout: float = SETTLE_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def connect(indexer: Indexer, w: Worker, sentinel: list[int]) -> None:
    """Registers a worker and waits until its events reach the indexer: ZeroMQ drops what a PUB
    socket sends before the subscription arrives, so a fresh sentinel prompt is published until
    the indexer scores it; then the cache is reset (``AllBlocksCleared``) and the indexer is
    waited on to forget the sentinel, so both sides start empty."""
    indexer.register(w)
    for attempt in range(100):
        probe = [t + attempt * 1000 for t in sentinel]
        w.serve([probe])
        w.pub.publish()
        try:
            wait_for("the sentinel", lambda p=probe: indexer.scores(p).get(w.id, 0) > 0, 0.5)
            break
        except TimeoutError:
            continue
    else:
        raise TimeoutError(f"worker {w.id}'s events never reached the indexer:\n{indexer.log()}")
    w.cache.reset()
    assert w.pub.publish() >= 1
    wait_for("the reset", lambda: indexer.scores(probe).get(w.id, 0) == 0)


def check(indexer: Indexer, workers: list[Worker], probes: list[list[int]]) -> dict:
    """Publishes every worker's events, then waits until the indexer's score of each probe for
    each worker equals the worker's own match (failing with the difference after SETTLE_S)."""
    for w in workers:
        w.pub.publish()
    want = {i: {w.id: w.expected(p) for w in workers} for i, p in enumerate(probes)}

    def got() -> dict:
        out = {}
        for i, p in enumerate(probes):
            s = indexer.scores(p)
            out[i] = {w.id: s.get(w.id, 0) for w in workers}
        return out

    try:
        wait_for("the indexer to match every worker", lambda: got() == want)
    except TimeoutError:
        now = got()
        diff = {i: (want[i], now[i]) for i in want if want[i] != now[i]}
        pytest.fail(
            f"indexer scores != match_prefix for {len(diff)} of {len(probes)} probes "
            f"(probe: (want, got)): {diff}\n--- indexer log ---\n{indexer.log()[-3000:]}"
        )
    return want


# ---- tests ---------------------------------------------------------------------------------------


def tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1, 32000, n)]


@pytest.mark.parametrize("block_hash", ["blake3", "sha256_cbor"])
def test_indexer_scores_equal_match_prefix(indexer, workers, block_hash):
    rng = np.random.default_rng(14)
    workers += [
        Worker(1, radixkv.BlockCache(20, BLOCK), block_hash=block_hash),
        Worker(2, radixkv.RadixCache(20, BLOCK), block_hash=block_hash),
        Worker(3, radixkv.BlockCache(200, BLOCK), block_hash=block_hash),
    ]
    for k, w in enumerate(workers):
        connect(indexer, w, [100_000 + 100 * k + t for t in range(2 * BLOCK)])

    # System prompts (one not a whole number of blocks, so prompts part inside a block) and user
    # turns; every prompt is at most 8 blocks, two of them fit a 20-page pool at once.
    systems = [tokens(rng, n) for n in (40, 64, 24)]
    prompts = [s + tokens(rng, int(rng.integers(8, 60))) for s in systems for _ in range(6)]
    prompts.append(tokens(rng, 5))  # shorter than a block: nothing to index

    def probes_of(ps: list[list[int]]) -> list[list[int]]:
        out = list(systems)
        for p in ps:
            out += [p, p[: len(p) // 2], [*p[:-3], 7, 7, 7], p[:BLOCK]]
        return [*out, tokens(rng, 70)]

    def step(w: Worker, picks: list[int]) -> None:
        for a in range(0, len(picks), 2):
            w.serve([prompts[i] for i in picks[a : a + 2]])

    # Phase 1: each worker serves its own share; shared prefixes across workers.
    step(workers[0], [0, 1, 6, 12])
    step(workers[1], [0, 2, 7, 8])
    step(workers[2], [1, 2, 3, 6, 13, 18])
    probes = probes_of(prompts)
    first = check(indexer, workers, probes)
    assert any(len(set(s.values())) > 1 for s in first.values()), "workers should differ"

    # Phase 2: enough traffic that the two small pools evict (several times over).
    order = [int(i) for i in rng.permutation(len(prompts))]
    step(workers[0], order)
    step(workers[1], order[::-1])
    step(workers[2], order[:10])
    second = check(indexer, workers, probes)
    assert workers[0].cache.stats.evicted_pages > 20
    assert workers[1].cache.stats.evicted_pages > 20
    assert any(s[1] > 0 for s in second.values()) and any(s[2] > 0 for s in second.values())

    # Phase 3: one worker resets; the others keep what they hold.
    workers[2].cache.reset()
    third = check(indexer, workers, probes)
    assert all(s[3] == 0 for s in third.values()) and any(s[3] > 0 for s in second.values())
    assert any(s[1] > 0 for s in third.values())

    # Phase 4: traffic again after the reset, evicting along the way; checked after every step.
    for _ in range(3):
        for w in workers:
            step(w, [int(i) for i in rng.choice(len(prompts), 4, replace=False)])
        check(indexer, workers, probes)
    final = check(indexer, workers, probes)
    assert sum(s[3] > 0 for s in final.values()) > 3


def test_map_form_and_byte_hashes_are_ignored(indexer, workers):
    rng = np.random.default_rng(7)
    ok = Worker(1, radixkv.BlockCache(64, BLOCK))
    as_map = Worker(2, radixkv.BlockCache(64, BLOCK), layout="map")
    as_bytes = Worker(3, radixkv.BlockCache(64, BLOCK), int_hashes=False)
    workers += [ok, as_map, as_bytes]
    connect(indexer, ok, [100_000 + t for t in range(2 * BLOCK)])
    prompt = tokens(rng, 5 * BLOCK)
    failures = {
        as_map.id: "invalid type: map, expected a tuple of size 3",
        as_bytes.id: "did not match any variant of untagged enum BlockHashValue",
    }
    for w in (as_map, as_bytes):
        indexer.register(w)

        # The indexer logs a decode failure for each batch it drops; publish until one is logged.
        def dropped(w: Worker = w) -> bool:
            return any(
                failures[w.id] in line and f"worker_id={w.id} " in line
                for line in indexer.log().splitlines()
            )

        for attempt in range(100):
            w.serve([[t + attempt for t in prompt[: 2 * BLOCK]]])
            w.pub.publish()
            try:
                wait_for(f"worker {w.id}'s batch to be dropped", dropped, 0.5)
                break
            except TimeoutError:
                continue
        else:
            pytest.fail(f"worker {w.id}'s batches were never dropped:\n{indexer.log()}")
    for w in workers:
        w.serve([prompt])
        w.pub.publish()
        assert w.expected(prompt) == 5 * BLOCK
    wait_for("the array-form worker", lambda: indexer.scores(prompt).get(ok.id, 0) == 5 * BLOCK)
    time.sleep(0.5)  # the other two published first; give them the same time again
    scores = indexer.scores(prompt)
    assert scores.get(as_map.id, 0) == 0 and scores.get(as_bytes.id, 0) == 0, scores
    # Nothing tells the worker: it is listed as an active subscriber like the good one.
    listed = {w["instance_id"]: w["status"] for w in indexer.get("/workers")}
    assert listed == {1: "active", 2: "active", 3: "active"}, listed
