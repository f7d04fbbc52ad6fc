"""Tensor-parallel engines in lockstep: 2 processes over gloo on CPU, each with its shard of the
tiny model (``CausalLM.shard``) and its own cache, must produce what one process produces with
the whole model, for both caches and the three policies, with preemption and eviction forced by
a small pool; a rank whose index is made to diverge must be caught, raising on both ranks.

All scenarios of one test run in one pair of processes (starting torch twice costs seconds), and
a watchdog kills them if they hang.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

import radixkv
from radixkv.engine import agree_num_pages
from ranks import end_rank, join_gloo, run_ranks
from tiny_model import VOCAB, tiny_model

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

POLICIES = ["fcfs", "lpm", "dfs-weight"]
# Pools of 64 tokens: every request fits alone, the workload does not fit at once.
CACHES = {
    "radix": lambda: radixkv.RadixCache(16, page_size=4),
    "block": lambda: radixkv.BlockCache(8, page_size=8),
    # A host tier under the small pool: every rank offloads and loads its own heads' pages as
    # the index decides, in lockstep.
    "radix-host": lambda: radixkv.RadixCache(16, page_size=4, host_pages=16),
}
SCENARIOS = [(c, p) for c in CACHES for p in POLICIES]


def make_engine(cache: str, policy: str, model, **kw) -> radixkv.Engine:
    kv = model.make_kv_cache(CACHES[cache]())
    return radixkv.Engine(model, kv, token_budget=24, max_batch=4, policy=policy, **kw)


def drive(eng: radixkv.Engine) -> None:
    """Rank 0's (and the single process's) calls: arrivals between steps, a cancel, branches,
    greedy and seeded sampling, a release."""
    rng = np.random.default_rng(7)
    system = rng.integers(0, VOCAB, 12)
    prompts = [np.concatenate([system, rng.integers(0, VOCAB, n)]) for n in (9, 14, 5, 17)]
    for i, p in enumerate(prompts[:2]):
        eng.submit(p, max_new_tokens=8, temperature=0.8 * (i % 2), seed=i)
    doomed = eng.submit(prompts[2], max_new_tokens=4)
    eng.cancel(doomed)
    for _ in range(3):
        eng.step()
    eng.branch(prompts[1][:20], [[1, 2, 3], [4, 5]], max_new_tokens=6, temperature=0.7, seed=5)
    for i, p in enumerate(prompts[2:]):
        eng.submit(p, max_new_tokens=9, temperature=0.9 * (i % 2), seed=10 + i)
    eng.run()
    eng.release([doomed])
    # Session turns: a submit and a run each, retained (until closed: the digest, compared with
    # one process, must not depend on when each ran), in eviction class 1.
    chat = radixkv.Session(eng, system=system, keep_alive=math.inf, cache_priority=1)
    chat.send(prompts[3][12:], max_new_tokens=5, temperature=0.5, seed=3)
    chat.send(prompts[0][12:], max_new_tokens=3)
    chat.close()


def host_traffic(eng: radixkv.Engine) -> list[int]:
    """Pages offloaded to and loaded from the host tier, and tokens it served as hits."""
    st = eng.cache.stats
    return [st.offloaded_pages, st.loaded_pages, st.host_hit_tokens]


def outputs(eng: radixkv.Engine) -> dict[str, list]:
    return {str(i): [s.result().output, s.result().finish_reason] for i, s in eng.sequences.items()}


# ---- the processes -------------------------------------------------------------------------


def _worker(rank: int, port: int, world: int, out_dir: str, job: str) -> None:
    """One rank: runs ``job`` and writes what it saw to ``out_dir/rank<r>.json``."""
    report: dict = {}
    try:
        group = join_gloo(rank, port, world)
        model = tiny_model(seed=3, dtype=torch.float32).shard(rank, world, group)
        if job == "equal":
            _equal_job(rank, model, group, report)
        else:
            _diverge_job(rank, model, group, report)
    except BaseException:  # the test reads it
        report["crash"] = traceback.format_exc()
    end_rank(rank, out_dir, report)


def _equal_job(rank: int, model, group, report: dict) -> None:
    for cache, policy in SCENARIOS:
        eng = make_engine(cache, policy, model, group=group, digest_every=2, check_tokens=True)
        if rank == 0:
            drive(eng)
            eng.close()
        else:
            try:
                eng.submit([1, 2, 3])
            except radixkv.Error as e:
                report["refused"] = str(e)
            eng.follow()
        report[f"{cache}/{policy}"] = {
            "outputs": outputs(eng),
            "preemptions": eng.stats.preemptions,
            "evicted": eng.cache.stats.evicted_pages,
            "host": host_traffic(eng),
            "digest": eng.cache.state_digest(),
        }


def _diverge_job(rank: int, model, group, report: dict) -> None:
    report["agreed"] = agree_num_pages(100 + rank, group)
    kv = model.make_kv_cache(radixkv.RadixCache(16 + rank, page_size=4))
    try:  # pools of different sizes are refused on both ranks
        radixkv.Engine(model, kv, group=group)
    except ValueError as e:
        report["unequal"] = str(e)
    eng = make_engine("radix", "lpm", model, group=group, digest_every=1)
    if rank == 1:  # a request outside the engine: rank 1's index now differs
        r = eng.cache.admit(np.arange(9, dtype=np.uint32))
        eng.cache.commit(r, 9)
        eng.cache.finish(r)
    t = time.perf_counter()
    try:
        if rank == 0:
            drive(eng)
        else:
            eng.follow()
    except radixkv.Error as e:
        report["error"] = f"{type(e).__name__}: {e}"
    report["seconds"] = time.perf_counter() - t
    try:  # a broken engine refuses every later call
        eng.step() if rank == 0 else eng.follow()
    except radixkv.Error as e:
        report["again"] = str(e)


def ranks_of(tmp_path: Path, job: str) -> list[dict]:
    """Runs ``job`` on 2 ranks and returns their reports."""
    return run_ranks(_worker, (2, str(tmp_path), job), tmp_path, 2, f"the ranks of job {job!r}")


# ---- tests ---------------------------------------------------------------------------------


def test_ranks_match_one_process_for_every_cache_and_policy(tmp_path):
    torch.set_num_threads(1)
    full = tiny_model(seed=3, dtype=torch.float32)
    rank0, rank1 = ranks_of(tmp_path, "equal")
    assert "rank 0" in rank1["refused"] and "follow" in rank1["refused"]
    for cache, policy in SCENARIOS:
        single = make_engine(cache, policy, full)
        drive(single)
        want = outputs(single)
        # The scenario forces both, and has greedy and sampled requests that generated tokens.
        assert single.stats.preemptions > 0, (cache, policy)
        assert single.cache.stats.evicted_pages > 0, (cache, policy)
        assert "2" not in want  # the cancelled request was released
        assert sum(len(o) for o, _ in want.values()) > 40
        if cache == "radix-host":  # pages went down to the host tier and came back as hits
            offloaded, loaded, hits = host_traffic(single)
            assert offloaded > 0 and loaded > 0 and hits > 0, (cache, policy, offloaded, loaded)
        key = f"{cache}/{policy}"
        for r, rep in enumerate((rank0, rank1)):
            got = rep[key]
            assert got["outputs"] == want, f"rank {r}, {key}"
            assert got["preemptions"] == single.stats.preemptions, f"rank {r}, {key}"
            assert got["evicted"] == single.cache.stats.evicted_pages, f"rank {r}, {key}"
            assert got["host"] == host_traffic(single), f"rank {r}, {key}"
            assert got["digest"] == single.cache.state_digest(), f"rank {r}, {key}"


def test_a_diverging_rank_raises_on_every_rank(tmp_path):
    reports = ranks_of(tmp_path, "diverge")
    for r, rep in enumerate(reports):
        assert "DivergedError" in rep.get("error", ""), f"rank {r}: {rep}"
        assert "cache state digest" in rep["error"], rep["error"]
        assert rep["seconds"] < 30, rep
        assert rep["again"] == rep["error"].split(": ", 1)[1]
        assert rep["agreed"] == 100
        assert "num_pages must be the same on every rank" in rep["unequal"], rep


def test_shard_arguments_are_checked():
    model = tiny_model()
    with pytest.raises(ValueError, match="world_size=3"):
        model.shard(0, 3)
    with pytest.raises(ValueError, match="rank=2"):
        model.shard(2, 2)
    with pytest.raises(ValueError, match="shard already"):
        model.shard(0, 2).shard(0, 1)
    # A shard of one is the model.
    one = model.shard(0, 1)
    tokens = [1, 2, 3, 4]
    assert torch.equal(one.forward_dense(tokens), model.forward_dense(tokens))


def test_group_arguments_are_checked():
    model = tiny_model()
    kv = model.make_kv_cache(radixkv.RadixCache(16, page_size=4))
    with pytest.raises(ValueError, match="digest_every"):
        radixkv.Engine(model, kv, digest_every=-1)
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="init_process_group"):
            radixkv.Engine(model, kv, group=object())
    eng = radixkv.Engine(model, kv)
    with pytest.raises(radixkv.Error, match="ranks other than 0"):
        eng.follow()
    eng.close()  # a no-op without a group
    assert eng.rank == 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
