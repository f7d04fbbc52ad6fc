"""radixkv's own checkpoint loader against transformers itself: tiny random-weight models of
each architecture are saved by transformers (config.json in the 5.x form it writes, and
rewritten to the 4.x form), loaded with radixkv.models.load_checkpoint, and run both ways.

Accepted architectures must give the same logits (atol 1e-4) and the same greedy tokens through
radixkv's paged engine; every other one, and every config.json setting radixkv does not
implement, must be refused with a ValueError naming it. Checkpoints radixkv writes must load in
transformers and compute the same thing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import radixkv  # noqa: E402
from hf_models import FORMS, VOCAB, build_model, config_dict_4x, save_model  # noqa: E402
from radixkv.models import CausalLM, ModelConfig, load_checkpoint, save_checkpoint  # noqa: E402
from radixkv.models.layers import rope_parameters  # noqa: E402

torch.set_num_threads(1)

#: Architectures radixkv's built-in model implements (see hf_models.ARCHS).
ACCEPTED = [
    "llama",
    "llama-llama3",
    "llama-linear",
    "llama-yarn",
    "mistral",
    "qwen2",
    "qwen3",
]
#: Architectures it refuses, and what the message must name.
REFUSED = {"gemma": "model_type 'gemma'", "phi3": "model_type 'phi3'"}

PROMPT_LEN = 48
NEW_TOKENS = 8


def tokens(seed: int, n: int = PROMPT_LEN) -> np.ndarray:
    """``n`` random token ids of the tiny vocabulary."""
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int64)


def reference_logits(model: Any, ids: np.ndarray) -> torch.Tensor:
    """transformers' float32 logits ``[N, vocab]`` of one whole sequence."""
    with torch.no_grad():
        return model(torch.from_numpy(ids)[None]).logits[0].float()


def reference_greedy(model: Any, prompt: np.ndarray, n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (``n`` tokens)."""
    with torch.no_grad():
        out = model.generate(
            torch.from_numpy(prompt)[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def engine_greedy(model: CausalLM, prompts: list[np.ndarray], n: int) -> list[list[int]]:
    """radixkv's greedy continuations through the paged KV cache and the engine."""
    cache = radixkv.RadixCache(1024, page_size=4)
    eng = radixkv.Engine(model, model.make_kv_cache(cache), token_budget=64)
    return [list(r.output) for r in eng.generate(prompts, max_new_tokens=n)]


def rewrite_config(path: Path, **changes: Any) -> None:
    """Updates keys of ``path``/config.json (a value of ``...`` deletes the key)."""
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", ACCEPTED)
def test_loader_matches_transformers(tmp_path, arch, form):
    reference = build_model(arch, seed=3)
    save_model(reference, tmp_path, form)
    written = json.loads((tmp_path / "config.json").read_text())
    assert ("rope_parameters" in written) == (form == "5.x")  # the form under test
    ours = load_checkpoint(tmp_path)

    # Every RoPE setting transformers resolved was read: theta, type and parameters.
    rope = reference.config.rope_parameters
    assert ours.config.rope_theta == rope["rope_theta"]
    assert ours.config.rope_type == rope["rope_type"]
    for key, value in (ours.config.rope_scaling or {}).items():
        assert key == "rope_type" or rope[key] == value, key

    ids = tokens(5)
    want = reference_logits(reference, ids)
    got = ours.forward_dense(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    prompts = [ids[:PROMPT_LEN], tokens(6, 17)]
    assert engine_greedy(ours, prompts, NEW_TOKENS) == [
        reference_greedy(reference, p, NEW_TOKENS) for p in prompts
    ]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_other_architectures_are_refused(tmp_path, arch, form):
    save_model(build_model(arch, seed=1), tmp_path, form)
    with pytest.raises(ValueError, match=REFUSED[arch]) as info:
        load_checkpoint(tmp_path)
    assert "not supported" in str(info.value)


#: (arch, transformers config changes, what the error must name): settings that change the math
#: and that radixkv does not implement.
REFUSED_SETTINGS = [
    ("mistral", {"sliding_window": 16}, "sliding_window=16"),
    (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
        "use_sliding_window",
    ),
    (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
        "use_sliding_window",
    ),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor",
    ),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    ("arch", "changes", "named"),
    REFUSED_SETTINGS,
    ids=["mistral-window", "qwen2-window", "qwen3-window", "dynamic-rope", "gelu", "partial-rope"],
)
def test_unimplemented_settings_are_refused(tmp_path, arch, changes, named, form):
    save_model(build_model(arch, seed=2, **changes), tmp_path, form)
    with pytest.raises(ValueError, match=named):
        load_checkpoint(tmp_path)


def test_settings_transformers_would_honour_are_refused_in_config_json(tmp_path):
    """Keys written by hand (or by other tools) that change the math are refused too."""
    save_model(build_model("qwen2", seed=4), tmp_path, "5.x")
    cases = [
        ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types.*sliding"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
            "per-layer-type",
        ),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "beta": 1.0}},
            r"\['beta'\]",
        ),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 2.0}}, "lacks"),
        # Both forms present but disagreeing: neither is silently preferred.
        ({"rope_theta": 123.0}, "disagree"),
    ]
    original = (tmp_path / "config.json").read_text()
    for changes, named in cases:
        (tmp_path / "config.json").write_text(original)
        rewrite_config(tmp_path, **changes)
        with pytest.raises(ValueError, match=named):
            load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(original)
    load_checkpoint(tmp_path)  # the untouched checkpoint loads


