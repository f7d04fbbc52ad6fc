"""The model through the paged cache gives the logits of a dense recompute of each sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from tiny_model import CACHES, cuda, ids, tiny_model


def check_step(model, kv, reqs, atol, all_logits=True):
    """Runs one step and compares its logits with the dense forward of each request's whole
    sequence: with ``all_logits``, every planned token's (``model(step, all_logits=True)``);
    without, the one row per request the model returns by default (its last token's). Returns
    the step's last-token logits, one row per request."""
    starts = [r.num_computed for r in reqs]
    step = kv.plan(reqs)
    logits = model(step, all_logits=all_logits)
    assert logits.shape[0] == (step.num_tokens if all_logits else len(reqs))
    row = 0
    for i, (req, start, n) in enumerate(zip(reqs, starts, step.q_len_list)):
        dense = model.forward_dense(req.tokens)[start:]
        got = logits[row : row + n] if all_logits else logits[i : i + 1]
        want = dense if all_logits else dense[-1:]
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=atol, rtol=0)
        row += n
    last = logits[step.last_token_index] if all_logits else logits
    kv.commit(step)
    return last


def mixed_batches(model, make_cache, atol, device="cpu"):
    """A fresh prompt; then one step mixing a prefill over a cached prefix, a fresh prompt and a
    decode; then forked branches with their own suffixes next to a decode."""
    cache = make_cache(2048)
    kv = model.make_kv_cache(cache)
    rng = np.random.default_rng(0)
    a = cache.admit(ids(rng, 70))
    check_step(model, kv, [a], atol)
    b = cache.admit(np.concatenate([a.tokens[:50], ids(rng, 13)]))
    assert b.num_cached == 50 // cache.page_size * cache.page_size
    c = cache.admit(ids(rng, 31))
    cache.extend(a, ids(rng, 1))
    check_step(model, kv, [b, c, a], atol)

    kids = [cache.fork(b) for _ in range(3)]
    assert all(k.num_cached == 62 // cache.page_size * cache.page_size for k in kids)
    for i, k in enumerate(kids):
        cache.extend(k, ids(rng, 1 + 5 * i))
    cache.extend(c, ids(rng, 1))
    check_step(model, kv, [*kids, c], atol)
    for r in (a, b, c, *kids):
        cache.finish(r)
    cache.check()
    assert cache.stats.used_pages == 0


@pytest.mark.parametrize("make_cache", CACHES)
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_mixed_batches_match_dense(make_cache, kv_heads):
    mixed_batches(tiny_model(num_kv_heads=kv_heads), make_cache, atol=1e-4)


@pytest.mark.parametrize(
    "variant",
    [
        {"tie_word_embeddings": True},
        {"qkv_bias": True, "family": "qwen2", "rope_theta": 1e6},
        {"num_heads": 4, "num_kv_heads": 4, "head_dim": 32},
    ],
    ids=["tied", "qwen2-bias", "mha-wide-heads"],
)
def test_model_variants_match_dense(variant):
    mixed_batches(tiny_model(**variant), CACHES[1].values[0], atol=1e-4)


@pytest.mark.parametrize("make_cache", CACHES)
def test_multi_step_greedy_decoding(make_cache):
    """Three requests sharing a prefix decode 10 tokens in one batch; each step's tokens are
    the argmax of the dense forward and its logits match it."""
    model = tiny_model(seed=3)
    cache = make_cache(1024)
    kv = model.make_kv_cache(cache)
    rng = np.random.default_rng(5)
    shared = ids(rng, 37)
    first = cache.admit(np.concatenate([shared, ids(rng, 4)]))
    check_step(model, kv, [first], 1e-4)
    reqs = [first] + [cache.admit(np.concatenate([shared, ids(rng, 4 + 3 * i)])) for i in (1, 2)]
    assert all(r.num_cached > 0 for r in reqs[1:])
    logits = check_step(model, kv, reqs[1:], 1e-4)
    logits = torch.cat([model.forward_dense(first.tokens)[-1:], logits])
    for _ in range(10):
        toks = logits.argmax(-1).tolist()
        for r, t in zip(reqs, toks):
            cache.extend(r, [t])
            assert int(model.forward_dense(r.tokens[:-1])[-1].argmax()) == t
        logits = check_step(model, kv, reqs, 1e-4, all_logits=False)
    cache.check()


def test_logits_of_last_tokens_only():
    model = tiny_model()
    cache = radixkv.RadixCache(256)
    kv = model.make_kv_cache(cache)
    rng = np.random.default_rng(0)
    reqs = [cache.admit(ids(rng, n)) for n in (5, 17, 9)]
    step = kv.plan(reqs)
    out = model(step)
    assert out.shape == (3, model.config.vocab_size) and out.dtype == torch.float32
    for r, row in zip(reqs, out):
        torch.testing.assert_close(row, model.forward_dense(r.tokens)[-1], atol=1e-4, rtol=0)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("make_cache", CACHES)
def test_cuda_bfloat16_matches_dense(make_cache):
    model = tiny_model(dtype=torch.bfloat16, device="cuda")
    mixed_batches(model, make_cache, atol=0.15, device="cuda")
