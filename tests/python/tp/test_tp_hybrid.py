"""Hybrid models under tensor parallelism: 2 processes over gloo on CPU, each loading a tiny
hybrid checkpoint of every family radixkv serves with ``from_pretrained(..., tp_plan="auto")``
and running ``radixkv.hf.engine`` over it in lockstep (``digest_every=1``: the index's state
slots and the engine's working slots compared before every step; ``check_tokens=True``).

transformers' plans keep the recurrent modules whole on every rank (Qwen3.5's and Qwen3-Next's
Gated DeltaNet projections gather their outputs; the Mamba, Mamba2 and short-convolution modules
are not in the plans), so each rank's state pools hold whole states; the attention heads are
split where the plan splits them and whole where it does not (LFM2, Falcon-H1). For each family
rank 0 drives a three-turn session re-sent whole and a batch preempted under a small pool with
2 state slots (snapshots evicted); both ranks' greedy tokens, hits and snapshot counters must
equal one process's engine over the unsharded model, the tokens transformers' ``generate`` and
rank 0's log-probabilities one forward's. A recurrent module split among the ranks is refused.
And ``radixkv serve --tensor-parallel-size 2`` serves a hybrid checkpoint.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5TextConfig"):  # requirements allow transformers 4.x
    pytest.skip(
        f"the hybrid families need transformers 5.x, found {transformers.__version__}",
        allow_module_level=True,
    )

import radixkv  # noqa: E402
import radixkv.hf  # noqa: E402
from hf_models import save_model  # noqa: E402
from ranks import end_rank, run_ranks  # noqa: E402
from tiny_hybrid import VOCAB, build  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not torch.distributed.is_available(), reason="torch.distributed is not available"
    ),
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("accelerate") is None,
        reason="transformers' tp_plan needs accelerate (pip install accelerate)",
    ),
]

WORLD = 2
#: Attention KV heads each rank holds, by family (every family radixkv serves): 2 in the
#: config, split by the plans that split them (LFM2's and Falcon-H1's keep the attention whole).
KV_HEADS = {
    "qwen3_5": 1,
    "qwen3_next": 1,
    "lfm2": 2,
    "granitemoehybrid": 1,
    "nemotron_h": 1,
    "falcon_h1": 2,
    "bamba": 1,
    "jamba": 1,
}
FAMILIES = tuple(KV_HEADS)
NEW = 4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def result(prompt: list[int], r: Any) -> dict[str, Any]:
    return {"prompt": prompt, "output": r.output, "cached": r.cached_tokens, "lp": r.logprobs}


def session(eng: radixkv.Engine) -> list[dict[str, Any]]:
    """A three-turn session re-sent whole (each turn the whole history plus new tokens)."""
    prompt = tokens(12, seed=1)
    out = []
    for turn in range(3):
        (r,) = eng.generate([prompt], max_new_tokens=NEW, logprobs=True)
        out.append(result(prompt, r))
        prompt = prompt + r.output + tokens(5, seed=10 + turn)
    return out


def preempted(eng: radixkv.Engine) -> list[dict[str, Any]]:
    """Four requests sharing a prefix on a pool too small for them all (one is preempted) and
    2 state slots (snapshots evicted)."""
    shared = tokens(6, seed=8)
    prompts = [shared + tokens(3, seed=20 + i) for i in range(4)]
    results = eng.generate(prompts, max_new_tokens=8, logprobs=True)
    return [result(p, r) for p, r in zip(prompts, results)]


SCENARIOS = {
    "session": (lambda: radixkv.RadixCache(256, page_size=1, state_slots=16), session),
    "preempted": (lambda: radixkv.RadixCache(40, page_size=1, state_slots=2), preempted),
}


def make_engine(model: Any, scenario: str, **kw: Any) -> radixkv.Engine:
    return radixkv.hf.engine(model, SCENARIOS[scenario][0](), token_budget=32, **kw)


def counters(eng: radixkv.Engine) -> dict[str, int]:
    assert eng.states is not None
    s = eng.cache.stats
    return {
        "restored": eng.states.restored,
        "taken": eng.states.taken,
        "evicted_states": s.evicted_states,
        "preemptions": eng.batcher.preemptions,
        "digest": eng.cache.state_digest(),
    }


# ---- the processes -------------------------------------------------------------------------


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One rank: every family's checkpoint loaded with tp_plan="auto", every scenario run
    (rank 0 drives, rank 1 follows); writes what it saw to ``out_dir/rank<r>.json``."""
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    report: dict[str, Any] = {}
    try:
        for family in FAMILIES:
            with warnings.catch_warnings():  # tp_plan= is deprecated for distributed_config=
                warnings.simplefilter("ignore", FutureWarning)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    Path(out_dir, family), dtype=torch.float32, tp_plan="auto"
                ).eval()
            for scenario, (_, drive) in SCENARIOS.items():
                eng = make_engine(model, scenario, digest_every=1, check_tokens=True)
                rep: dict[str, Any] = {"kv_heads": eng.kv.num_kv_heads}
                rep["world"] = eng.lockstep.world_size if eng.lockstep else 1
                rep["snapshot_bytes"] = eng.states.snapshots.bytes_per_slot
                if rank == 0:
                    rep["results"] = drive(eng)
                    eng.close()
                else:
                    eng.follow()
                    # What each sequence produced and hit here, in rank 0's order.
                    rep["results"] = [
                        {"output": s.output, "cached": s.cached_tokens}
                        for s in eng.sequences.values()
                    ]
                rep.update(counters(eng))
                eng.cache.check()
                report[f"{family}/{scenario}"] = rep
            if family == "qwen3_5":
                report["sharded_conv"] = sharded_conv_refusal(model)
    except BaseException:  # the test reads it
        report["crash"] = traceback.format_exc()
    end_rank(rank, out_dir, report)


