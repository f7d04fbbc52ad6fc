"""How a backend is chosen and checked on each device, without needing one: ``auto`` on CUDA
(Triton, then FlashInfer, varlen, SDPA, saying why), Triton refused on the CPU outside its
interpreter, flex refused on CUDA for small pages, SDPA on CUDA never cuDNN, and devices
compared as torch compares them."""

from __future__ import annotations

import importlib.util
import inspect
import warnings

import pytest
import torch

import radixkv
from radixkv.kv import backends, devices
from radixkv.kv.backends import sdpa_backend
from tiny_model import cuda

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def test_auto_on_cuda_takes_triton_first():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here")
    assert "triton" in backends.available(CUDA)
    assert backends.auto_choice(CUDA, torch.bfloat16, True) == "triton"
    assert backends.auto_choice(CUDA, torch.float32, False) == "triton"
    assert backends.auto_reason(CUDA) is None
    # The CPU keeps SDPA; the interpreter is a test tool, never auto's choice.
    assert backends.auto_choice(CPU, torch.float32, True) == "sdpa"


def test_auto_without_triton_says_why(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a)
    )
    assert "triton" not in backends.available(CUDA)
    fallback = backends.auto_choice(CUDA, torch.bfloat16, True)
    assert fallback in ("flashinfer", "varlen", "sdpa") and fallback in backends.available(CUDA)
    why = backends.auto_reason(CUDA)
    assert why is not None and "Triton is not installed" in why and repr(fallback) in why
    # A pool on CUDA says it once (the check comes before any CUDA memory is touched, so the
    # refusal to allocate on this machine follows the warning).
    monkeypatch.setattr("radixkv.kv.kv_cache._AUTO_SAID", set())
    with pytest.warns(RuntimeWarning, match="Triton is not installed"):
        try:
            radixkv.KVCache(radixkv.RadixCache(16, page_size=16), 1, 1, 16, device="cuda")
        except (RuntimeError, AssertionError):
            pass  # no CUDA here
    with pytest.raises(ValueError, match="Triton is not installed"):
        backends.check_name("triton", CUDA)


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = radixkv.RadixCache(16)
    with pytest.raises(
        ValueError, match=r"attention='triton' cannot run on cpu: .*TRITON_INTERPRET=1"
    ):
        radixkv.KVCache(cache, 1, 2, 16, attention="triton")
    if importlib.util.find_spec("triton") is not None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert "triton" in backends.available(CPU)
    with pytest.raises(ValueError, match="run on CUDA devices, got meta"):
        backends.check_name("triton", torch.device("meta"))


def test_flex_on_cuda_needs_pages_of_16():
    if "flex" not in backends.available(CUDA):
        pytest.skip("flex_attention unavailable")
    with pytest.raises(ValueError, match=r"at least 16 slots.*page_size=4"):
        radixkv.KVCache(
            radixkv.RadixCache(16, page_size=4), 1, 2, 16, device="cuda", attention="flex"
        )
    backends.check_pool("flex", CUDA, 16)  # accepted
    backends.check_pool("flex", CPU, 1)  # the CPU has no such rule


def test_sdpa_on_cuda_never_chooses_cudnn():
    """The context every CUDA SDPA call runs in leaves cuDNN out, and SDPA is called in one
    place only (through it)."""
    if not hasattr(torch.backends.cuda, "cudnn_sdp_enabled"):
        pytest.skip("this torch has no cuDNN SDPA backend")
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_backend.sdpa_context(CUDA):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    src = inspect.getsource(sdpa_backend)
    assert src.count("F.scaled_dot_product_attention(") == 2  # both inside _sdpa
    body = inspect.getsource(sdpa_backend._sdpa)
    assert body.count("F.scaled_dot_product_attention(") == 2
    for mod in (backends.flex_backend, backends.varlen_backend, backends.triton_backend):
        assert "scaled_dot_product_attention(" not in inspect.getsource(mod)


