"""Continuous batching over the prefix cache: requests in, tokens out.

- :class:`Engine` (:mod:`radixkv.engine.engine`): owns the model, the KV tensors, the sequences
  and sampling; one forward pass per :meth:`Engine.step`.
- :class:`Batcher` (:mod:`radixkv.engine.batcher`): the step packer: the waiting queue (the Rust
  ``Scheduler``), running and held sequences, chunked prefill, preemption.
- :class:`Sequence` / :class:`Result` / :class:`StreamEvent` (:mod:`radixkv.engine.sequence`):
  one request's state, its report and what its ``on_token`` callback receives;
  :mod:`radixkv.engine.sampling`: token validation and sampling (the knobs: :class:`Sampling`);
  :mod:`radixkv.engine.detok`: incremental detokenization and stop strings
  (:class:`Detokenizer`).
- :class:`Session` (:mod:`radixkv.engine.session`): a multi-turn conversation on an engine.
- :mod:`radixkv.engine.lockstep`: tensor-parallel ranks in lockstep (``Engine(group=...)``):
  the broadcast of rank 0's calls, the divergence checks (:class:`DivergedError`) and
  :func:`agree_num_pages`.
"""

from radixkv.engine.batcher import Batcher
from radixkv.engine.detok import Detokenizer
from radixkv.engine.engine import Engine, EngineStats
from radixkv.engine.lockstep import DivergedError, agree_num_pages
from radixkv.engine.sampling import Sampling
from radixkv.engine.sequence import Result, Sequence, Status, StreamEvent
from radixkv.engine.session import Session

__all__ = [
    "Batcher",
    "Detokenizer",
    "DivergedError",
    "Engine",
    "EngineStats",
    "Result",
    "Sampling",
    "Sequence",
    "Session",
    "Status",
    "StreamEvent",
    "agree_num_pages",
]
