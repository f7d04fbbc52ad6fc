"""Decode steps as CUDA graphs: one graph per padded batch bucket, replayed after the plan.

A decode step of a model running eagerly launches ~35 kernels a layer from one CPU thread: on
a GPU the step waits on Python, not on the weights (``../GPU.md``: 27-36 ms a step of an 8B
model whose weights need 3.7 ms). vLLM and SGLang capture decode steps as CUDA graphs; so does
this module:

- Buckets: 1, 2, 4, 8, then every 8 up to ``max_batch``. A step of ``B`` requests runs the
  graph of the smallest bucket ``>= B``; rows past ``B`` are padding (no keys, no writes).
- Each step the Rust plan is made and checked as usual (a stale step is refused before
  anything is written), then :class:`~radixkv.kv.static_step.DecodeBuffers` takes its arrays in
  one host-to-device copy and the bucket's graph replays the model's forward over a
  :class:`~radixkv.kv.static_step.StaticDecodeStep` (pool writes, the Triton decode kernel,
  the logits). Sampling runs on the graph's logits as on any step's, so grammar masks,
  penalties and logprobs apply after the graph unchanged.
- Captured when the engine is made, every bucket, largest first, all in one memory pool (the
  largest bucket's activations are allocated first and the smaller ones reuse them), over
  buffers sized once for the longest request the pool or the model allows
  (:func:`buffer_pages`): nothing is captured again while serving. Each bucket first runs once
  eagerly on a side stream over padding rows (no keys, nothing written), which compiles the
  Triton kernels, under ``torch.cuda.set_sync_debug_mode("error")``: a forward that waits for
  the device fails there. A bucket whose warm-up or capture fails is counted
  (``capture_failures``, each reason in ``failures``) and its steps run eagerly; no step is
  captured mid-serving. A model compiled with ``torch.compile`` (``radixkv.hf.engine(...,
  compile=True)``) is compiled by one more run before that warm-up, outside the sync check.
- Eager (the ordinary path): prefill and mixed steps, batches past the largest bucket, steps
  with host-tier copies in flight or a request longer than the buffers, buckets whose capture
  failed; and no graphs at all for pools with a window group or whose attention is not
  Triton's.

On the CPU nothing is captured: ``cuda_graphs=True`` runs the same static-buffer step eagerly
(under Triton's interpreter), which is how its exactness is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from radixkv.kv.static_step import DecodeBuffers, StaticDecodeStep


def buckets(max_batch: int) -> list[int]:
    """The padded batch sizes up to ``max_batch``: 1, 2, 4, 8, then every 8, and
    ``max_batch`` itself last."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch]
    b = 8
    while b < max_batch:
        b = min(b + 8, max_batch)
        out.append(b)
    if not out or out[-1] < max_batch:
        out.append(max_batch)
    return sorted(set(out))


def why_not(kv: Any) -> str | None:
    """Why decode steps over ``kv`` cannot run as graphs, or ``None`` when they can."""
    backend = kv.backend_for(True, 1)
    if not backend.static_decode:
        return (
            f"its attention is {kv.attention!r}, whose decode steps run {backend.name!r} on "
            f"{kv.device}: graphs replay the Triton decode kernel"
        )
    if kv.window_layers:
        return "its window layers read a window pool of their own"
    return None


