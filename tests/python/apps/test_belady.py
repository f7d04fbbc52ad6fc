"""The offline bound: Belady never recomputes more than LRU, equals an exhaustive optimum on
tiny workloads, matches a textbook case, and its LRU twin matches today's RadixCache."""

import itertools
import math
from functools import cache

import numpy as np
import pytest

import radixkv
from radixkv.apps.common.trace import TraceRequest
from radixkv.apps.replay.belady import simulate
from radixkv.apps.replay.block_keys import block_keys
from radixkv.apps.replay.prefill_queue import prefill_ttfts


def request(tokens, t=0.0, out=1):
    return TraceRequest(float(t), np.asarray(tokens, dtype=np.uint32), out)


def random_workload(rng, n_requests, page_size, vocab=3, max_pages=4):
    """Requests over a few shared prefixes: each prompt is a random walk down a small tree of
    page contents (vocab choices per page), plus a partial page of fresh tokens or none."""
    reqs, fresh = [], 10_000
    for i in range(n_requests):
        pages = int(rng.integers(1, max_pages + 1))
        toks = []
        for _ in range(pages):
            toks += [int(rng.integers(vocab))] * page_size
        tail = int(rng.integers(0, page_size))
        toks += list(range(fresh, fresh + tail))
        fresh += tail
        reqs.append(request(toks, t=i))
    return reqs


def cache_lru(reqs, num_pages, page_size):
    """Recomputed prompt tokens of today's RadixCache serving ``reqs`` one at a time."""
    cache = radixkv.RadixCache(num_pages, page_size)
    for r in reqs:
        req = cache.admit(r.tokens)
        cache.commit(req, req.num_tokens)
        cache.finish(req)
    cache.check()
    return cache.stats.query_tokens - cache.stats.hit_tokens


def exhaustive_best(reqs, num_pages, page_size):
    """The most cached tokens any eviction choice reaches in the model of radixkv.apps.replay.belady
    (evicting any pages, prefix-closed or not), by search over every choice."""
    blocks = block_keys(reqs, page_size)
    chains = [tuple(blocks.of(i).tolist()) for i in range(len(reqs))]

    @cache
    def best(i, cached):
        if i == len(reqs):
            return 0
        n, chain = len(reqs[i].tokens), chains[i]
        run = next((k for k, b in enumerate(chain) if b not in cached), len(chain))
        hit = min(run, (n - 1) // page_size)
        short = len(cached) + math.ceil(n / page_size) - hit - num_pages
        options = sorted(cached - set(chain[:hit]))
        out = -1
        for gone in itertools.combinations(options, max(short, 0)):
            after = (cached - frozenset(gone)) | frozenset(chain)
            out = max(out, best(i + 1, after))
        return hit * page_size + out

    return best(0, frozenset())


def test_textbook_case_opt_9_faults_lru_12():
    """The reference string 7 0 1 2 0 3 0 4 2 3 0 3 2 1 2 0 1 7 0 1 with 3 frames: the optimum
    faults 9 times, LRU 12 (Silberschatz, Operating System Concepts, 9.4). Each request is one
    4-token page plus one token of its own (a partial page, never cached), so a pool of 4 pages
    holds 3 cached pages beside a running request."""
    refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    reqs = [request([p] * 4 + [1000 + i], t=i) for i, p in enumerate(refs)]
    opt = simulate(reqs, 4, 4, "belady", check=True)
    lru = simulate(reqs, 4, 4, "lru", check=True)
    assert opt.cached_tokens == 4 * (20 - 9)
    assert lru.cached_tokens == 4 * (20 - 12)
    assert lru.computed_tokens == cache_lru(reqs, 4, 4)
    assert opt.evicted_pages == 9 - 3 and lru.evicted_pages == 12 - 3
    assert list(opt.cached[:4]) == [0, 0, 0, 0] and opt.cached[4] == 4  # 0 hits at turn 5


def test_prefix_hit_and_one_token_cap():
    """A hit is the cached prefix of full pages, less the last one when it would leave nothing
    to compute; a page follows its parent out."""
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    reqs = [request(a + b), request(a + b), request(a + c + [9]), request(a + b + [9])]
    big = simulate(reqs, 16, 4, "belady", check=True)
    assert list(big.cached) == [0, 4, 4, 8]
    # Three pages: the third request (3 pages, a pinned) must evict one: "a b"'s page b, the
    # only one not pinned; the fourth evicts c (never used again) and recomputes b.
    tight = simulate(reqs, 3, 4, "belady", check=True)
    assert list(tight.cached) == [0, 4, 4, 4]


@pytest.mark.parametrize("seed", range(40))
def test_belady_equals_exhaustive_optimum_and_beats_lru(seed):
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 2, 4]))
    reqs = random_workload(rng, int(rng.integers(3, 8)), page_size, max_pages=3)
    need = max(math.ceil((len(r.tokens)) / page_size) for r in reqs)
    num_pages = int(rng.integers(need, need + 4))
    opt = simulate(reqs, num_pages, page_size, "belady", check=True)
    lru = simulate(reqs, num_pages, page_size, "lru", check=True)
    assert opt.cached_tokens == exhaustive_best(reqs, num_pages, page_size)
    assert opt.computed_tokens <= lru.computed_tokens
    assert opt.cached_tokens + opt.computed_tokens == sum(len(r.tokens) for r in reqs)


