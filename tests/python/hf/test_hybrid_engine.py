"""Hybrid models served by the engine, exact: for a tiny random model of each of the 8 families
(float32, CPU), ``radixkv.hf.engine``'s greedy tokens equal transformers' ``generate`` on the
whole prompt across sessions re-sent whole, batches that mix prefill and decode, branches,
preemption under a small pool and snapshot eviction under few state slots; a turn re-sent whole
hits the whole previous turn (page 1), a shared prefix is hit in full from the third request on,
and a KV match with no snapshot is recomputed, never restored without its state.
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


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: Any) -> str:
    return request.param


@pytest.fixture
def model(family: str) -> Any:
    return shared(family)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(model: Any, prompt: list[int], n: int = NEW) -> list[int]:
    """transformers' greedy tokens after the whole ``prompt``."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


#: Max |logprob error| of an output token against one forward over the whole sequence: the
#: paths differ by about 1e-5 in the logits (tests/python/hf/test_hybrid_states.py); a state
#: restored wrong is off by 0.035 or more in them.
LOGPROB_TOLERANCE = 1e-3


def check(model: Any, prompt: list[int], r: Any, n: int = NEW) -> None:
    """``r`` (a result with logprobs) holds transformers' greedy tokens after ``prompt``, each
    with the log-probability one forward over the whole sequence gives it."""
    want = generate(model, prompt, n)
    assert r.output == want
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + want[:-1]])).logits[0, len(prompt) - 1 :]
    ref = torch.log_softmax(logits.float(), -1)[torch.arange(n), torch.tensor(want)]
    err = (torch.tensor(r.logprobs) - ref).abs().max().item()
    assert err <= LOGPROB_TOLERANCE, f"max |logprob error| {err:.3g}"


def engine(model: Any, pages: int = 256, state_slots: int = 16, **kw: Any) -> Any:
    page_size = kw.pop("page_size", 1)
    cache = radixkv.RadixCache(pages, page_size=page_size, state_slots=state_slots)
    return radixkv.hf.engine(model, cache, **{"token_budget": 64, **kw})


def test_a_session_resent_whole_hits_where_each_turn_ended(model):
    eng = engine(model)
    prompt = tokens(12, seed=1)
    ended = 0
    for turn in range(3):
        (r,) = eng.generate([prompt], max_new_tokens=NEW, logprobs=True)
        check(model, prompt, r)
        assert r.cached_tokens >= ended, f"turn {turn}: {r.cached_tokens} cached, ended {ended}"
        ended = len(prompt) + NEW - 1  # the last output token's KV is never computed
        prompt = prompt + r.output + tokens(5, seed=10 + turn)
    assert eng.states.restored == 2
    eng.cache.check()


def test_a_batch_mixing_prefill_and_decode_and_branches(model):
    eng = engine(model)
    first = [tokens(8, seed=2), tokens(11, seed=3)]
    ids = [eng.submit(p, max_new_tokens=NEW, logprobs=True) for p in first]
    eng.step()  # both prefilled: the next step decodes them beside a new prefill
    late = tokens(13, seed=4)
    ids.append(eng.submit(late, max_new_tokens=NEW, logprobs=True))
    before = eng.stats.tokens
    eng.step()
    assert eng.stats.tokens - before == 2 + len(late) and eng.stats.max_step_requests == 3
    ctx = tokens(10, seed=5)
    suffixes = [tokens(3, seed=6), tokens(2, seed=7), []]
    branch_ids = eng.branch(ctx, suffixes, max_new_tokens=NEW, logprobs=True)
    eng.run()
    for seq_id, prompt in zip(ids, [*first, late]):
        check(model, prompt, eng.result(seq_id))
    for seq_id, suffix in zip(branch_ids, suffixes):
        r = eng.result(seq_id)
        check(model, ctx + suffix, r)
        # Every branch restores the context's snapshot (at its end, or one token before).
        assert r.cached_tokens == len(ctx) - (0 if suffix else 1)
    eng.cache.check()


def test_preemption_and_snapshot_eviction_keep_tokens_exact(model):
    # 40 pages for 4 requests of 9 + 8 tokens: the newest running one is preempted; 2 state
    # slots for the snapshots of 4 prompts and their ends: most are evicted.
    eng = engine(model, pages=40, state_slots=2, token_budget=32)
    shared = tokens(6, seed=8)
    prompts = [shared + tokens(3, seed=20 + i) for i in range(4)]
    results = eng.generate(prompts, max_new_tokens=8, logprobs=True)
    assert eng.batcher.preemptions > 0
    assert eng.cache.stats.evicted_states > 0
    for prompt, r in zip(prompts, results):
        check(model, prompt, r, 8)
    # Re-sent: hits what survived, exact still.
    again = eng.generate(prompts[:2], max_new_tokens=3, logprobs=True)
    for prompt, r in zip(prompts, again):
        check(model, prompt, r, 3)
    eng.cache.check()


def test_a_shared_prefix_is_hit_in_full_from_the_third_request(model):
    eng = engine(model)
    system = tokens(14, seed=9)
    prompts = [system + tokens(4, seed=30 + i) for i in range(4)]
    got = []
    for prompt in prompts:
        restored = eng.states.restored
        (r,) = eng.generate([prompt], max_new_tokens=NEW, logprobs=True)
        check(model, prompt, r)
        got.append((r.cached_tokens, eng.states.restored - restored))
    # The second request's KV match runs over the system prompt, where no snapshot is: it is
    # recomputed (no state restored), and a snapshot is taken at that junction.
    assert got == [(0, 0), (0, 0), (len(system), 1), (len(system), 1)]
    eng.cache.check()


