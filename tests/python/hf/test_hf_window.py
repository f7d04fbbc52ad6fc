"""Sliding-window and hybrid local/global models on radixkv (issue: the models agents run
today): Mistral with ``sliding_window``, Qwen2 with ``use_sliding_window``, Gemma 2 (local and
global layers, logit softcapping), Gemma 3 (5 local layers to 1 global, local RoPE), Cohere2 and
gpt-oss (alternating layers, attention sinks, experts). Tiny random models with windows of 8
tokens, so that every prompt crosses them: ``radixkv.hf.engine`` gives transformers' own greedy
tokens over multi-turn sessions and branches longer than the window, under eviction pressure,
and a batched forward over cached prefixes gives transformers' full-forward logits (float32,
atol 1e-4). The pool keeps every token's KV and the window masks what each query reads
(:mod:`radixkv.kv.windowed`), so every later turn reuses its whole cached prefix.
``radixkv.hf.PrefixCache`` gives ``generate``'s own tokens and logits on them too, with or
without a window group."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import radixkv  # noqa: E402
import radixkv.hf  # noqa: E402
from hf_models import VOCAB, greedy_reference, randomize  # noqa: E402
from test_hf_engine import cached_prefix_logits_match, tokens  # noqa: E402

torch.set_num_threads(1)

WINDOW = 8

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)


def _configs() -> dict[str, object]:
    t = transformers
    local_global = ["sliding_attention", "full_attention"]
    return {
        "mistral-swa": t.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=WINDOW),
        "qwen2-swa": t.Qwen2Config(
            **_COMMON,
            num_hidden_layers=2,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
        "gemma2": t.Gemma2Config(
            **_COMMON,
            num_hidden_layers=2,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
            layer_types=local_global,
        ),
        "gemma3": t.Gemma3TextConfig(
            **_COMMON,
            num_hidden_layers=6,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
        ),
        "cohere2": t.Cohere2Config(
            **_COMMON, num_hidden_layers=2, sliding_window=WINDOW, layer_types=local_global
        ),
        "gpt-oss": t.GptOssConfig(
            **_COMMON,
            num_hidden_layers=2,
            sliding_window=WINDOW,
            layer_types=local_global,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    }


ARCHS = list(_configs())


def build(arch: str, seed: int = 3):
    config = _configs()[arch]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch != "gpt-oss":
        return randomize(model, seed)
    # gpt-oss keeps its experts as 3-D tensors [experts, in, out] and has 1-D sinks and
    # biases: drawn at unit activation scale too (sinks as logits of unit scale).
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 3:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model.eval()


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return build(request.param)


#: Pools small enough that the branches below evict (the trunk reaches 82 tokens, each
#: branch adds its own).
CACHES = [
    pytest.param(lambda: radixkv.RadixCache(100, page_size=1), id="radix-p1"),
    pytest.param(lambda: radixkv.BlockCache(7, page_size=16), id="block-p16"),
    # With a window group: the window layers' pools hold a few windows' worth of pages, so
    # window pages are released and evicted and some hits are cut to where a window is cached.
    pytest.param(
        lambda: radixkv.RadixCache(100, page_size=1, window=WINDOW, window_pages=72),
        id="radix-p1-window",
    ),
    pytest.param(
        lambda: radixkv.BlockCache(7, page_size=16, window=WINDOW, window_pages=6),
        id="block-p16-window",
    ),
    # With both host tiers: evicted pages of either group go to host memory and come back.
    pytest.param(
        lambda: radixkv.RadixCache(100, 1, host_pages=80, window=WINDOW, window_pages=72),
        id="radix-p1-window-host",
    ),
]


@pytest.mark.parametrize("make_cache", CACHES)
def test_sessions_and_branches_longer_than_the_window_match_transformers(model, make_cache):
    rng = np.random.default_rng(1)
    eng = radixkv.hf.engine(model, make_cache(), token_budget=48, max_batch=4)
    session = radixkv.Session(eng, system=tokens(rng, 3 * WINDOW))
    cached = []
    for turn, n in enumerate((5, 13, 3, 21)):
        prompt = np.concatenate([session.history, tokens(rng, n)])
        result = session.send(prompt[len(session.history) :], max_new_tokens=4)
        assert result.output == greedy_reference(model, prompt, 4)
        cached.append(result.cached_tokens)
        if turn == 1:  # another tenant's long prompt evicts most of the session meanwhile
            other = tokens(rng, 90)
            (res,) = eng.generate([other], max_new_tokens=1, namespace="other", release=True)
            assert res.output == greedy_reference(model, other, 1)
    # Later turns find the conversation so far (the window does not limit reuse: the pool
    # keeps every token's KV), but for pages the small pool evicted.
    assert cached[1] > 0 and cached[3] > 0
    messages = [tokens(rng, 2), tokens(rng, WINDOW + 3), []]
    for msg, result in zip(messages, session.branch(messages, max_new_tokens=3)):
        prompt = np.concatenate([session.history, np.asarray(msg, dtype=np.uint32)])
        assert result.output == greedy_reference(model, prompt, 3)
    eng.cache.check()
    s = eng.cache.stats
    assert s.evicted_pages > 0, "the pool never ran short: no eviction pressure"
    if eng.cache.window_host_pages:
        # Pages of both groups went down to the host and came back for hits.
        assert s.offloaded_pages > 0 and s.window_offloaded_pages > 0, s
        assert s.loaded_pages > 0 and s.window_loaded_pages > 0, s
    elif s.window_pages:
        # The window pool ran short too, and held less than the sessions' tokens.
        assert s.window_evicted_pages > 0 and s.window_cut_hits > 0, s


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "make_cache",
    [
        pytest.param(lambda: radixkv.RadixCache(512, page_size=1), id="radix-p1"),
        pytest.param(lambda: radixkv.BlockCache(32, page_size=16), id="block-p16"),
        pytest.param(
            lambda: radixkv.RadixCache(512, page_size=1, window=WINDOW, window_pages=512),
            id="radix-p1-window",
        ),
        pytest.param(
            lambda: radixkv.BlockCache(32, page_size=16, window=WINDOW, window_pages=32),
            id="block-p16-window",
        ),
    ],
)
def test_cached_prefix_logits_equal_the_full_forward(arch, make_cache):
    """Requests with cached prefixes longer than the window, batched with a fresh one, give
    transformers' logits over each whole sequence."""
    cached_prefix_logits_match(build(arch, seed=7), make_cache, atol=1e-4)


