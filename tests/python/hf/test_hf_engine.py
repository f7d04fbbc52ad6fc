"""radixkv.hf.engine: transformers models on radixkv's Engine give transformers' own greedy
tokens, and a cached-prefix forward gives transformers' full-forward logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import radixkv
import radixkv.hf
from hf_models import (
    ARCH_FORMS,
    ARCHS,
    CACHES,
    FORMS,
    VOCAB,
    build_model,
    greedy_reference,
    load_model,
)
from tiny_model import cuda

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=ARCH_FORMS)
def model(request, tmp_path_factory):
    """Each tiny architecture, loaded from a checkpoint with a 5.x or a 4.x config.json."""
    arch, form = request.param
    return load_model(arch, form, tmp_path_factory.mktemp(f"{arch}-{form}"), seed=5)


def tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n).astype(np.uint32)


@pytest.mark.parametrize("make_cache", CACHES)
def test_session_and_branches_match_transformers_generate(model, make_cache):
    rng = np.random.default_rng(1)
    eng = radixkv.hf.engine(model, make_cache(), token_budget=48, max_batch=4)
    session = radixkv.Session(eng, system=tokens(rng, 21))
    replies = []
    for turn, n in enumerate((5, 9, 3)):
        prompt = np.concatenate([session.history, tokens(rng, n)])
        result = session.send(prompt[len(session.history) :], max_new_tokens=4)
        assert result.output == greedy_reference(model, prompt, 4)
        replies.append(result)
        if turn:  # every earlier turn, prompt and reply, is found in the cache
            assert result.cached_tokens > 0
    # Later turns reuse all but the last page of the conversation so far.
    page = eng.cache.page_size
    assert replies[2].cached_tokens >= (len(session.history) - 3 - 4 - 1) // page * page - page
    messages = [tokens(rng, 2), tokens(rng, 7), []]
    branches = session.branch(messages, max_new_tokens=3)
    for msg, result in zip(messages, branches):
        prompt = np.concatenate([session.history, np.asarray(msg, dtype=np.uint32)])
        assert result.output == greedy_reference(model, prompt, 3)
        assert result.cached_tokens > 0
    eng.cache.check()
    assert not eng.has_work and eng.cache.stats.used_pages == 0
    # The model is back on its own attention: plain generate and forward still work.
    assert model.config._attn_implementation != radixkv.hf.ATTENTION


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("make_cache", CACHES)
def test_cached_prefix_forward_logits_equal_full_forward(arch, make_cache):
    """Requests with different cached lengths, batched in one step, give the logits of
    transformers' own forward over each whole sequence (float32, atol 1e-4)."""
    cached_prefix_logits_match(build_model(arch, seed=7), make_cache, atol=1e-4)


# bfloat16 keeps 8 bits of mantissa: two correct orders of summation differ by a few units of
# the last place of logits of unit scale.
BF16_ATOL = 6e-2


@pytest.mark.parametrize("make_cache", CACHES)
def test_cached_prefix_logits_in_bfloat16_on_the_cpu(make_cache):
    """The same in bfloat16 (what a GPU serves in), on the CPU."""
    model = build_model("llama", seed=7).to(torch.bfloat16)
    cached_prefix_logits_match(model, make_cache, atol=BF16_ATOL)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("make_cache", CACHES)
def test_cached_prefix_logits_in_bfloat16_on_cuda(arch, make_cache):
    """The adapter on CUDA in bfloat16: paged attention over the pool on the GPU."""
    model = build_model(arch, seed=7).to("cuda", torch.bfloat16)
    cached_prefix_logits_match(model, make_cache, atol=BF16_ATOL)


def cached_prefix_logits_match(model, make_cache, atol: float) -> None:
    adapter = radixkv.hf.HFCausalLM(model)
    device = next(model.parameters()).device
    cache = make_cache()
    kv = adapter.make_kv_cache(cache)
    rng = np.random.default_rng(2)
    base = tokens(rng, 40)
    first = cache.admit(base)
    step = kv.plan([first])
    adapter(step)
    kv.commit(step)
    cache.finish(first)  # publishes the prefix
    seqs = [np.concatenate([base[:n], tokens(rng, m)]) for n, m in ((40, 6), (33, 1), (17, 11))]
    seqs.append(tokens(rng, 9))  # nothing cached
    reqs = [cache.admit(s) for s in seqs]
    cached = [r.num_cached for r in reqs]
    assert cached[0] > 0 and cached[-1] == 0
    step = kv.plan(reqs)
    got = adapter(step, all_logits=True)
    last = adapter(kv.plan(reqs))  # the same step again: the engine's last-token logits
    rows = np.cumsum([0] + [len(s) - c for s, c in zip(seqs, cached)])
    with torch.no_grad():
        for i, (s, c) in enumerate(zip(seqs, cached)):
            ids = torch.as_tensor(s.astype(np.int64), device=device)[None]
            full = model(ids).logits[0, c:].float()
            torch.testing.assert_close(got[rows[i] : rows[i + 1]].float(), full, atol=atol, rtol=0)
            torch.testing.assert_close(last[i].float(), full[-1], atol=atol, rtol=0)
    for r in reqs:
        cache.abort(r)
    cache.check()


