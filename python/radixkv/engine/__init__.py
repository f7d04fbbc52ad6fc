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
- :class:`RequestParams` (:mod:`radixkv.engine.params`): every per-request knob (sampling,
  stops, logprobs, grammar, seed, priority, namespace, retention), documented and checked once;
  ``submit``, ``branch``, ``generate``, ``chat``, ``stream`` and ``Session`` take it as
  ``params=`` or build it from their keyword options.
- :class:`Session` (:mod:`radixkv.engine.session`): a multi-turn conversation on an engine.
- :class:`Grammar` (:mod:`radixkv.engine.grammar`): structured output (``grammar=``): JSON
  schemas, regexes and Lark grammars compiled by llguidance, token masks, jump-forward.
- :mod:`radixkv.engine.defaults`: the defaults every entry point shares (admission policy, new
  tokens per request) and why, and the in-batch prefix sharing threshold.
- :mod:`radixkv.engine.outcome`: what a sampled token does to its request (grammar tokens,
  logprobs, text and stop strings, events, the end); :mod:`radixkv.engine.fetch`: a waiting
  prompt's pages brought back from the disk and shared tiers (the batcher's).
- :mod:`radixkv.engine.replay`: rank 0 records its calls, the other ranks replay them (a
  handler table the engine gives); :mod:`radixkv.engine.lockstep`: tensor-parallel ranks in
  lockstep (``Engine(group=...)``): the broadcast of rank 0's calls, the divergence checks
  (:class:`DivergedError`) and :func:`agree_num_pages`.
"""

from radixkv._extras import require_torch

require_torch("radixkv.engine")

from radixkv.engine.batcher import Batcher  # noqa: E402
from radixkv.engine.detok import Detokenizer  # noqa: E402
from radixkv.engine.engine import Engine, EngineStats  # noqa: E402
from radixkv.engine.grammar import Grammar  # noqa: E402
from radixkv.engine.lockstep import DivergedError, agree_num_pages  # noqa: E402
from radixkv.engine.params import RequestParams  # noqa: E402
from radixkv.engine.sampling import Sampling  # noqa: E402
from radixkv.engine.sequence import Result, Sequence, Status, StreamEvent  # noqa: E402
from radixkv.engine.session import Session  # noqa: E402

__all__ = [
    "Batcher",
    "Detokenizer",
    "DivergedError",
    "Engine",
    "EngineStats",
    "Grammar",
    "RequestParams",
    "Result",
    "Sampling",
    "Sequence",
    "Session",
    "Status",
    "StreamEvent",
    "agree_num_pages",
]
