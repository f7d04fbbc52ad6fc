"""``torch.compile`` of a transformers model around radixkv's paged attention
(``radixkv.hf.engine(..., compile=True)``).

Dynamo traces the model's own math (embeddings, norms, RoPE, MLPs, the head) and Inductor fuses
it; radixkv's attention stays one opaque call, the custom op ``radixkv::paged_attention``, so
neither traces into the step, its backends or the pool writes::

    compiled forward:  ... -> q, k, v -> radixkv::paged_attention(q, k, v, layer, ...) -> ...
                                              |  (runs the real step, outside the graph)
    CompiledStep.attention  --op-->  the step of :func:`current` (set by :func:`running`)

The op's inputs are tensors and constants only: the step it attends over is the one the
adapter set around the forward (:func:`running`, per thread), and its fake implementation
gives Dynamo the output's shape (``q``'s) without running it. The op writes the step's K/V
into the pool, which is no argument of it: nothing in the compiled graph reads the pool, and
each layer's op takes the previous layer's output, so the writes keep their order.

Shapes: the packed token count ``T`` (and the kept rows of a prefill) vary every step; they
are marked dynamic (:func:`mark_dynamic`) so that one graph serves every length past 1, and a
new batch size or prompt length does not recompile. Dynamo specialises sizes 0 and 1, so a
one-token step (a decode step of one request) has a graph of its own: a handful of graphs in
all (see ``tests/python/hf/test_hf_compile.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

#: The custom op's qualified name.
OP = "radixkv::paged_attention"
#: The backend on each device type when none is given: Inductor everywhere (on the CPU it
#: needs a C++ compiler, as torch's own CPU compile does).
DEFAULT_BACKEND = "inductor"

_local = threading.local()


@contextlib.contextmanager
def running(step: Any) -> Iterator[None]:
    """Within: the op attends over ``step`` (this thread's; nested calls restore the outer)."""
    held = getattr(_local, "step", None)
    _local.step = step
    try:
        yield
    finally:
        _local.step = held


def current() -> Any:
    """The step the op attends over now; ``RuntimeError`` outside :func:`running`."""
    step = getattr(_local, "step", None)
    if step is None:
        raise RuntimeError(
            f"{OP} ran outside a radixkv.hf forward: it attends over the step the compiled "
            "model is run for (radixkv.hf.engine(..., compile=True))"
        )
    return step


@torch.library.custom_op(OP, mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``current().attention(layer, q, k, v, scale, ...)``: ``q`` ``[T, Hq, D]``, ``k``/``v``
    ``[T, Hkv, D]``; writes ``k``/``v`` into the pool and returns ``[T, Hq, D]`` in ``q``'s
    dtype (see :meth:`radixkv.kv.step.Step.attention`)."""
    out = current().attention(layer, q, k, v, scale, window=window, softcap=softcap, sinks=sinks)
    # A custom op's output may not alias its inputs (a backend handing back q's storage).
    return out.clone() if _aliases(out, (q, k, v)) else out


@paged_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    scale: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def _aliases(out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> bool:
    ptr = out.untyped_storage().data_ptr()
    return any(x.untyped_storage().data_ptr() == ptr for x in inputs)


class CompiledStep:
    """What the compiled forward is given as its step (``radixkv_step=``): one object for every
    step, whose :meth:`attention` is the custom op, so Dynamo sees the same input each call
    (no guard on the real step, which changes every step) and a call it does not trace into."""

    is_decode = False

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.ops.radixkv.paged_attention(q, k, v, layer, scale, window, softcap, sinks)

    def __repr__(self) -> str:
        return "CompiledStep()"


#: The one step object every compiled forward is given.
COMPILED_STEP = CompiledStep()


def mark_dynamic(*tensors: tuple[torch.Tensor | None, int]) -> None:
    """Marks each ``(tensor, dim)`` dynamic for Dynamo where its size is past 1 (sizes 0 and 1
    are specialised whatever is marked); ``maybe``: a model that needs the size static still
    compiles, specialised."""
    for t, dim in tensors:
        if t is not None and t.shape[dim] > 1:
            torch._dynamo.maybe_mark_dynamic(t, dim)


def check_backend(backend: Any) -> Any:
    """``backend`` as ``torch.compile`` takes it: a name Dynamo lists or a callable;
    ``ValueError`` naming it otherwise."""
    if callable(backend):
        return backend
    names = torch._dynamo.list_backends(exclude_tags=None)
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(
            f"compile backend must be one of {', '.join(sorted(names))} or a callable, got "
            f"{backend!r}"
        )
    return backend


def compile_forward(model: Any, backend: Any = DEFAULT_BACKEND) -> Any:
    """``torch.compile`` of ``model.__call__`` (transformers' own way of compiling a model),
    left ``dynamic=None``: the sizes :func:`mark_dynamic` marks are dynamic from the first
    compile, the rest static. The model itself is unchanged (plain ``generate`` stays eager)."""
    return torch.compile(model.__call__, backend=check_backend(backend), dynamic=None)
