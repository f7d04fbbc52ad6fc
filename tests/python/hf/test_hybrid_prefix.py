"""radixkv.hf.PrefixCache on hybrid models, exact: for a tiny random model of each of the 8
families (float32, CPU), ``PrefixCache.generate`` returns the tokens of transformers' plain
``generate`` and its scores within 1e-3, across a chat re-sent whole (each turn hits where the
previous one ended), a shared prefix (hit in full from the third request), a small
``state_slots`` that evicts snapshots, aborts and a failing ``generate``, the step-by-step
``lookup`` / ``generate`` / ``store``, and a KVCache shared with ``radixkv.hf.engine``.
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
#: Max |score error| of a generated token against plain ``generate``: the paths differ by about
#: 1e-5 (tests/python/hf/test_hybrid_states.py); a state restored wrong is off by 0.035 or more.
TOLERANCE = 1e-3
GREEDY = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: Any) -> str:
    return request.param


@pytest.fixture
def model(family: str) -> Any:
    return shared(family)


def tokens(n: int, seed: int) -> torch.Tensor:
    """``[1, n]`` random token ids."""
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def prefix_cache(model: Any, pages: int = 256, state_slots: int = 16, **kw: Any) -> Any:
    cache = radixkv.RadixCache(pages, state_slots=state_slots, **kw)
    return radixkv.hf.PrefixCache(model, cache)


def check(model: Any, prompt: torch.Tensor, out: Any, n: int = NEW) -> None:
    """``out`` (``generate``'s return with scores) holds plain ``generate``'s tokens after
    ``prompt``, each step's scores within :data:`TOLERANCE` of its."""
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=n, **GREEDY)
    assert out.sequences.tolist() == want.sequences.tolist()
    err = max((a - b).abs().max().item() for a, b in zip(out.scores, want.scores, strict=True))
    assert err <= TOLERANCE, f"max |score error| {err:.3g}"


def test_a_chat_resent_whole_hits_where_each_turn_ended(model):
    prefix = prefix_cache(model)
    prompt = tokens(12, seed=1)
    ended = 0
    for turn in range(3):
        out = prefix.generate(prompt, max_new_tokens=NEW, **GREEDY)
        check(model, prompt, out)
        assert prefix.last_cached >= ended, f"turn {turn}: {prefix.last_cached}, ended {ended}"
        ended = out.sequences.shape[1] - 1  # the last output token's K/V is never computed
        prompt = torch.cat([out.sequences, tokens(5, seed=10 + turn)], dim=1)
    assert prefix.states.restored == 2
    assert prefix.num_open == 0
    prefix.cache.check()


def test_a_prompt_extended_hits_the_prompts_end_and_a_retry_all_but_its_last_token(model):
    prefix = prefix_cache(model)
    prompt = tokens(10, seed=2)
    check(model, prompt, prefix.generate(prompt, max_new_tokens=NEW, **GREEDY))
    # The same prompt again: everything but its last token (at least one is computed).
    check(model, prompt, prefix.generate(prompt, max_new_tokens=NEW, **GREEDY))
    assert prefix.last_cached == prompt.shape[1] - 1
    # The prompt with another continuation than the reply: the prompt's end, in full.
    longer = torch.cat([prompt, tokens(3, seed=3)], dim=1)
    check(model, longer, prefix.generate(longer, max_new_tokens=NEW, **GREEDY))
    assert prefix.last_cached == prompt.shape[1]
    prefix.cache.check()


def test_a_shared_prefix_is_hit_in_full_from_the_third_request(model):
    prefix = prefix_cache(model)
    system = tokens(14, seed=4)
    got = []
    for i in range(4):
        prompt = torch.cat([system, torch.tensor([[i]]), tokens(3, seed=30 + i)], dim=1)
        restored = prefix.states.restored
        check(model, prompt, prefix.generate(prompt, max_new_tokens=NEW, **GREEDY))
        got.append((prefix.last_cached, prefix.states.restored - restored))
    # The second request's K/V match runs over the system prompt, where no snapshot is: it is
    # recomputed (no state restored), and a snapshot is taken at that junction.
    assert got == [(0, 0), (0, 0), (system.shape[1], 1), (system.shape[1], 1)]
    prefix.cache.check()


