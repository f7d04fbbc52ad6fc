"""Every RoPE type transformers has is either served exactly or refused (issue: wrong KV from
position-dependent RoPE).

transformers recomputes the frequencies of ``dynamic`` (NTK) and ``longrope`` RoPE from the length
of each forward pass; radixkv packs requests of different lengths into one pass and reuses
prefixes computed by shorter passes, so those are refused with a ``ValueError`` naming the type.
Every other type fixes its frequencies at load time: for those a short request batched with a
long one (past ``original_max_position_embeddings``) gets the tokens it gets alone, and a prefix
cached by a short pass and reused by a long one gives the long pass's own logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import radixkv
import radixkv.hf
from hf_models import VOCAB, build_model, greedy_reference

torch.set_num_threads(1)

#: The length past which the length-dependent types switch (and the scaled types scale).
ORIGINAL = 32

#: rope_parameters of each type for the tiny Llama (head_dim 16: 8 frequencies).
PARAMS = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "longrope": {
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)],
        "original_max_position_embeddings": ORIGINAL,
    },
    "llama3": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "proportional": {"partial_rotary_factor": 0.5},
}

REFUSED = {"dynamic", "longrope"}


def test_every_type_transformers_has_is_covered():
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(PARAMS), (
        "transformers has RoPE types this test does not cover: decide for each whether it is "
        "served exactly (frequencies fixed at load time) or refused"
    )
    assert {t for t in PARAMS if radixkv.hf._support.length_dependent_rope(t)} == REFUSED


def model_with(rope_type: str, seed: int = 3):
    return build_model(
        "llama",
        seed=seed,
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **PARAMS[rope_type]},
        max_position_embeddings=ORIGINAL,
    )


@pytest.mark.parametrize("rope_type", sorted(REFUSED))
def test_length_dependent_rope_is_refused_naming_its_type(rope_type):
    model = model_with(rope_type)
    makers = [
        lambda: radixkv.hf.engine(model, radixkv.RadixCache(256, page_size=1)),
        lambda: radixkv.hf.HFCausalLM(model),
        lambda: radixkv.hf.PrefixCache(model, radixkv.RadixCache(256, page_size=1)),
    ]
    for make in makers:
        with pytest.raises(ValueError, match=f"rope_type='{rope_type}'"):
            make()


def test_phi3_longrope_is_refused():
    model = build_model(
        "phi3",
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **PARAMS["longrope"]},
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
    )
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        radixkv.hf.HFCausalLM(model)


def test_the_refusal_is_what_keeps_the_kv_right():
    """Without the refusal, a dynamic-NTK short request batched with a long one computes other
    logits than alone: the check guards a real defect."""
    model = model_with("dynamic")
    rng = np.random.default_rng(0)
    short = rng.integers(0, VOCAB, 8)
    long = rng.integers(0, VOCAB, 3 * ORIGINAL)
    with torch.no_grad():
        alone = model(torch.as_tensor(short)[None]).logits[0, -1]
        # One packed pass: the long sequence's positions pick the frequencies for both.
        ids = torch.as_tensor(np.concatenate([short, long]))[None]
        pos = torch.as_tensor(np.concatenate([np.arange(8), np.arange(len(long))]))[None]
        mask = torch.zeros(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
        mask[0, 0, :8, :8] = torch.ones(8, 8).tril().bool()
        mask[0, 0, 8:, 8:] = torch.ones(len(long), len(long)).tril().bool()
        packed = model(ids, position_ids=pos, attention_mask=mask).logits[0, 7]
    assert (alone - packed).abs().max() > 1e-3


@pytest.mark.parametrize("rope_type", sorted(set(PARAMS) - REFUSED))
def test_static_rope_short_and_long_batch_mates_match_generate_alone(rope_type):
    model = model_with(rope_type)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).astype(np.uint32) for n in (6, 3 * ORIGINAL, 11)]
    eng = radixkv.hf.engine(model, radixkv.RadixCache(512, page_size=1), max_batch=3)
    ids = [eng.submit(p, max_new_tokens=5) for p in prompts]
    results = eng.run()
    for rid, prompt in zip(ids, prompts):
        assert results[rid].output == greedy_reference(model, prompt, 5), rope_type
    eng.cache.check()


@pytest.mark.parametrize("rope_type", sorted(set(PARAMS) - REFUSED))
@pytest.mark.parametrize("page_size", [1, 16])
def test_static_rope_prefix_cached_short_reused_long_equals_full_forward(rope_type, page_size):
    model = model_with(rope_type, seed=4)
    adapter = radixkv.hf.HFCausalLM(model)
    cache = (
        radixkv.RadixCache(512, page_size=1)
        if page_size == 1
        else radixkv.BlockCache(32, page_size=page_size)
    )
    kv = adapter.make_kv_cache(cache)
    rng = np.random.default_rng(2)
    base = rng.integers(0, VOCAB, ORIGINAL).astype(np.uint32)  # a pass under the switch length
    first = cache.admit(base)
    step = kv.plan([first])
    adapter(step)
    kv.commit(step)
    cache.finish(first)
    long = np.concatenate([base, rng.integers(0, VOCAB, 2 * ORIGINAL).astype(np.uint32)])
    req = cache.admit(long)
    assert req.num_cached >= ORIGINAL - page_size
    got = adapter(kv.plan([req]), all_logits=True)
    with torch.no_grad():
        full = model(torch.as_tensor(long.astype(np.int64))[None]).logits[0, req.num_cached :]
    torch.testing.assert_close(got, full.float(), atol=1e-4, rtol=0)
    cache.abort(req)
    cache.check()