@pytest.mark.cuda
@cuda
def test_cuda_sdpa_calls_run_without_cudnn(monkeypatch):
    from test_attention import CACHES, scenario

    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(sdpa_backend.F, "scaled_dot_product_attention", spy)
    scenario(CACHES[2].values[0], 8, 2, device="cuda", dtype=torch.bfloat16, atol=4e-2)
    assert seen and not any(seen)


def test_devices_compare_as_torch_does(monkeypatch):
    assert devices.canonical("cpu") == CPU
    assert devices.same("cpu", CPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert devices.canonical("cuda") == torch.device("cuda", 1)
    assert devices.same("cuda", "cuda:1") and not devices.same("cuda", "cuda:0")
    assert devices.canonical("cuda:0") == torch.device("cuda", 0)


@pytest.mark.cuda
@cuda
def test_a_cuda_pool_serves_a_model_on_cuda_0():
    pytest.importorskip("transformers")
    import radixkv.hf
    from hf_models import build_model

    torch.cuda.set_device(0)
    model = build_model("llama", seed=5).eval().to("cuda:0")
    spec = radixkv.hf.check_model(model)
    kv = radixkv.KVCache(
        radixkv.RadixCache(64, page_size=16),
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        device="cuda",
    )
    assert kv.device == torch.device("cuda", 0)
    eng = radixkv.hf.engine(model, kv)
    assert eng.generate([[1, 2, 3]], max_new_tokens=2)[0].output
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        radixkv.hf.PrefixCache(model, kv)


def test_every_backend_keeps_the_contract_under_its_name():
    kv = radixkv.KVCache(radixkv.RadixCache(16, page_size=16), 1, 1, 16)
    assert set(backends.BACKENDS) == set(backends.NAMES) - {"auto"}
    for name, make in backends.BACKENDS.items():
        backend = make(kv)
        assert isinstance(backend, backends.Backend), name
        assert backend.name == name
        assert isinstance(backend.static_decode, bool) and isinstance(backend.window_pool, bool)
    # What the callers ask the objects instead of comparing names: only Triton's kernels are
    # what a CUDA graph replays, and read the window pool.
    assert [n for n, b in backends.BACKENDS.items() if b.static_decode] == ["triton"]
    assert [n for n, b in backends.BACKENDS.items() if b.window_pool] == ["triton"]


def test_a_pool_makes_each_backend_once_and_names_a_bad_one():
    kv = radixkv.KVCache(radixkv.RadixCache(16, page_size=4), 1, 1, 16, attention="sdpa")
    sdpa = kv.backend("sdpa")
    assert isinstance(sdpa, sdpa_backend.SdpaBackend) and kv.backend("sdpa") is sdpa
    assert kv.backend_for(True, 3) is sdpa and kv.backend_for(False, 3) is sdpa
    for bad in ("auto", "SDPA", "", None, 3):
        with pytest.raises(ValueError, match=f"backend name must be one of .*got {bad!r}"):
            kv.backend(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention must be one of"):
        kv.backend("varlen")  # CUDA only: refused here, saying which names are usable


def test_auto_is_resolved_once_when_the_pool_is_made(monkeypatch):
    kv = radixkv.KVCache(radixkv.RadixCache(16, page_size=4), 1, 1, 16)
    picked = kv.backend_for(True, 1)
    assert picked.name == backends.auto_choice(CPU, torch.float32, True)

    def no_choice(*args):
        raise AssertionError("auto re-resolved after the pool was made")

    monkeypatch.setattr(backends, "auto_choice", no_choice)
    req = kv.cache.admit([1, 2, 3])
    step = kv.plan([req])
    assert step.backends == [picked.name] and kv.backend_for(True, 8) is picked
    assert kv.warmup(1, (1, 2)) == []  # SDPA compiles nothing; auto's choice not asked again


def test_decode_graphs_ask_the_pools_decode_backend():
    from radixkv.engine.graphs import why_not

    for attention in ("auto", "sdpa"):
        kv = radixkv.KVCache(radixkv.RadixCache(16, page_size=4), 1, 1, 16, attention=attention)
        why = why_not(kv)
        assert why is not None and f"its attention is {attention!r}" in why
        assert f"decode steps run {kv.backend_for(True, 1).name!r} on cpu" in why