@pytest.mark.robust
def test_a_forward_that_fails_mid_way_publishes_no_snapshot(model):
    """A forward that raises after some recurrent layers copied their state into a junction
    snapshot leaves that snapshot damaged (part of the layers written): it is never published,
    so the next request sharing the prefix is recomputed, not restored from it."""
    eng = engine(model)
    system = tokens(14, seed=9)
    prompts = [system + tokens(4, seed=50 + i) for i in range(4)]
    (first,) = eng.generate([prompts[0]], max_new_tokens=NEW, logprobs=True)
    check(model, prompts[0], first)

    def fail(*_: Any) -> None:
        raise RuntimeError("injected: the second layer failed")

    # The second request's KV match runs over the system prompt: its forward splits the scan
    # there and copies the first layer's state (recurrent in every family), then the second
    # layer raises before the third (recurrent too) has copied its own.
    hook = model.model.layers[1].register_forward_pre_hook(fail)
    try:
        (failed,) = eng.generate([prompts[1]], max_new_tokens=NEW)
    finally:
        hook.remove()
    assert failed.finish_reason == "error" and "injected" in str(failed.error)
    got = []
    for prompt in prompts[2:]:
        restored = eng.states.restored
        (r,) = eng.generate([prompt], max_new_tokens=NEW, logprobs=True)
        check(model, prompt, r)
        got.append((r.cached_tokens, eng.states.restored - restored))
    # The third request is the failed one's retry in effect: recomputed, its own junction
    # snapshot then serves the fourth.
    assert got == [(0, 0), (len(system), 1)]
    eng.cache.check()


def test_a_host_tier_drops_snapshots_and_stays_exact(model):
    """Pages offloaded to the host tier take the snapshots that need them along (snapshots stay
    on the device): a session whose pages went to the host is recomputed from an earlier
    snapshot or from nothing, its tokens still transformers' own."""
    cache = radixkv.RadixCache(48, page_size=1, host_pages=256, state_slots=16)
    eng = radixkv.hf.engine(model, cache, token_budget=64)
    first = tokens(20, seed=40)
    (r,) = eng.generate([first], max_new_tokens=NEW, logprobs=True)
    check(model, first, r)
    # Another session pushes the first one's last pages to the host (48 pages, 23 + 27 used).
    other = tokens(24, seed=41)
    (o,) = eng.generate([other], max_new_tokens=NEW, logprobs=True)
    check(model, other, o)
    s = eng.cache.stats
    assert s.offloaded_pages > 0 and s.evicted_states > 0
    follow = first + r.output + tokens(4, seed=45)
    (r2,) = eng.generate([follow], max_new_tokens=NEW, logprobs=True)
    check(model, follow, r2)
    # The request-end snapshot went with the offloaded pages; the prompt-end one is restored.
    assert r2.cached_tokens == len(first)
    assert eng.cache.stats.host_hit_tokens == 0
    eng.cache.check()


@pytest.mark.parametrize("family", ["qwen3_5", "jamba"], indirect=True)
def test_a_block_cache_hits_at_page_boundaries(model):
    eng = engine(model, page_size=4)
    prompt = tokens(13, seed=11)  # the prompt ends off a page: its snapshot is at 12
    (r,) = eng.generate([prompt], max_new_tokens=NEW, logprobs=True)
    check(model, prompt, r)
    follow = prompt + r.output + tokens(3, seed=12)
    (r2,) = eng.generate([follow], max_new_tokens=NEW, logprobs=True)
    check(model, follow, r2)
    assert r2.cached_tokens == 16  # the request's end, 13 + 4 - 1 tokens, floored to a page
    eng.cache.check()


@pytest.mark.parametrize("family", ["qwen3_5"], indirect=True)
def test_what_is_not_built_for_hybrids_is_refused_naming_it(model):
    plain = radixkv.RadixCache(64)
    with pytest.raises(ValueError, match=r"state_slots=N .* one takes \d+ bytes"):
        radixkv.hf.engine(model, plain)
    slots = radixkv.RadixCache(64, state_slots=4)
    with pytest.raises(ValueError, match="speculative decoding"):
        spec = {"method": "ngram", "num_speculative_tokens": 2}
        radixkv.hf.engine(model, slots, speculative=spec)
    with pytest.raises(ValueError, match="CUDA graphs"):
        radixkv.hf.engine(model, slots, cuda_graphs=True)
    adapter = radixkv.hf.HFCausalLM(model)  # outside an engine: no states to run on
    kv = radixkv.hf._adapter.make_kv_cache(adapter.spec, slots)
    step = kv.plan([slots.admit([1, 2])])
    with pytest.raises(RuntimeError, match=r"runs inside a radixkv\.Engine"):
        adapter(step)


@pytest.mark.parametrize("family", ["qwen3_5"], indirect=True)
def test_a_shared_tier_is_refused_for_hybrids(model, tmp_path):
    """A shared tier's pages travel without the snapshots a hit needs: refused, naming it."""
    from redis_server import RedisServer

    server = RedisServer(tmp_path, unix=True)
    try:
        cache = radixkv.RadixCache(64, state_slots=4)
        with pytest.raises(ValueError, match=r"hybrid model: .* a shared tier"):
            radixkv.hf.engine(model, cache, shared_store=server.url)
    finally:
        server.stop()
