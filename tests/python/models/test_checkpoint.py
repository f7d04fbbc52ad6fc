"""Hugging Face checkpoint directories: written here with the Hugging Face names spelled out,
loaded by radixkv.models.load_checkpoint, compared with the model they came from."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import radixkv
from radixkv.models import ModelConfig, load_checkpoint, save_checkpoint
from radixkv.models.layers import rope_inv_freq
from tiny_model import ids, tiny_model


def hf_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights under the names Hugging Face Llama/Qwen2 checkpoints use."""
    out = {
        "model.embed_tokens.weight": model.embed_tokens.weight,
        "model.norm.weight": model.norm.weight,
    }
    if model.lm_head is not None:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(layer.self_attn, name)
            out[p + f"self_attn.{name}.weight"] = lin.weight
            if lin.bias is not None:
                out[p + f"self_attn.{name}.bias"] = lin.bias
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[p + f"mlp.{name}.weight"] = getattr(layer.mlp, name).weight
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def write_hf(model, path, hf_config: dict, shards: int = 1) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    items = sorted(hf_tensors(model).items())
    for s in range(shards):
        part = dict(items[s::shards])
        save_file(part, str(path / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"))


LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
}


def check_same_logits(a, b) -> None:
    tokens = ids(np.random.default_rng(0), 40)
    torch.testing.assert_close(a.forward_dense(tokens), b.forward_dense(tokens), atol=1e-5, rtol=0)
    cache = radixkv.RadixCache(64)
    req = cache.admit(tokens)
    kv = b.make_kv_cache(cache)
    torch.testing.assert_close(b(kv.plan([req]))[0], a.forward_dense(tokens)[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize(("hf", "shards"), [(LLAMA, 1), (QWEN2, 2)], ids=["llama", "qwen2"])
def test_load_roundtrip(tmp_path, hf, shards):
    cfg = ModelConfig.from_hf(hf)
    assert cfg.qkv_bias == (hf["model_type"] == "qwen2")
    model = radixkv.models.CausalLM.random(cfg, seed=7)
    write_hf(model, tmp_path, hf, shards)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == cfg
    for (name, p), (name2, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert name == name2 and torch.equal(p, q)
    check_same_logits(model, loaded)


def test_save_checkpoint_roundtrip(tmp_path):
    model = tiny_model(seed=2, qkv_bias=True, family="qwen2", tie_word_embeddings=True)
    save_checkpoint(model, tmp_path)
    check_same_logits(model, load_checkpoint(tmp_path))


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_checkpoint(tmp_path)
    model = radixkv.models.CausalLM.random(ModelConfig.from_hf(LLAMA))
    write_hf(model, tmp_path, LLAMA)
    tensors = hf_tensors(model)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type must be one of"):
        load_checkpoint(tmp_path)


def test_rotary_follows_the_hugging_face_layout():
    """Pairs are (i, i + D/2): out_i = x_i cos - x_{i+D/2} sin, out_{i+D/2} = x_{i+D/2} cos +
    x_i sin, with angle position * theta ** (-2i / D)."""
    from radixkv.models.layers import Rotary, apply_rotary

    x = torch.randn(5, 3, 8)
    pos = torch.tensor([0, 1, 2, 7, 100])
    cos, sin = Rotary(8, 10000.0)(pos, torch.float32)
    out = apply_rotary(x, cos, sin)
    angle = pos[:, None, None].float() * 10000.0 ** (-torch.arange(4).float() * 2 / 8)
    lo, hi = x[..., :4], x[..., 4:]
    want = torch.cat([lo * angle.cos() - hi * angle.sin(), hi * angle.cos() + lo * angle.sin()], -1)
    torch.testing.assert_close(out, want)


def test_llama3_rope_scaling():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = rope_inv_freq(64, 500000.0, None)
    scaled = rope_inv_freq(64, 500000.0, scaling)
    wavelen = 2 * torch.pi / plain
    short, long = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert torch.equal(scaled[short], plain[short])  # high frequencies untouched
    torch.testing.assert_close(scaled[long], plain[long] / 8)  # low ones slowed by the factor
    mid = ~short & ~long
    assert bool(((scaled[mid] <= plain[mid]) & (scaled[mid] >= plain[mid] / 8)).all())
    with pytest.raises(ValueError, match="rope_scaling type"):
        ModelConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})


LLAMA3_ROPE = {
    **LLAMA,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}


@pytest.mark.parametrize("hf", [LLAMA, QWEN2, LLAMA3_ROPE], ids=["llama", "qwen2", "llama3-rope"])
def test_matches_transformers_when_installed(tmp_path, hf):
    """Optional cross-check against the Hugging Face implementation itself."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.AutoModelForCausalLM
    config = transformers.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    reference = cls.from_config(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    ours = load_checkpoint(tmp_path)
    tokens = ids(np.random.default_rng(1), 33)
    with torch.no_grad():
        want = reference(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0]
    torch.testing.assert_close(ours.forward_dense(tokens), want.float(), atol=1e-4, rtol=0)


#: Every bias/q-k-norm shape a family can take (the others are refused, see below).
FAMILY_SHAPES = [
    {"family": "llama"},
    {"family": "llama", "qkv_bias": True},  # attention_bias: q/k/v and o
    {"family": "llama", "mlp_bias": True},
    {"family": "llama", "qkv_bias": True, "mlp_bias": True},
    {"family": "mistral"},
    {"family": "qwen2"},  # q/k/v bias, none on o_proj
    {"family": "qwen3"},  # q/k norms
    {"family": "qwen3", "qkv_bias": True},
]
ROPES = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
]  # fmt: skip


@pytest.mark.parametrize("rope", ROPES, ids=["default", "linear", "llama3", "yarn"])
@pytest.mark.parametrize(
    "shape", FAMILY_SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items())
)
def test_every_config_shape_roundtrips(tmp_path, shape, rope):
    # Tied heads and a head_dim other than hidden/heads ride along on some of the shapes.
    extra = {"tie_word_embeddings": True} if len(shape) == 1 else {"head_dim": 8}
    model = tiny_model(seed=5, rope_theta=50000.0, rope_scaling=rope, **shape, **extra)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == model.config
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in model.named_parameters()]
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    check_same_logits(model, loaded)


def test_family_fixes_the_bias_options():
    """Options left None take the family's value; combinations that a family's Hugging Face
    architecture cannot express (and so could not be saved and reloaded) are refused."""
    qwen2 = ModelConfig(family="qwen2")
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias, qwen2.qk_norm) == (
        True,
        False,
        False,
        False,
    )
    llama = ModelConfig(qkv_bias=True)
    assert (llama.qkv_bias, llama.o_bias, llama.qk_norm) == (True, True, False)
    assert ModelConfig(family="qwen3").qk_norm is True
    with pytest.raises(ValueError, match=r"qkv_bias \(True\) and o_bias \(False\) must be equal"):
        ModelConfig(qkv_bias=True, o_bias=False)
    with pytest.raises(ValueError, match="qkv_bias=False is not possible for family 'qwen2'"):
        ModelConfig(family="qwen2", qkv_bias=False)
    with pytest.raises(ValueError, match="mlp_bias=True is not possible for family 'mistral'"):
        ModelConfig(family="mistral", mlp_bias=True)
    with pytest.raises(ValueError, match="qk_norm=True is not possible for family 'llama'"):
        ModelConfig(qk_norm=True)
    # replace() derives the family's options again when the family (or qkv_bias) changes.
    assert ModelConfig().replace(family="qwen2") == qwen2
    assert llama.replace(qkv_bias=False).o_bias is False
    assert ModelConfig().replace(family="qwen3").qk_norm is True


def test_rope_settings_are_normalised_and_checked():
    a = ModelConfig(rope_scaling={"type": "linear", "factor": 2})
    b = ModelConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert a == b and a.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ModelConfig(rope_scaling={"rope_type": "default"}).rope_scaling is None
    with pytest.raises(ValueError, match=r"lacks \['original_max_position_embeddings'\]"):
        ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"key\(s\) \['low_freq_factor'\]"):
        ModelConfig(rope_scaling={"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0\.5"):
        ModelConfig(
            rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
        )


def test_from_hf_reads_both_rope_forms():
    """transformers 5.x keeps theta and scaling in rope_parameters; 4.x at the top level."""
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    new = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}
    want = {"rope_type": "llama3", **scaling}
    for hf in (old, new):
        cfg = ModelConfig.from_hf(hf)
        assert (cfg.rope_theta, cfg.rope_scaling) == (500000.0, want)
    both = ModelConfig.from_hf({**old, "rope_parameters": new["rope_parameters"]})
    assert both == ModelConfig.from_hf(new)
    with pytest.raises(ValueError, match="disagree"):
        ModelConfig.from_hf({**new, "rope_theta": 10000.0})
    # What radixkv writes is read back unchanged.
    cfg = ModelConfig.from_hf(new)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_model_config_takes_and_gives_transformers_names():
    """``ModelConfig`` takes transformers' names (``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``model_type``) as its own, and reads them back."""
    import inspect

    from radixkv.models.config import HF_NAMES

    ours = ModelConfig(num_layers=3, num_heads=8, num_kv_heads=2, hidden_size=128, family="qwen2")
    theirs = ModelConfig(
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=128,
        model_type="qwen2",
    )
    assert theirs == ours
    for hf_name, name in HF_NAMES.items():
        assert getattr(theirs, hf_name) == getattr(theirs, name)
    # A config written from transformers' keys constructs the same model as from_hf reads.
    hf = ours.to_hf()
    keys = {k: hf[k] for k in ("vocab_size", "hidden_size", "intermediate_size", *HF_NAMES)}
    assert ModelConfig(**keys, head_dim=hf["head_dim"]) == ModelConfig.from_hf(hf)
    # transformers' num_key_value_heads=None: one KV head per query head.
    assert ModelConfig(num_attention_heads=4, num_key_value_heads=None).num_kv_heads == 4
    # Both names of one setting must agree; either alone is checked as before.
    with pytest.raises(ValueError, match="num_hidden_layers=3 and num_layers=2 name the same"):
        ModelConfig(num_layers=2, num_hidden_layers=3)
    assert ModelConfig(num_layers=2, num_hidden_layers=2).num_layers == 2
    with pytest.raises(ValueError, match="num_layers must be a positive int, got 0"):
        ModelConfig(num_hidden_layers=0)
    with pytest.raises(TypeError):
        ModelConfig(num_hidden_layer=2)  # a typo is still refused
    assert ours.replace(num_layers=5).num_hidden_layers == 5
    assert set(HF_NAMES) <= set(inspect.signature(ModelConfig).parameters)