def test_the_window_changes_the_output():
    """The masks are not vacuous: the same weights without a window give other logits."""
    windowed = build("mistral-swa", seed=7)
    full = transformers.AutoModelForCausalLM.from_config(
        transformers.MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=None),
        dtype=torch.float32,
    ).eval()
    full.load_state_dict(windowed.state_dict())
    ids = torch.as_tensor(tokens(np.random.default_rng(0), 40).astype(np.int64))[None]
    with torch.no_grad():
        a, b = windowed(ids).logits[0, -1], full(ids).logits[0, -1]
    assert not torch.allclose(a, b, atol=1e-3)
    cache = radixkv.RadixCache(64)
    (res,) = radixkv.hf.engine(windowed, cache).generate([ids[0].tolist()], max_new_tokens=3)
    assert res.output == greedy_reference(windowed, ids[0].tolist(), 3)


#: PrefixCache's caches: the plain pool, and window groups whose pools are small enough that
#: window pages are released (handed to generate as masked zeros) and evicted.
PREFIX_CACHES = [
    pytest.param(lambda: radixkv.RadixCache(120, page_size=1), id="radix-p1"),
    pytest.param(
        lambda: radixkv.RadixCache(120, page_size=1, window=WINDOW, window_pages=72),
        id="radix-p1-window",
    ),
    pytest.param(
        lambda: radixkv.BlockCache(9, page_size=16, window=WINDOW, window_pages=5),
        id="block-p16-window",
    ),
]


def _generate(fn, prompt):
    ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64))[None]
    return fn(
        ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
    )


