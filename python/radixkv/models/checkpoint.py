"""Reading and writing Hugging Face checkpoint directories (``config.json`` plus
``*.safetensors``) of the Llama, Mistral, Qwen2 and Qwen3 families, from local files only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from radixkv.models.config import ModelConfig
from radixkv.models.llama import CausalLM

#: Keys some checkpoints carry that hold no weights of ours (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _our_name(hf_name: str) -> str | None:
    """``model.layers.0.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``."""
    if hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if hf_name.startswith("model."):
        return hf_name[len("model.") :]
    return hf_name  # lm_head.weight


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def load_checkpoint(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """Loads a local Hugging Face checkpoint directory into a :class:`CausalLM`.

    Reads ``config.json`` (``model_type`` ``llama``, ``mistral``, ``qwen2`` or ``qwen3``, in
    the transformers 4.x or 5.x form, see :meth:`ModelConfig.from_hf`) and every
    ``*.safetensors`` file in ``path`` (sharded checkpoints included); never touches the network.
    Raises ``FileNotFoundError`` for a missing file, and ``ValueError`` for a config.json setting
    radixkv does not implement (naming it) or for missing, unexpected or misshapen weights.
    """
    from safetensors.torch import load_file

    root = Path(path)
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} has no config.json")
    cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} has no *.safetensors file")

    state: dict[str, torch.Tensor] = {}
    for f in files:
        for hf_name, tensor in load_file(str(f), device="cpu").items():
            name = _our_name(hf_name)
            if name is not None:
                state[name] = tensor
    if cfg.tie_word_embeddings:
        head = state.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, state.get("embed_tokens.weight", head)):
            raise ValueError("tie_word_embeddings is true but lm_head.weight differs from embed")

    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.named_parameters())
    missing = sorted(_hf_name(n) for n in expected if n not in state)
    unexpected = sorted(_hf_name(n) for n in state if n not in expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(root)!r} does not match its config.json: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, p in expected.items():
        if tuple(state[name].shape) != tuple(p.shape):
            raise ValueError(
                f"weight {_hf_name(name)!r} has shape {tuple(state[name].shape)}, "
                f"config.json implies {tuple(p.shape)}"
            )
    state = {n: t.to(dtype=dtype) for n, t in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device).eval()


def save_checkpoint(model: CausalLM, path: str | Path) -> None:
    """Writes ``model`` as a Hugging Face checkpoint directory: ``config.json`` and
    ``model.safetensors`` with Hugging Face parameter names (a tied head is not written)."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    hf = model.config.to_hf()
    hf["torch_dtype"] = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    (root / "config.json").write_text(json.dumps(hf, indent=2))
    tensors = {_hf_name(n): p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