def test_few_state_slots_evict_snapshots_and_stay_exact(model):
    prefix = prefix_cache(model, state_slots=2)
    shared = tokens(6, seed=5)
    prompts = [torch.cat([shared, tokens(3, seed=20 + i)], dim=1) for i in range(4)]
    for prompt in prompts:
        check(model, prompt, prefix.generate(prompt, max_new_tokens=NEW, **GREEDY))
    assert prefix.cache.stats.evicted_states > 0
    # Re-sent with more tokens: hits what survived (or nothing), exact still.
    hits = []
    for i, prompt in enumerate(prompts):
        follow = torch.cat([prompt, tokens(2, seed=40 + i)], dim=1)
        check(model, follow, prefix.generate(follow, max_new_tokens=NEW, **GREEDY))
        hits.append(prefix.last_cached)
    assert any(hits), hits
    assert prefix.cache.stats.state_slots == 2
    prefix.cache.check()


def test_lookup_generate_store_step_by_step(model):
    """The caller's own ``generate`` over what ``lookup`` gives: the rest of the prompt is
    computed by ``lookup`` (exact for Bamba's and Jamba's modules too), ``generate`` continues."""
    prefix = prefix_cache(model)
    prompt = tokens(11, seed=6)
    for turn in range(2):
        past = prefix.lookup(prompt)
        assert past.get_seq_length() == prompt.shape[1] - 1
        out = model.generate(
            prompt, **{prefix.spec.cache_kwarg: past}, max_new_tokens=NEW, **GREEDY
        )
        check(model, prompt, out)
        assert prefix.store(past, out) == out.sequences.shape[1] - 1
        assert prefix.last_cached == (0 if turn == 0 else prompt.shape[1] - 3 - 1)
        prompt = torch.cat([out.sequences, tokens(3, seed=50)], dim=1)
    prefix.cache.check()