@pytest.mark.parametrize("make_cache", PREFIX_CACHES)
def test_prefix_cache_generate_matches_transformers(model, make_cache):
    """``radixkv.hf.PrefixCache`` on a windowed model: the tokens and logits (1e-4) of
    transformers' own ``generate`` over turns and a branch longer than the window, with another
    tenant evicting meanwhile; later turns start from the cached prefix."""
    pc = radixkv.hf.PrefixCache(model, make_cache())
    other = radixkv.hf.PrefixCache(model, pc.kv, namespace="other")  # the same pool
    rng = np.random.default_rng(4)
    trunk = tokens(rng, 3 * WINDOW)
    history, cached = trunk, []
    for turn, n in enumerate((5, 13, 3)):
        prompt = np.concatenate([history, tokens(rng, n)])
        got, want = _generate(pc.generate, prompt), _generate(model.generate, prompt)
        assert got.sequences.tolist() == want.sequences.tolist(), turn
        for a, b in zip(got.logits, want.logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        cached.append(pc.last_cached)
        history = got.sequences[0].numpy().astype(np.uint32)
        if turn == 1:
            _generate(other.generate, tokens(rng, 60))
    # A branch from inside the trunk, longer than the window.
    branch = np.concatenate([trunk[: 2 * WINDOW + 3], tokens(rng, WINDOW + 3)])
    got, want = _generate(pc.generate, branch), _generate(model.generate, branch)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0, cached
    assert pc.num_open == 0
    pc.cache.check()
    s = pc.cache.stats
    if pc.cache.window:
        # The branch point's window was pushed out of the small window pool: the hit was cut
        # (and recomputed exactly), where the full pool alone would have served it.
        assert s.window_evicted_pages > 0 and s.window_cut_hits > 0, s
    else:
        assert pc.last_cached > 0 and s.evicted_pages > 0, s


def test_bad_window_arguments_are_refused():
    from radixkv.kv.windowed import check_extras

    with pytest.raises(ValueError, match="window"):
        check_extras(0, None, None, 4)
    with pytest.raises(ValueError, match="softcap"):
        check_extras(None, -1.0, None, 4)
    with pytest.raises(ValueError, match="one logit per query head"):
        check_extras(None, None, torch.zeros(3), 4)


@pytest.mark.parametrize(
    "make_cache",
    [
        pytest.param(
            lambda: radixkv.RadixCache(160, page_size=1, window=WINDOW, window_pages=48),
            id="radix-p1-window",
        ),
        pytest.param(
            lambda: radixkv.RadixCache(48, page_size=4, window=WINDOW, window_pages=24),
            id="radix-p4-window",
        ),
        pytest.param(
            lambda: radixkv.BlockCache(12, page_size=16, window=WINDOW, window_pages=10),
            id="block-p16-window",
        ),
    ],
)
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_with_a_window_group_equals_plain_decoding(make_cache, method):
    """Drafts on a sliding-window model whose cache has a window group: their window pages are
    given back with the rejected drafts (``Cache.truncate``), so greedy outputs equal plain
    decoding's token for token, in a batch and for a retried request, and every page comes
    back."""
    model = build("mistral-swa")
    rng = np.random.default_rng(5)
    prompts = [np.concatenate([tokens(rng, 6)] * 4) for _ in range(3)]
    runs = []
    for spec in (None, {"method": method, "num_speculative_tokens": 4}):
        eng = radixkv.hf.engine(model, make_cache(), token_budget=64, speculative=spec)
        first = eng.generate(prompts, max_new_tokens=24, stop=())
        again = eng.generate(prompts[:1], max_new_tokens=24, stop=())
        eng.cache.check()
        s = eng.cache.stats
        assert s.used_pages == 0 and s.window_free_pages + s.window_evictable_pages == (
            s.window_pages
        )
        runs.append(([r.output for r in first + again], eng.stats))
    (plain, _), (spec_out, st) = runs
    assert spec_out == plain
    assert 0 < st.spec_accepted_tokens < st.spec_draft_tokens, st