def buffer_pages(kv: Any, model: Any) -> int:
    """Pages a request's row of the graph buffers holds: as many as the longest request can
    have, the pool's page count or the model's context (``config.max_position_embeddings``)
    in pages, whichever is smaller. Sized once: the graphs read these buffers by address."""
    pages = int(kv.num_pages)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:
        pages = min(pages, -(-context // kv.page_size))
    return max(pages, 1)


def capture_order(bucket_sizes: list[int]) -> list[int]:
    """The order buckets are captured in: largest first, so the memory pool they share is
    sized by the largest and every smaller one reuses its blocks."""
    return sorted(bucket_sizes, reverse=True)


@contextlib.contextmanager
def syncs_raise(device: torch.device) -> Iterator[None]:
    """Within: any operation that makes the host wait for ``device`` raises (CUDA's sync debug
    mode), so a warm-up that would sync is caught before its capture."""
    if device.type != "cuda":
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


class DecodeGraphs:
    """The decode graphs of one engine (see the module), captured when it is made (on CUDA)
    over buffers of :func:`buffer_pages` pages a request."""

    def __init__(self, model: Any, kv: Any, max_batch: int) -> None:
        why = why_not(kv)
        if why is not None:
            raise ValueError(f"cuda_graphs needs a pool whose decode steps run Triton: {why}")
        self.model, self.kv = model, kv
        self.buckets = buckets(max_batch)
        self.capture = kv.device.type == "cuda"
        self.buffers = DecodeBuffers(kv, self.buckets[-1], buffer_pages(kv, model))
        self._steps = {b: StaticDecodeStep(self.buffers, b) for b in self.buckets}
        self._graphs: dict[int, Any] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._pool: Any = None
        #: Decode steps run on the static buffers (replayed, or run eagerly on the CPU), steps
        #: taken eagerly because they did not fit, and graphs captured.
        self.replays = 0
        self.eager = 0
        self.captures = 0
        #: Steps that replayed a captured graph.
        self.graph_replays = 0
        #: Buckets whose warm-up or capture failed, each failure's reason, and the first
        #: reason (None while none failed).
        self.capture_failures = 0
        self.failures: list[str] = []
        self.failed: str | None = None
        if self.capture:
            self.capture_all()

    def capture_all(self) -> None:
        """Captures every bucket's graph (:func:`capture_order`) over padding rows: the forward
        writes nothing and reads no keys. A failure is counted and warned about once."""
        self.buffers.pad(self.buckets[-1])
        for bucket in capture_order(self.buckets):
            try:
                self._capture(bucket, self._steps[bucket])
            except Exception as e:  # a forward that syncs or allocates on the host, say
                reason = f"bucket {bucket}: {type(e).__name__}: {e}"
                self.capture_failures += 1
                self.failures.append(reason)
                if self.failed is None:
                    self.failed = reason
        if self.failures:
            warnings.warn(
                f"{len(self.failures)} of {len(self.buckets)} decode graphs were not captured "
                f"and their batch sizes decode eagerly (first: {self.failed})",
                RuntimeWarning,
                stacklevel=3,
            )

    def fits(self, step: Any) -> bool:
        """Whether ``step`` runs here (a decode step within the largest bucket and the buffers'
        pages, with no tier copies in flight, whose bucket was captured on CUDA)."""
        ok = (
            step.is_decode
            and len(step.requests) <= self.buckets[-1]
            and step.max_pages <= self.buffers.max_pages
            and step._copy_events is None
            and (not self.capture or self.bucket_of(len(step.requests)) in self._graphs)
        )
        if not ok:
            self.eager += 1
        return bool(ok)

    def bucket_of(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def run(self, step: Any) -> torch.Tensor:
        """Float32 logits ``[B, vocab]`` of the decode ``step`` through its bucket's graph
        (on the CPU, its static step run eagerly). ``step`` must :meth:`fit`."""
        step.check_current()  # a stale step is refused before the buffers or the pool change
        b = len(step.requests)
        bucket = self.bucket_of(b)
        self.buffers.fill(step, bucket)
        self.replays += 1
        if not self.capture:
            return self.model(self._steps[bucket])[:b]
        self._graphs[bucket].replay()
        self.graph_replays += 1
        return self._logits[bucket][:b]

    def _capture(self, bucket: int, static: StaticDecodeStep) -> None:
        """Runs the bucket once eagerly on a side stream with syncs raising (compiling what it
        launches), then captures it into the shared pool."""
        device = self.kv.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            if getattr(self.model, "compiled", None) is not None:
                self.model(static)  # torch.compile's first call compiles, and may wait
            with syncs_raise(device):
                self.model(static)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._logits[bucket] = self.model(static)
        self._graphs[bucket] = graph
        self.captures += 1