def test_abort_and_a_failing_generate_publish_nothing(model):
    prefix = prefix_cache(model)
    prompt = tokens(9, seed=7)
    past = prefix.lookup(prompt)  # computes the prompt but its last token, takes a snapshot
    prefix.abort(past)
    s = prefix.cache.stats
    assert (s.state_free_slots, s.evictable_pages, prefix.num_open) == (s.state_slots, 0, 0)

    class Boom(transformers.LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        prefix.generate(prompt, max_new_tokens=NEW, logits_processor=[Boom()], **GREEDY)
    s = prefix.cache.stats
    assert (s.state_free_slots, s.evictable_pages, prefix.num_open) == (s.state_slots, 0, 0)
    check(model, prompt, prefix.generate(prompt, max_new_tokens=NEW, **GREEDY))
    prefix.cache.check()


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"], indirect=True)
def test_a_store_that_keeps_the_prompt_alone_snapshots_no_state_past_it(model):
    """The pool has no pages for the output: the prompt alone is stored, and the state
    ``generate`` ended with (past the prompt) is not kept as the prompt's."""
    prompt = tokens(10, seed=8)
    prefix = prefix_cache(model, pages=prompt.shape[1] + 4)
    past = prefix.lookup(prompt)
    out = model.generate(prompt, **{prefix.spec.cache_kwarg: past}, max_new_tokens=8, **GREEDY)
    assert prefix.store(past, out) == prompt.shape[1]
    longer = torch.cat([prompt, tokens(4, seed=9)], dim=1)
    check(model, longer, prefix.generate(longer, max_new_tokens=NEW, **GREEDY))
    assert prefix.last_cached == prompt.shape[1] - 1  # lookup's snapshot, not the end's
    prefix.cache.check()


@pytest.mark.parametrize("family", ["qwen3_5", "jamba"], indirect=True)
def test_snapshots_at_page_boundaries(model):
    prefix = prefix_cache(model, page_size=4)
    prompt = tokens(13, seed=11)  # the prompt ends off a page: its snapshot is at 12
    out = prefix.generate(prompt, max_new_tokens=NEW, **GREEDY)
    check(model, prompt, out)
    follow = torch.cat([out.sequences, tokens(3, seed=12)], dim=1)
    check(model, follow, prefix.generate(follow, max_new_tokens=NEW, **GREEDY))
    assert prefix.last_cached == 16  # the end, 13 + 4 - 1 tokens, floored to a page
    prefix.cache.check()


def test_a_kv_cache_shared_with_an_engine_shares_its_snapshots(model):
    prefix = prefix_cache(model)
    eng = radixkv.hf.engine(model, prefix.kv, token_budget=64)
    assert eng.states.snapshots is prefix.states.snapshots
    prompt = tokens(12, seed=13)
    (r,) = eng.generate([prompt[0].tolist()], max_new_tokens=NEW)
    turn2 = torch.cat([prompt, torch.tensor([r.output]), tokens(3, seed=14)], dim=1)
    check(model, turn2, prefix.generate(turn2, max_new_tokens=NEW, **GREEDY))
    assert prefix.last_cached == prompt.shape[1] + NEW - 1  # the engine's request end
    out = prefix.generate(turn2, max_new_tokens=NEW, **GREEDY)
    turn3 = torch.cat([out.sequences, tokens(3, seed=15)], dim=1)
    (r3,) = eng.generate([turn3[0].tolist()], max_new_tokens=NEW)
    assert r3.cached_tokens == out.sequences.shape[1] - 1  # the PrefixCache's end
    assert torch.equal(
        torch.tensor(r3.output),
        model.generate(turn3, max_new_tokens=NEW, do_sample=False)[0, turn3.shape[1] :],
    )
    prefix.cache.check()


@pytest.mark.parametrize("family", ["qwen3_5"], indirect=True)
def test_what_a_hybrid_prefix_cache_cannot_use_is_refused_naming_it(model):
    with pytest.raises(ValueError, match=r"state_slots=N .* one takes \d+ bytes"):
        radixkv.hf.PrefixCache(model, radixkv.RadixCache(64))
    prefix = prefix_cache(model, pages=64, state_slots=4)
    with pytest.raises(ValueError, match=r"snapshots are held in the states' own dtypes"):
        radixkv.hf.engine(model, prefix.kv, snapshot_dtype=torch.bfloat16)


def test_a_host_tier_drops_snapshots_and_stays_exact(model):
    """Pages offloaded to the host tier take the snapshots that need them along (snapshots stay
    on the device): a conversation whose pages went to the host is recomputed from an earlier
    snapshot still on the device, its tokens still plain generate's."""
    prefix = prefix_cache(model, pages=48, host_pages=256)
    first = tokens(20, seed=16)
    out = prefix.generate(first, max_new_tokens=NEW, **GREEDY)
    check(model, first, out)
    other = tokens(24, seed=17)  # 23 + 27 pages of 48: the first one's last pages go to the host
    check(model, other, prefix.generate(other, max_new_tokens=NEW, **GREEDY))
    s = prefix.cache.stats
    assert s.offloaded_pages > 0 and s.evicted_states > 0
    follow = torch.cat([out.sequences, tokens(4, seed=18)], dim=1)
    check(model, follow, prefix.generate(follow, max_new_tokens=NEW, **GREEDY))
    # The end's snapshot went with the offloaded pages; the prompt's end is restored.
    assert prefix.last_cached == first.shape[1]
    assert prefix.cache.stats.host_hit_tokens == 0
    prefix.cache.check()
