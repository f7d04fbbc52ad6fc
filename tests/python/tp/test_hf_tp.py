"""radixkv.hf.engine over a transformers model loaded with ``from_pretrained(..., tp_plan="auto")``:
2 processes on CPU, transformers initialising gloo itself from the RANK / WORLD_SIZE /
MASTER_ADDR environment and sharding the heads (column-parallel q/k/v, row-parallel o). Rank 0
drives a multi-turn session, branches and greedy and sampled requests, rank 1 follows; what
rank 0 and rank 1 produce must equal a single-process ``radixkv.hf.engine`` over the unsharded
model, and the greedy requests transformers' own ``generate`` on it, for both caches. Models
whose KV heads do not divide among the ranks, and groups of other ranks, are refused.

The process harness is ``test_tp.py``'s: one pair of processes for all scenarios, reports
written as JSON, ``os._exit`` after a barrier, a watchdog.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import radixkv
import radixkv.hf
from hf_models import VOCAB, build_model, greedy_reference, save_model
from ranks import end_rank, run_ranks

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available(), reason="torch.distributed is not available"
    ),
    # transformers' tensor parallelism places the model through accelerate (a device_map), on
    # CPU too: without it from_pretrained(tp_plan=...) raises "requires `accelerate`".
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("accelerate") is None,
        reason="transformers' tp_plan needs accelerate (pip install accelerate)",
    ),
]

WORLD = 2
CACHES = {
    "radix-p1": lambda: radixkv.RadixCache(160, page_size=1),
    "block-p16": lambda: radixkv.BlockCache(10, page_size=16),
}


def make_engine(model, cache: str, **kw) -> radixkv.Engine:
    return radixkv.hf.engine(model, CACHES[cache](), token_budget=32, max_batch=4, **kw)


def drive(eng: radixkv.Engine) -> None:
    """Rank 0's (and the single process's) calls: a three-turn session, branches from it, and
    greedy and seeded sampled requests arriving between steps."""
    rng = np.random.default_rng(11)
    session = radixkv.Session(eng, system=rng.integers(0, VOCAB, 19))
    for n in (6, 3):
        session.send(rng.integers(0, VOCAB, n), max_new_tokens=5)
    eng.submit(session.history[:23], max_new_tokens=6, temperature=0.9, seed=4)
    eng.submit(rng.integers(0, VOCAB, 17), max_new_tokens=7)
    eng.step()
    session.send(rng.integers(0, VOCAB, 4), max_new_tokens=4, temperature=0.7, seed=8)
    session.branch([rng.integers(0, VOCAB, 2), []], max_new_tokens=3)
    eng.run()


def outputs(eng: radixkv.Engine) -> dict[str, list]:
    return {str(i): [s.output, s.finish_reason] for i, s in eng.sequences.items()}


# ---- the processes -------------------------------------------------------------------------


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: loads both checkpoints with tp_plan="auto" and writes what it saw to
    ``out_dir/rank<r>.json``."""
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    report: dict = {}
    try:
        import transformers

        def load(name: str):
            with warnings.catch_warnings():  # tp_plan= is deprecated for distributed_config=
                warnings.simplefilter("ignore", FutureWarning)
                return transformers.AutoModelForCausalLM.from_pretrained(
                    Path(out_dir, name), dtype=torch.float32, tp_plan="auto"
                ).eval()

        model = load("gqa")  # initialises torch.distributed (gloo on CPU)
        report["backend"] = str(torch.distributed.get_backend())
        report["tp_size"] = model.tp_size
        q = model.model.layers[0].self_attn.q_proj.weight
        report["q_proj_local_rows"] = q.to_local().shape[0]
        for cache in CACHES:
            # The group transformers sharded over by default, or the same ranks given.
            given = {"group": torch.distributed.group.WORLD} if cache == "block-p16" else {}
            eng = make_engine(model, cache, digest_every=1, check_tokens=True, **given)
            report[f"{cache}/world"] = eng.lockstep.world_size
            report[f"{cache}/kv_heads"] = eng.kv.num_kv_heads
            if rank == 0:
                drive(eng)
                eng.close()
            else:
                eng.follow()
            report[cache] = {"outputs": outputs(eng), "digest": eng.cache.state_digest()}
        # A group of one rank (rank 1 is outside it) is refused on both ranks, before any
        # collective.
        one = torch.distributed.new_group([0])
        try:
            make_engine(model, "radix-p1", group=one)
        except ValueError as e:
            report["other_group"] = str(e)
        # PrefixCache is for one process: refused, naming the engine to use instead.
        try:
            radixkv.hf.PrefixCache(model, radixkv.RadixCache(64))
        except ValueError as e:
            report["prefix_cache"] = str(e)
        # One KV head over two ranks: transformers splits it, radixkv refuses it.
        try:
            make_engine(load("mqa"), "radix-p1")
        except ValueError as e:
            report["mqa"] = str(e)
    except BaseException:  # the test reads it
        report["crash"] = traceback.format_exc()
    end_rank(rank, out_dir, report)


