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
- Captured lazily, the first time a bucket is needed (one eager run first, which also compiles
  the Triton kernels), all buckets in one memory pool. A model whose forward cannot be
  captured (a host sync inside it, say) is warned about once and decodes eagerly from then on.
- Eager (the ordinary path): prefill and mixed steps, batches past the largest bucket, steps
  with host-tier copies in flight; and no graphs at all for pools with a window group or whose
  attention is not Triton's.

On the CPU nothing is captured: ``cuda_graphs=True`` runs the same static-buffer step eagerly
(under Triton's interpreter), which is how its exactness is tested without a GPU.
"""

from __future__ import annotations

import warnings
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


class DecodeGraphs:
    """The decode graphs of one engine (see the module). The buffers hold as many pages a
    request as the longest request so far needs (a power of two, at least 16): a longer one
    grows them, and the graphs are captured again."""

    def __init__(self, model: Any, kv: Any, max_batch: int) -> None:
        why = why_not(kv)
        if why is not None:
            raise ValueError(f"cuda_graphs needs a pool whose decode steps run Triton: {why}")
        self.model, self.kv = model, kv
        self.buckets = buckets(max_batch)
        self.capture = kv.device.type == "cuda"
        self.buffers: DecodeBuffers | None = None
        self._steps: dict[int, StaticDecodeStep] = {}
        self._graphs: dict[int, Any] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self._pool: Any = None
        #: Decode steps replayed (or run on the static buffers, on the CPU), steps taken
        #: eagerly because they did not fit, and graphs captured.
        self.replays = 0
        self.eager = 0
        self.captures = 0
        #: Steps that replayed a captured graph (``replays`` also counts the steps that
        #: captured one, or failed to, and the CPU's static steps).
        self.graph_replays = 0
        #: Why a capture failed (every step eager since), or None.
        self.failed: str | None = None

    def _buffers(self, pages: int) -> DecodeBuffers:
        """Buffers holding ``pages`` pages a request; new ones (and no graphs) when they grow."""
        if self.buffers is None or pages > self.buffers.max_pages:
            width = min(max(16, 1 << max(pages - 1, 0).bit_length()), self.kv.num_pages)
            self.buffers = DecodeBuffers(self.kv, self.buckets[-1], width)
            self._steps.clear()
            self._graphs.clear()
            self._logits.clear()
        return self.buffers

    def fits(self, step: Any) -> bool:
        """Whether ``step`` runs here (a decode step within the largest bucket, with no tier
        copies in flight, while no capture has failed)."""
        ok = (
            self.failed is None
            and step.is_decode
            and len(step.requests) <= self.buckets[-1]
            and step._copy_events is None
        )
        if not ok:
            self.eager += 1
        return bool(ok)

    def bucket_of(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def run(self, step: Any) -> torch.Tensor:
        """Float32 logits ``[B, vocab]`` of the decode ``step`` through its bucket's graph."""
        step.check_current()  # a stale step is refused before the buffers or the pool change
        b = len(step.requests)
        bucket = self.bucket_of(b)
        buffers = self._buffers(step.max_pages)
        buffers.fill(step, bucket)
        static = self._steps.get(bucket)
        if static is None:
            static = self._steps[bucket] = StaticDecodeStep(buffers, bucket)
        self.replays += 1
        if not self.capture:
            return self.model(static)[:b]
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._capture(bucket, static)[:b]
        graph.replay()
        self.graph_replays += 1
        return self._logits[bucket][:b]

    def _capture(self, bucket: int, static: StaticDecodeStep) -> torch.Tensor:
        """Runs the bucket once eagerly on a side stream (compiling what it launches; its
        writes are the ones the step makes), then captures it."""
        stream = torch.cuda.Stream(device=self.kv.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(stream):
            logits = self.model(static)
        torch.cuda.current_stream(self.kv.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._logits[bucket] = self.model(static)
        except Exception as e:  # a forward that syncs or allocates on the host, say
            # The step itself ran above: its logits stand; every later step runs eagerly.
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"decode steps run eagerly: capturing a CUDA graph of the model's forward "
                f"failed ({self.failed})",
                RuntimeWarning,
                stacklevel=4,
            )
            return logits
        self._graphs[bucket] = graph
        self.captures += 1
        return logits