def sharded_conv_refusal(model: Any) -> str:
    """What ``radixkv.hf.engine`` says of the tensor-parallel ``model`` (a Qwen3.5) once its
    first Gated DeltaNet convolution is split among the ranks (a plan that would shard a
    recurrent state, which no transformers plan does)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    conv = model.model.layers[0].linear_attn.conv1d
    mesh = model.model.layers[3].self_attn.k_proj.weight.device_mesh
    split = distribute_tensor(conv.weight.data, mesh, [Shard(0)])
    conv.weight = torch.nn.Parameter(split, requires_grad=False)
    try:
        radixkv.hf.engine(model, radixkv.RadixCache(64, state_slots=4))
    except ValueError as e:
        return str(e)
    return "not refused"


def generate(model: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens after the whole ``prompt``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


#: Max |logprob error| against one process and against one forward over the whole sequence
#: (the sharded sums and the per-request scans differ by about 1e-5 in the logits).
LOGPROB_TOLERANCE = 1e-3


def forward_logprobs(model: Any, prompt: list[int], output: list[int]) -> list[float]:
    """The log-probability of each of ``output``'s tokens after ``prompt`` in one forward of
    ``model`` over the whole sequence."""
    with torch.no_grad():
        ids = torch.tensor([prompt + output[:-1]])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :]
    lp = torch.log_softmax(logits.float(), -1)
    return lp[torch.arange(len(output)), torch.tensor(output)].tolist()


def max_error(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_hybrid_ranks_match_one_process_and_generate(tmp_path):
    torch.set_num_threads(1)
    models = {family: build(family) for family in FAMILIES}
    for family, model in models.items():
        save_model(model, tmp_path / family)
    reports = run_ranks(_worker, (str(tmp_path),), tmp_path, WORLD, "the hybrid ranks")
    for rep in reports:
        assert "splits the recurrent module of layer 0" in rep["sharded_conv"], rep["sharded_conv"]

    for family, model in models.items():
        for scenario in SCENARIOS:
            key = f"{family}/{scenario}"
            single = make_engine(model, scenario)
            want = SCENARIOS[scenario][1](single)
            mine = counters(single)
            for r, rep in enumerate(reports):
                got = rep[key]
                assert got["world"] == WORLD and got["kv_heads"] == KV_HEADS[family], (key, r)
                # Whole states on every rank: a snapshot is as large as one process's.
                assert got["snapshot_bytes"] == single.states.snapshots.bytes_per_slot, (key, r)
                outs = [(x["output"], x["cached"]) for x in got["results"]]
                assert outs == [(x["output"], x["cached"]) for x in want], (key, r)
                assert {k: got[k] for k in mine} == mine, (key, r)
            for x in want:  # transformers' own greedy decoding of the unsharded model
                assert x["output"] == generate(model, x["prompt"], len(x["output"])), key
            # Rank 0's log-probabilities: one process's, and one forward's over the whole
            # sequence (a state restored wrong on either rank moves them by 0.01 or more).
            for x, y in zip(reports[0][key]["results"], want):
                ref = forward_logprobs(model, x["prompt"], x["output"])
                assert max_error(x["lp"], y["lp"]) <= LOGPROB_TOLERANCE, key
                assert max_error(x["lp"], ref) <= LOGPROB_TOLERANCE, key
        # The scenarios did what they are for: hits restored, preemption, snapshots evicted.
        turns = reports[0][f"{family}/session"]["results"]
        assert turns[0]["cached"] == 0, family
        for before, turn in itertools.pairwise(turns):  # the previous turn's end, at least
            assert turn["cached"] >= len(before["prompt"]) + NEW - 1, (family, turns)
        assert reports[0][f"{family}/session"]["restored"] == 2, family
        pre = reports[0][f"{family}/preempted"]
        assert pre["preemptions"] > 0 and pre["evicted_states"] > 0, (family, pre)


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("fastapi") is None, reason="needs radixkv[serve]"
)
def test_serve_tp_serves_a_hybrid_checkpoint(tmp_path):
    """``radixkv serve --tensor-parallel-size 2 --model DIR`` on a tiny Qwen3.5 over SmolLM2's
    vocabulary: replies equal transformers' greedy text, a turn re-sent whole hits the previous
    one, and SIGTERM closes both ranks."""
    import httpx

    import serve_process
    from hf_models import greedy_reference, smollm2_tokenizer

    tok = smollm2_tokenizer()
    model = build("qwen3_5", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    port = serve_process.free_port()
    options = ["--tensor-parallel-size", "2", "--num-pages", "256", "--max-state-slots", "8"]
    proc = serve_process.start(
        port, "--model", str(tmp_path / "ckpt"), *options, timeout=180, new_session=True
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        name = httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]

        def complete(prompt: list[int]) -> tuple[list[int], int]:
            """transformers' greedy tokens after ``prompt`` (checked against the reply's text
            and log-probabilities) and the reply's cached tokens."""
            body = {"model": name, "prompt": prompt, "max_tokens": 5, "temperature": 0}
            body["logprobs"] = 1
            r = httpx.post(f"{url}/completions", json=body, timeout=60).json()
            want = greedy_reference(model, prompt, 5)
            got = r["choices"][0]["logprobs"]["token_logprobs"]
            assert max_error(got, forward_logprobs(model, prompt, want)) <= LOGPROB_TOLERANCE
            assert r["choices"][0]["text"] == tok.decode(want)
            return want, r["usage"]["prompt_tokens_details"]["cached_tokens"]

        prompt = list(range(100, 130))
        first, cached = complete(prompt)
        assert cached == 0
        _, cached = complete(prompt + first + list(range(200, 210)))
        assert cached == len(prompt) + len(first) - 1  # where the first turn ended
        rc, err = serve_process.stop(proc)
        assert rc == 0, err[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_serve_checks_heads_only_where_the_plan_splits_them(tmp_path):
    """``radixkv serve -tp 3`` checks before any rank starts that the heads divide among the
    ranks: refused for a Qwen3.5 (its plan splits 4 heads and 2 KV heads), not for an LFM2 with
    the same heads (its plan keeps the attention whole on every rank)."""
    from radixkv.apps.common.args import UsageError
    from radixkv.apps.serve import ranks

    for family in ("qwen3_5", "lfm2"):
        build(family, device="meta").config.save_pretrained(tmp_path / family)

    def check(family: str) -> None:
        args = argparse.Namespace(model=str(tmp_path / family), tensor_parallel_size=3)
        ranks.check_model(args)

    with pytest.raises(UsageError, match="4 attention heads and 2 KV heads"):
        check("qwen3_5")
    check("lfm2")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