def test_engine_sizes_the_pool_from_the_config_and_passes_arguments_on():
    model = build_model("qwen3", seed=1)
    cache = radixkv.RadixCache(64)
    eng = radixkv.hf.engine(model, cache, token_budget=32, max_batch=3, policy="lpm")
    assert isinstance(eng, radixkv.Engine) and eng.cache is cache
    assert (eng.kv.num_layers, eng.kv.num_kv_heads, eng.kv.head_dim) == (2, 2, 16)
    assert eng.kv.dtype == torch.float32 and eng.kv.device == torch.device("cpu")
    assert (eng.token_budget, eng.max_batch, eng.vocab_size) == (32, 3, VOCAB)
    # A KVCache made before (an engine's, say) is shared, not copied.
    other = radixkv.hf.engine(model, eng.kv)
    assert other.kv is eng.kv
    with pytest.raises(ValueError, match="token_budget"):
        radixkv.hf.engine(model, radixkv.RadixCache(8), token_budget=0)
    with pytest.raises(ValueError, match="cache must be"):
        radixkv.hf.engine(model, "radix")
    wrong = radixkv.KVCache(radixkv.RadixCache(8), 2, 2, 8)
    with pytest.raises(ValueError, match="the model needs"):
        radixkv.hf.engine(model, wrong)
    # The Engine itself checks a KVCache against the wrapped model's KV shape.
    adapter = radixkv.hf.HFCausalLM(model)
    assert adapter.kv_shape == (2, 2, 16)
    with pytest.raises(ValueError, match=r"kv is shaped .* = \(2, 2, 8\), the model needs"):
        radixkv.Engine(adapter, wrong)


def test_model_keeps_its_attention_when_a_step_fails():
    model = build_model("llama", seed=2)
    before = model.config._attn_implementation
    eng = radixkv.hf.engine(model, radixkv.RadixCache(64))
    # A forward that raises (a token id past the embedding table) fails its request only.
    eng.vocab_size = VOCAB + 10  # lets the bad id through to the model
    (result,) = eng.generate([[1, 2, VOCAB + 5]], max_new_tokens=2)
    assert result.finish_reason == "error" and result.error is not None
    assert model.config._attn_implementation == before
    ids = torch.tensor([[3, 4, 5]])
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 5)


def test_a_change_of_attention_between_steps_is_kept():
    """paged_mode switches known configs directly after the first step; a user who changes the
    model's implementation between steps gets that one back after the next step, and the
    engine still runs radixkv's attention (tokens equal transformers')."""
    model = build_model("llama", seed=4)
    eng = radixkv.hf.engine(model, radixkv.RadixCache(64))
    prompt = [5, 6, 7, 8]
    (first,) = eng.generate([prompt], max_new_tokens=3)
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    (again,) = eng.generate([prompt], max_new_tokens=3)
    assert again.output == first.output == greedy_reference(model, prompt, 3)
    assert model.config._attn_implementation == "eager"
    for m in model.modules():  # every sub-model's config is back too
        if hasattr(m, "config"):
            assert m.config._attn_implementation == "eager"


def _config(name: str, **kw):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return getattr(transformers, name)(**{**common, **kw})


def _model(config):
    import transformers

    return transformers.AutoModelForCausalLM.from_config(config).eval()


# Sliding-window models are served (tests/python/test_hf_window.py).
REFUSED = [
    pytest.param(lambda: _model(_config("Llama4TextConfig")), "chunked", id="llama4-chunked"),
    pytest.param(
        lambda: _model(_config("JambaConfig", use_mamba_kernels=False)),
        "is a hybrid model",  # no state slots, or (the engine's) none for PrefixCache
        id="jamba-hybrid",
    ),
    pytest.param(lambda: build_model("llama").train(), "training mode", id="training"),
]


@pytest.mark.parametrize(("make", "why"), REFUSED)
def test_unsupported_models_are_refused_with_the_reason(make, why):
    model = make()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=why):
        radixkv.hf.engine(model, radixkv.RadixCache(16))
    with pytest.raises(ValueError, match=why):
        radixkv.hf.PrefixCache(model, radixkv.RadixCache(16))
    assert model.config._attn_implementation == before


def test_encoder_decoders_and_other_objects_are_refused():
    import transformers

    t5 = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2
    )
    with pytest.raises(ValueError, match="encoder-decoder"):
        radixkv.hf.engine(transformers.T5ForConditionalGeneration(t5).eval(), radixkv.RadixCache(8))
    with pytest.raises(ValueError, match="PreTrainedModel"):
        radixkv.hf.engine(torch.nn.Linear(2, 2), radixkv.RadixCache(8))


def test_the_attention_function_refuses_calls_outside_radixkv():
    model = build_model("llama", seed=3)
    radixkv.hf.engine(model, radixkv.RadixCache(8))  # registers it
    model.set_attn_implementation(radixkv.hf.ATTENTION)
    try:
        with pytest.raises(RuntimeError, match=r"runs only inside radixkv\.hf"):
            model(torch.tensor([[1, 2]]))
    finally:
        model.set_attn_implementation("sdpa")


def test_both_config_forms_load_the_same_model(tmp_path):
    """The 4.x form (top-level rope_theta / rope_scaling) and the 5.x form (rope_parameters)
    of one checkpoint load to the same model, which radixkv serves alike."""
    import json

    from hf_models import save_model

    model = build_model("llama-yarn", seed=3)
    loaded = {}
    for form in FORMS:
        save_model(model, tmp_path / form, form)
        cfg = json.loads((tmp_path / form / "config.json").read_text())
        if form == "4.x":
            assert "rope_parameters" not in cfg and cfg["rope_scaling"]["rope_type"] == "yarn"
            assert cfg["rope_theta"] == 10000.0
        else:
            assert cfg["rope_parameters"]["rope_type"] == "yarn" and "rope_scaling" not in cfg
        loaded[form] = load_model("llama-yarn", form, tmp_path / f"{form}-again", seed=3)
    prompt = list(range(3, 40))
    outs = [
        radixkv.hf.engine(m, radixkv.RadixCache(64)).generate([prompt], max_new_tokens=5)[0].output
        for m in loaded.values()
    ]
    assert outs[0] == outs[1] == greedy_reference(model, prompt, 5)
