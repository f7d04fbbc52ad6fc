"""radixkv.hf.PrefixCache: generate() with prefix reuse returns what plain generate() returns,
turn after turn and across branches, with later calls served from the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import radixkv
import radixkv.hf
from hf_models import ARCH_FORMS, ARCHS, CACHES, VOCAB, build_model, load_model

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=ARCH_FORMS)
def model(request, tmp_path_factory):
    """Each tiny architecture, loaded from a checkpoint with a 5.x or a 4.x config.json."""
    arch, form = request.param
    return load_model(arch, form, tmp_path_factory.mktemp(f"{arch}-{form}"), seed=9)


def ids(rng: np.random.Generator, n: int) -> torch.Tensor:
    return torch.as_tensor(rng.integers(0, VOCAB, n), dtype=torch.long)[None]


def plain(model, input_ids, n):
    return model.generate(input_ids, max_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("make_cache", CACHES)
def test_multi_turn_and_branches_equal_plain_generate(model, make_cache):
    rng = np.random.default_rng(3)
    prefix = radixkv.hf.PrefixCache(model, make_cache())
    history = ids(rng, 23)
    cached = []
    for n in (4, 7, 2):
        prompt = torch.cat([history, ids(rng, n)], dim=1)
        out = prefix.generate(prompt, max_new_tokens=5, do_sample=False)
        assert torch.equal(out, plain(model, prompt, 5))
        cached.append(prefix.last_cached)
        history = out
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    # The previous turn's prompt and reply were stored: all but the page holding the last
    # token (whose KV generate never computes) and the new message are found.
    page = prefix.cache.page_size
    assert cached[2] >= (history.shape[1] - 5 - 2 - 1) // page * page - page
    # Branches off the conversation, step by step through lookup / generate / store.
    for n in (1, 6):
        prompt = torch.cat([history, ids(rng, n)], dim=1)
        past = prefix.lookup(prompt)
        assert past.get_seq_length() == prefix.last_cached > 0
        kw = {prefix.spec.cache_kwarg: past}  # past_key_values before transformers 5
        out = model.generate(prompt, **kw, max_new_tokens=3, do_sample=False)
        assert torch.equal(out, plain(model, prompt, 3))
        assert prefix.store(past, out) == out.shape[1] - 1
    assert prefix.num_open == 0
    prefix.cache.check()
    assert prefix.cache.stats.used_pages == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("make_cache", CACHES)
def test_forward_from_a_looked_up_prefix_equals_the_full_forward(arch, make_cache):
    model = build_model(arch, seed=4)
    prefix = radixkv.hf.PrefixCache(model, make_cache())
    rng = np.random.default_rng(4)
    first = ids(rng, 37)
    prefix.generate(first, max_new_tokens=4, do_sample=False)
    seq = torch.cat([first, ids(rng, 8)], dim=1)
    past = prefix.lookup(seq)
    c = past.get_seq_length()
    assert c > 0
    with torch.no_grad():
        kw = {prefix.spec.cache_kwarg: past}
        got = model(seq[:, c:], **kw, use_cache=True).logits[0]
        full = model(seq).logits[0, c:]
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)
    prefix.abort(past)
    assert prefix.cache.stats.used_pages == 0


def test_sampling_reuses_the_prefix_and_matches_plain_sampling():
    model = build_model("llama", seed=6)
    prefix = radixkv.hf.PrefixCache(model, radixkv.RadixCache(256))
    rng = np.random.default_rng(5)
    prompt = ids(rng, 30)
    prefix.generate(prompt, max_new_tokens=2, do_sample=False)
    longer = torch.cat([prompt, ids(rng, 3)], dim=1)
    torch.manual_seed(0)
    got = prefix.generate(longer, max_new_tokens=6, do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(0)
    want = model.generate(longer, max_new_tokens=6, do_sample=True, top_k=0, temperature=1.0)
    assert prefix.last_cached == 30 and torch.equal(got, want)


def test_a_prefix_cache_shares_an_engines_pool():
    model = build_model("qwen2", seed=8)
    eng = radixkv.hf.engine(model, radixkv.RadixCache(256))
    rng = np.random.default_rng(6)
    prompt = ids(rng, 25)
    eng.generate([prompt[0].numpy()], max_new_tokens=3)
    prefix = radixkv.hf.PrefixCache(model, eng.kv)
    longer = torch.cat([prompt, ids(rng, 4)], dim=1)
    out = prefix.generate(longer, max_new_tokens=4, do_sample=False)
    assert prefix.last_cached == 25 and torch.equal(out, plain(model, longer, 4))


def test_bad_arguments_are_refused_and_change_nothing():
    model = build_model("phi3", seed=1)
    prefix = radixkv.hf.PrefixCache(model, radixkv.RadixCache(64))
    stats = prefix.cache.stats.as_dict()
    batch = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="batch size 2"):
        prefix.generate(batch, max_new_tokens=2)
    with pytest.raises(ValueError, match="batch size 2"):
        prefix.lookup(batch)
    one = torch.tensor([[1, 2, 3]])
    for kwargs, match in [
        ({"num_beams": 2}, "num_beams must be 1"),
        ({"num_return_sequences": 2, "do_sample": True}, "num_return_sequences must be 1"),
        ({"attention_mask": torch.tensor([[0, 1, 1]])}, "attention_mask"),
        ({"use_cache": False}, "use_cache"),
        ({"past_key_values": object()}, "past_key_values"),
    ]:
        with pytest.raises(ValueError, match=match):
            prefix.generate(one, max_new_tokens=2, **kwargs)
    for bad, match in [
        (torch.tensor([[1.0, 2.0]]), "integer token ids"),
        (torch.tensor([[1, VOCAB]]), rf"\[0, {VOCAB}\)"),
        (torch.zeros((1, 0), dtype=torch.long), "n >= 1"),
        ([[-1, 2]], "token ids in"),
    ]:
        with pytest.raises(ValueError, match=match):
            prefix.lookup(bad)
    with pytest.raises(ValueError, match="namespace"):
        radixkv.hf.PrefixCache(model, radixkv.RadixCache(8), namespace=3)
    with pytest.raises(ValueError, match="cache must be"):
        radixkv.hf.PrefixCache(model, None)
    assert prefix.cache.stats.as_dict() == stats and prefix.num_open == 0


def test_store_and_abort_check_what_they_are_given():
    model = build_model("gemma", seed=2)
    prefix = radixkv.hf.PrefixCache(model, radixkv.RadixCache(64))
    prompt = torch.tensor([[5, 6, 7, 8]])
    past = prefix.lookup(prompt)
    assert prefix.num_open == 1 and prefix.cache.stats.used_pages == 4
    out = model.generate(
        prompt, **{prefix.spec.cache_kwarg: past}, max_new_tokens=3, do_sample=False
    )
    with pytest.raises(ValueError, match="begin with the 4 looked-up"):
        prefix.store(past, out[:, 1:])
    with pytest.raises(ValueError, match="returned by this PrefixCache"):
        prefix.store(object(), out)
    assert prefix.num_open == 1  # the failed calls left the lookup open
    assert prefix.store(past, out) == 6
    with pytest.raises(ValueError, match="not yet stored"):
        prefix.store(past, out)
    with pytest.raises(ValueError, match="not yet stored"):
        prefix.abort(past)
    assert prefix.cache.match_prefix(out[0, :6].numpy()) == 5  # the match limit: n - 1
    # An aborted lookup publishes nothing.
    other = prefix.lookup(torch.tensor([[9, 9, 9]]))
    prefix.abort(other)
    assert prefix.cache.match_prefix([9, 9, 9, 9]) == 0
    assert prefix.cache.stats.used_pages == 0


def test_a_failing_generate_releases_its_lookup():
    model = build_model("qwen3", seed=3)
    prefix = radixkv.hf.PrefixCache(model, radixkv.RadixCache(64))
    with pytest.raises(Exception):  # noqa: B017 - whatever generate raises for this argument
        prefix.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=-1)
    assert prefix.num_open == 0 and prefix.cache.stats.used_pages == 0


def test_a_full_pool_keeps_the_prompt_and_drops_the_output():
    model = build_model("mistral", seed=4)
    prefix = radixkv.hf.PrefixCache(model, radixkv.RadixCache(10))
    prompt = torch.arange(1, 9)[None]
    out = prefix.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, plain(model, prompt, 6))
    assert prefix.cache.match_prefix(out[0].numpy()) == 8  # the prompt, not the output
    assert prefix.cache.stats.used_pages == 0


@pytest.mark.parametrize(
    "make_cache",
    [
        pytest.param(lambda: radixkv.RadixCache(40, page_size=1, host_pages=64), id="radix-P1"),
        pytest.param(lambda: radixkv.BlockCache(3, page_size=16, host_pages=4), id="block-P16"),
    ],
)
def test_a_host_tier_serves_evicted_prefixes_exactly(make_cache):
    """Device pools that hold one conversation at a time: switching between two sends each one
    to the host and back; every reply still equals plain generate, and hits come from the
    host."""
    model = build_model("llama", seed=9)
    rng = np.random.default_rng(5)
    prefix = radixkv.hf.PrefixCache(model, make_cache())
    histories = [ids(rng, 20), ids(rng, 20)]
    for turn in range(2):
        for i, history in enumerate(histories):
            prompt = torch.cat([history, ids(rng, 3)], dim=1)
            out = prefix.generate(prompt, max_new_tokens=4, do_sample=False)
            assert torch.equal(out, plain(model, prompt, 4)), (turn, i)
            histories[i] = out
    stats = prefix.cache.stats
    assert stats.host_hit_tokens > 0 and stats.loaded_pages > 0 and stats.offloaded_pages > 0
    prefix.cache.check()