@pytest.mark.parametrize("seed", range(30))
def test_lru_model_matches_radix_cache_and_belady_is_never_worse(seed):
    """Larger random workloads: the LRU model recomputes what today's RadixCache recomputes,
    token for token, and Belady never more."""
    rng = np.random.default_rng(100 + seed)
    page_size = int(rng.choice([1, 4, 16]))
    reqs = random_workload(rng, 60, page_size, vocab=4, max_pages=8)
    num_pages = int(rng.integers(10, 40))
    opt = simulate(reqs, num_pages, page_size, "belady", check=True)
    lru = simulate(reqs, num_pages, page_size, "lru", check=True)
    assert lru.computed_tokens == cache_lru(reqs, num_pages, page_size)
    assert opt.computed_tokens <= lru.computed_tokens
    assert opt.dropped == lru.dropped == 0


def test_requests_the_pool_cannot_hold_are_dropped():
    reqs = [request(range(40), out=1), request(range(10), out=30), request(range(10), out=1)]
    res = simulate(reqs, 2, 16, "belady")  # 40 tokens, 10 + 30 - 1 tokens: 3 pages each
    assert list(res.served) == [False, False, True] and res.dropped == 2 and res.requests == 1
    with pytest.raises(ValueError, match="policy must be one of"):
        simulate(reqs, 2, 16, "fifo")
    with pytest.raises(ValueError, match="num_pages must be an int >= 1, got 0"):
        simulate(reqs, 0, 16)


def test_namespaces_never_share_blocks():
    toks = [5] * 8
    keys = block_keys([request(toks), TraceRequest(0.0, np.asarray(toks, np.uint32), 1, "x")], 4)
    assert keys.num_blocks == 4 and list(keys.parent[keys.of(0)]) == [-1, keys.of(0)[0]]
    same = block_keys([request(toks), request([*toks, 1, 2, 3, 4])], 4)
    assert same.num_blocks == 3 and list(same.of(1)[:2]) == list(same.of(0))


def test_prefill_queue_batches_and_chunks():
    # Alone: its own tokens at 1,000 tokens/s. Together: FCFS in one batch of 300 tokens.
    assert list(prefill_ttfts([0.0], [500], 1000.0)) == [0.5]
    assert list(prefill_ttfts([0.0, 0.0], [100, 200], 1000.0)) == [pytest.approx(0.3)] * 2
    # A budget of 100 tokens: 250 tokens go in three batches, the second request in the third.
    got = prefill_ttfts([0.0, 0.0], [250, 20], 1000.0, token_budget=100)
    assert got == pytest.approx([0.27, 0.27])
    # One arriving during a batch waits for it to end.
    assert prefill_ttfts([0.0, 0.1], [400, 100], 1000.0) == pytest.approx([0.4, 0.4])
    with pytest.raises(ValueError, match="computed must be >= 1"):
        prefill_ttfts([0.0], [0])


def test_cli_prints_the_bound_beside_the_policies(capsys):
    from radixkv.apps import cli

    argv = ["replay", "--workload", "agent", "--sessions", "4", "--seed", "5", "--no-chart"]
    assert cli.main([*argv, "--policy", "lpm", "--bound", "belady"]) == 0
    out = capsys.readouterr().out
    assert "agent workload: 4 sessions (seed 5)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:1].isalpha()}
    hit = {name: float(rows[name][1].rstrip("%")) for name in ("lpm", "lru*", "belady*")}
    assert hit["belady*"] >= hit["lru*"] > 0
    # Without --bound: the table as it was, no starred rows.
    assert cli.main([*argv, "--policy", "lpm"]) == 0
    assert "belady*" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["some.jsonl"], "--workload agent generates its requests: drop the trace"),
        (["--bound", "belady", "--replicas", "2"], "--bound belady models one pool"),
    ],
)
def test_cli_refuses_what_the_workload_or_bound_cannot_do(extra, message, capsys):
    from radixkv.apps import cli

    assert cli.main(["replay", "--workload", "agent", "--no-chart", *extra]) == 2
    assert message in capsys.readouterr().err
