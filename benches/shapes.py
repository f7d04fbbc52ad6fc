"""Models the benchmarks run on, by name: random weights of a real model's shape, built where
they run (no download), or the packaged real model.

- ``tiny``: a 2-layer Llama-shaped model (smoke runs, the GPU check's dry run);
- ``llama3-8b``: Llama-3-8B's shape (32 layers, hidden 4,096, 32 query / 8 KV heads, MLP 14,336,
  vocab 128,256, rope theta 500,000, as its published config gives), random weights;
- ``smollm2``: SmolLM2-135M-Instruct, the real weights (``radixkv.hf.load``), when installed.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import transformers

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
}
NAMES = (*SHAPES, "smollm2")


def build(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    """The model ``name`` (one of :data:`NAMES`) in eval mode on ``device`` in ``dtype``;
    random weights are seeded, so two builds are the same model."""
    if name == "smollm2":
        import radixkv.hf

        model, _ = radixkv.hf.load("smollm2", dtype=dtype, device=device)
        return model.eval()
    if name not in SHAPES:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(NAMES)}")
    cfg = transformers.LlamaConfig(
        **SHAPES[name],
        max_position_embeddings=16384,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):  # built in place: 16 GB of weights never pass through the host
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``, with the names listed on a typo."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: float32, bfloat16 or float16")
    return dtype


def model_parser(
    doc: str | None, model: str = "smollm2", device: str = "cpu"
) -> argparse.ArgumentParser:
    """A parser with the options every bench that runs a model of :data:`NAMES` takes:
    ``--quick``, ``--model``, ``--device``, ``--dtype``, ``--threads`` (the bench adds its own;
    :func:`parse_model_args` reads them)."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: its figures say nothing")
    ap.add_argument("--model", default=model, choices=NAMES)
    ap.add_argument("--device", default=device)
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return ap


def parse_model_args(
    ap: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, Any]
) -> argparse.Namespace:
    """``argv`` parsed by ``ap`` (from :func:`model_parser`); with ``--quick``, the defaults
    ``quick`` (and the tiny model in place of the packaged one) under the options given
    explicitly. Checks ``--dtype`` and ``--threads`` and sets torch's CPU threads."""
    args = ap.parse_args(argv)
    if args.quick:
        model = "tiny" if ap.get_default("model") == "smollm2" else ap.get_default("model")
        ap.set_defaults(**{"model": model, **quick})
        args = ap.parse_args(argv)
    try:
        args.torch_dtype = dtype_of(args.dtype)
    except ValueError as e:
        ap.error(f"--dtype: {e}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    return args


def sync(device: str) -> None:
    """Waits for the work queued on ``device`` (a CUDA device; nothing to wait for on the CPU),
    so that a timer read after it counts that work."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
