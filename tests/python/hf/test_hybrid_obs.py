"""What a hybrid engine tells the outside: its stats' state counters and ``/metrics``, and how
exact it stays with bf16 snapshots of fp32 states (tiny random models of the 8 families, CPU).
"""

from __future__ import annotations

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
from tiny_hybrid import FAMILIES, VOCAB, shared  # noqa: E402

NEW = 4

#: Max |logprob error| of an output token with bf16 snapshots of fp32 states, against one fp32
#: forward over the whole sequence. Measured (benches/bench_snapshot_dtype.py: 2 sessions of 4
#: turns, 8 tokens a turn) at most 1.3e-3 over the 8 families (Qwen3-Next; LFM2 and Falcon-H1
#: below 3e-5), against 3e-6 with fp32 snapshots. 3x the measured worst: snapshots rounded
#: through fp8 instead fail this test for Qwen3.5, Qwen3-Next and GraniteMoeHybrid (5.9e-3 to
#: 2.8e-2; greedy tokens stay equal, which is why the logprobs are checked).
BF16_LOGPROB_TOLERANCE = 4e-3


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model: Any, pages: int = 256, state_slots: int = 16, **kw: Any) -> Any:
    cache = radixkv.RadixCache(pages, page_size=1, state_slots=state_slots)
    return radixkv.hf.engine(model, cache, **{"token_budget": 64, **kw})


def logprob_error(model: Any, prompt: list[int], r: Any) -> float:
    """Max |error| of ``r``'s logprobs against one forward over ``prompt`` and its tokens."""
    with torch.no_grad():
        seq = torch.tensor([prompt + r.output[:-1]])
        logits = model(input_ids=seq).logits[0, len(prompt) - 1 :].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(len(r.output)), torch.tensor(r.output)]
    return (torch.tensor(r.logprobs) - ref).abs().max().item()


def generate(model: Any, prompt: list[int], n: int = NEW) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_snapshots_keep_generates_tokens_with_a_bounded_logprob_error(family):
    """``snapshot_dtype=torch.bfloat16`` on an fp32 model: a 3-turn session re-sent whole
    restores a bf16 snapshot every turn after the first; its greedy tokens equal ``generate``'s
    and its logprobs stay within ``BF16_LOGPROB_TOLERANCE`` of an fp32 forward."""
    model = shared(family)
    eng = engine(model, snapshot_dtype=torch.bfloat16)
    spec = eng.states.specs[0]
    assert eng.states.snapshots.tensor(spec.layer, spec.name).dtype == torch.bfloat16
    assert eng.states.working.tensor(spec.layer, spec.name).dtype == torch.float32
    prompt = tokens(12, seed=31)
    errors = []
    for turn in range(3):
        (r,) = eng.generate([prompt], max_new_tokens=NEW, logprobs=True)
        assert r.output == generate(model, prompt), f"turn {turn}"
        errors.append(logprob_error(model, prompt, r))
        prompt = prompt + r.output + tokens(5, seed=40 + turn)
    assert eng.states.restored == 2, "turns 2 and 3 restore a snapshot"
    assert max(errors) <= BF16_LOGPROB_TOLERANCE, f"max |logprob error| {max(errors):.3g}"
    eng.cache.check()


def test_engine_stats_and_metrics_count_restored_taken_and_evicted_snapshots():
    """``engine.stats.state_*``: restored snapshots and the prompt tokens their hits covered,
    snapshots taken, and evicted ones (2 slots for 3 sessions: many are); ``/metrics`` says the
    restored count beside the cache's own state families."""
    pytest.importorskip("prometheus_client")
    from radixkv.metrics import CacheCollector

    eng = engine(shared("qwen3_5"), state_slots=2)
    collector = CacheCollector(eng.cache, engine=eng)
    prompts = [tokens(9, seed=50 + s) for s in range(3)]
    hits = []
    # Two turns of each session in a row (the second hits the first's end), then a third
    # turn of each after the others took the slots.
    for s in [0, 0, 1, 1, 2, 2, 0, 1, 2]:
        (r,) = eng.generate([prompts[s]], max_new_tokens=NEW)
        hits.append(r.cached_tokens)
        prompts[s] = prompts[s] + r.output + tokens(3, seed=60 + len(hits))
    st, cs = eng.stats, eng.cache.stats
    assert st.state_restored == eng.states.restored == sum(1 for h in hits if h)
    assert st.state_restored > 0, "some turn restored a snapshot"
    assert st.state_hit_tokens == sum(hits) == cs.state_hit_tokens
    assert st.state_taken == eng.states.taken == cs.taken_states
    assert st.state_evicted == cs.evicted_states > 0
    fams = {f.name: f for f in collector.collect()}

    def total(name: str) -> float:
        (value,) = [s.value for s in fams[name].samples if s.name.endswith("_total")]
        return value

    assert total("radixkv_restored_states") == st.state_restored
    assert total("radixkv_taken_states") == st.state_taken
    assert total("radixkv_evicted_states") == st.state_evicted
    assert total("radixkv_prefix_cache_state_hit_tokens") == st.state_hit_tokens


def test_no_state_families_for_an_engine_without_states():
    pytest.importorskip("prometheus_client")
    from radixkv.metrics import CacheCollector

    eng = radixkv.hf.engine(
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
            )
        ).eval(),
        radixkv.RadixCache(32, page_size=1),
    )
    eng.generate([[1, 2, 3]], max_new_tokens=1)
    names = {f.name for f in CacheCollector(eng.cache, engine=eng).collect()}
    assert "radixkv_restored_states" not in names and "radixkv_engine_requests" in names
    assert (eng.stats.state_restored, eng.stats.state_taken) == (0, 0)