def test_mistral_without_sliding_window_key_takes_transformers_default(tmp_path):
    """A mistral config.json without sliding_window means transformers' default window (4096),
    which radixkv must refuse rather than read as "no window"."""
    save_model(build_model("mistral", seed=4), tmp_path, "4.x")
    rewrite_config(tmp_path, sliding_window=...)
    with pytest.raises(ValueError, match="sliding_window=4096"):
        load_checkpoint(tmp_path)


def test_4x_and_5x_forms_give_the_same_config(tmp_path):
    for arch in ("llama-llama3", "llama-yarn", "qwen2"):
        model = build_model(arch, seed=0)
        a = save_model(model, tmp_path / arch / "5x", "5.x")
        b = save_model(model, tmp_path / arch / "4x", "4.x")
        cfg_a = ModelConfig.from_hf(json.loads((a / "config.json").read_text()))
        cfg_b = ModelConfig.from_hf(json.loads((b / "config.json").read_text()))
        assert cfg_a == cfg_b
        assert cfg_a.rope_theta == model.config.rope_parameters["rope_theta"]


def test_4x_form_with_legacy_type_key_and_defaults():
    """A hand-written 4.x config: ``type`` instead of ``rope_type``, original_max_position
    taken from max_position_embeddings (as transformers does), yarn factor left null."""
    saved = build_model("llama-yarn").config.to_dict()
    hf = config_dict_4x({k: v for k, v in saved.items() if k != "dtype"})
    hf["rope_scaling"] = {"type": "yarn", "factor": None}
    hf["max_position_embeddings"] = 256
    hf["original_max_position_embeddings"] = 64  # a top-level one overrides, as in transformers
    cfg = ModelConfig.from_hf(hf)
    assert cfg.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    # The frequencies and cos/sin factor are transformers' own.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    reference = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](reference)
    got_inv, got_factor = rope_parameters(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    torch.testing.assert_close(got_inv, want_inv, atol=0, rtol=1e-6)
    assert got_factor == pytest.approx(want_factor, rel=1e-12) and got_factor > 1.1


#: Shapes of ModelConfig radixkv can build whose saved checkpoints transformers must read.
SAVED_SHAPES = [
    {"family": "llama"},
    {"family": "llama", "qkv_bias": True, "mlp_bias": True, "head_dim": 32},
    {"family": "llama", "mlp_bias": True, "tie_word_embeddings": True},
    {"family": "mistral", "head_dim": 32},
    {"family": "qwen2", "tie_word_embeddings": True, "head_dim": 8},
    {"family": "qwen3", "qkv_bias": True, "head_dim": 8},
]
SAVED_ROPES = [
    None,
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
     "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0, "truncate": False},
]  # fmt: skip


@pytest.mark.parametrize("rope", SAVED_ROPES, ids=["default", "llama3", "yarn"])
@pytest.mark.parametrize("shape", SAVED_SHAPES, ids=lambda s: "-".join(map(str, s.values())))
def test_saved_checkpoints_load_in_transformers(tmp_path, shape, rope):
    cfg = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=50000.0,
        rope_scaling=rope,
        **shape,
    )
    ours = CausalLM.random(cfg, seed=9)
    save_checkpoint(ours, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reference).__name__.lower().startswith(cfg.family)
    ids = tokens(8)
    torch.testing.assert_close(
        ours.forward_dense(ids), reference_logits(reference.eval(), ids), atol=1e-4, rtol=0
    )
