"""The kernel variants a serving run compiles: Triton specializes a launch on each integer
argument equal to 1 or divisible by 16 and on each pointer's 16-byte alignment, and compiles a
new variant for each new combination. Over steps whose batch sizes, lengths, page counts and
split counts change, every kernel must launch one variant per choice of its constexprs (the
ones the AOT test compiles), so nothing compiles while serving.

The specializations are Triton's own (``native_specialize_impl`` with the CUDA backend and each
kernel's ``do_not_specialize``), computed from the arguments of each launch as the compiled
kernel's binder computes them; the launches run here under the interpreter or on a GPU."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kv.backends import triton_kernels as tk
from tiny_model import ids, tiny_model
from triton_device import DEVICE

pytestmark = pytest.mark.cuda

KERNELS = (tk._decode_split, tk._decode_merge, tk._prefill)


def specialization(kernel, args, kwargs) -> tuple[tuple, tuple]:
    """``(constexprs, runtime specialization)`` of one launch of ``kernel``: the constexpr
    values (and warps, stages), and what Triton's CUDA binder keys the other arguments by."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    fn = getattr(kernel, "fn", kernel)
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    opts = getattr(kernel, "kwargs", None) or {}
    dns = set(opts.get("do_not_specialize") or getattr(kernel, "do_not_specialize", ()) or ())
    consts, runtime = [], []
    for name, p in params.items():
        value = bound[name]
        if "constexpr" in str(p.annotation):
            consts.append((name, value))
        else:
            key = native_specialize_impl(CUDABackend, value, False, name not in dns, True)
            runtime.append((name, key))
    consts += [(k, kwargs.get(k)) for k in ("num_warps", "num_stages")]
    return tuple(consts), tuple(runtime)


@pytest.fixture
def launches(monkeypatch):
    """Every launch of the three kernels while active: ``{(kernel, constexprs): {runtime}}``."""
    seen: dict[tuple, set] = {}
    for kernel in KERNELS:
        real = kernel.run

        def spy(*args, _kernel=kernel, _real=real, **kwargs):
            consts, runtime = specialization(_kernel, args, kwargs)
            seen.setdefault((_kernel.__name__, consts), set()).add(runtime)
            return _real(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", spy)
    return seen


def variants(seen) -> dict:
    """The kernels (and constexprs) launched with more than one runtime specialization, with
    the arguments whose specialization differed."""
    out = {}
    for (name, _), keys in seen.items():
        if len(keys) > 1:
            by_arg = [dict(k) for k in keys]
            differ = {a for a in by_arg[0] if len({d[a] for d in by_arg}) > 1}
            out.setdefault(name, set()).update(differ)
    return out


def test_a_serving_run_launches_one_variant_per_config(launches):
    """Batch sizes 1 to 5, prompts of 1 to 40 tokens over pages of 2 (block tables 1 to 30
    pages wide, so widths of 1, 16 and others), prefills, decodes and mixed steps."""
    model = tiny_model(seed=5, device=DEVICE)
    kv = model.make_kv_cache(radixkv.RadixCache(512, page_size=2), attention="triton")
    eng = radixkv.Engine(model, kv, token_budget=48, max_batch=5)
    rng = np.random.default_rng(0)
    for n, new in ((1, 3), (31, 3), (7, 2), (40, 4), (3, 3), (12, 2)):
        eng.submit(ids(rng, n), max_new_tokens=new)
        eng.step()
    eng.run()
    names = {name for name, _ in launches}
    assert {"_decode_split", "_prefill"} <= names, names
    assert not variants(launches)


def test_split_counts_share_one_variant(launches):
    """The split-KV scratch's strides follow the split count: every count launches the split
    and merge kernels' one variant."""
    dev = DEVICE
    hkv, g, d, p = 2, 4, 32, 4
    pool = torch.zeros(64 * p, hkv, d, device=dev)
    for b, splits in ((1, 2), (3, 4), (2, 8), (5, 16), (1, 32)):
        q = torch.randn(b, hkv * g, d, device=dev)
        table = torch.zeros(b, 3, dtype=torch.int32, device=dev)
        lens = torch.full((b,), 9, dtype=torch.int32, device=dev)
        tk.paged_decode(q, pool, pool, table, lens, 0.1, p, splits=splits, min_split=1)
    assert {name for name, _ in launches} == {"_decode_split", "_decode_merge"}
    assert not variants(launches)