def test_tp_plan_auto_ranks_match_one_process_and_transformers_generate(tmp_path):
    torch.set_num_threads(1)
    full = build_model("llama", seed=5)  # 4 query heads over 2 KV heads
    save_model(full, tmp_path / "gqa")
    save_model(build_model("llama", seed=6, num_key_value_heads=1), tmp_path / "mqa")
    reports = run_ranks(_worker, (str(tmp_path),), tmp_path, WORLD, "the tensor-parallel ranks")

    for r, rep in enumerate(reports):
        assert rep["backend"] == "gloo" and rep["tp_size"] == WORLD, rep
        assert rep["q_proj_local_rows"] == 2 * 16, rep  # 2 of the 4 query heads on each rank
        assert "tp_size=2" in rep["other_group"], f"rank {r}: {rep['other_group']}"
        assert ("group has 1 ranks" if r == 0 else "not in group") in rep["other_group"]
        assert "num_key_value_heads=1" in rep["mqa"] and "2 ranks" in rep["mqa"], rep["mqa"]
        assert "tp_size=2" in rep["prefix_cache"] and "hf.engine" in rep["prefix_cache"], rep

    for cache in CACHES:
        single = make_engine(full, cache)
        assert single.kv.num_kv_heads == 2
        drive(single)
        want = outputs(single)
        for r, rep in enumerate(reports):
            assert rep[f"{cache}/kv_heads"] == 1, f"rank {r}"  # its own KV head
            assert rep[f"{cache}/world"] == WORLD, f"rank {r}"
            assert rep[cache]["outputs"] == want, f"rank {r}, {cache}"
            assert rep[cache]["digest"] == single.cache.state_digest(), f"rank {r}, {cache}"
        # The scenario generated tokens, greedy and sampled, and reused cached prefixes.
        seqs = list(single.sequences.values())
        sampled = [s for s in seqs if s.temperature > 0 and s.output]
        greedy = [s for s in seqs if s.temperature == 0 and s.max_new_tokens > 0]
        assert len(sampled) == 2 and len(greedy) >= 5, cache
        assert sum(s.cached_tokens for s in seqs) > 50, cache
        for s in greedy:  # transformers' own greedy decoding of the unsharded model
            assert s.output == greedy_reference(full, s.prompt, s.max_new_tokens), (cache, s.id)


def test_group_of_a_model_that_is_not_tensor_parallel_is_passed_through():
    """An unsharded model keeps the engine's own rules: no group by default, and group= is not
    checked against a tensor-parallel degree it does not have."""
    model = build_model("llama", seed=5)
    assert radixkv.hf.HFCausalLM(model).spec.tp_size == 1
    eng = make_engine(model, "radix-p1")
    assert eng.lockstep is None and eng.kv.num_kv_heads == 2
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="init_process_group"):
            make_engine(model, "radix-p1", group=object())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
