"""A Llama-style decoder (Llama, Mistral, Qwen2 and Qwen3 families) whose attention runs over
the paged KV cache.

- :class:`ModelConfig`: hyper-parameters; ``ModelConfig.from_hf`` reads a ``config.json``.
- :class:`CausalLM`: the model; ``CausalLM.random(cfg, seed)`` for tests and the demo,
  ``model(step)`` for cached inference, ``model.forward_dense(tokens)`` as the reference.
- :func:`load_checkpoint` / :func:`save_checkpoint`: local Hugging Face checkpoint directories.
"""

from radixkv._extras import require_torch

require_torch("radixkv.models")

from radixkv.models.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from radixkv.models.config import ModelConfig  # noqa: E402
from radixkv.models.llama import CausalLM  # noqa: E402

__all__ = ["CausalLM", "ModelConfig", "load_checkpoint", "save_checkpoint"]
