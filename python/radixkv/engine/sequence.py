"""`Sequence`: one generation request inside the engine, and `Result`, what it reports.

A sequence's *target* is every token whose KV the next logits need: the prompt, then each sampled
token once it is known. Its cache ``Request`` holds a prefix of the target:

```text
  target:   [ prompt ....................................... | out_0 out_1 ... ]
  req:      [ cached | computed | pending (this step) ]  (not admitted yet)
            0     num_cached  num_computed        num_tokens              len(target)
```

Each step computes the pending tokens; once ``num_tokens == len(target)`` the step's logits
belong to the target's last token and the next token is sampled. The sequence keeps its own copy
of ``num_tokens`` and ``num_computed`` (set at admission, advanced by what the engine extends and
commits), so the per-step loops never read them back from the cache.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    import radixkv
    from radixkv.engine.detok import Detokenizer
    from radixkv.engine.grammar import GrammarState


@dataclass(frozen=True)
class Sampling:
    """The checked sampling knobs of one request (every default is "off"); picklable, so the
    tensor-parallel broadcast carries it. ``stop_strings`` is read by the detokenizer."""

    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    stop_strings: tuple[str, ...] = ()
    #: The most likely tokens reported with each output token's logprob (0: none).
    top_logprobs: int = 0
    #: OpenAI's ``logit_bias``: ``(token id, bias)`` pairs added to the logits before
    #: anything else, sorted by id, zeros left out (empty: off).
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def filtered(self) -> bool:
        """Whether a filter (``top_k``, ``top_p``, ``min_p``) is on."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def used(self, temperature: float) -> bool:
        """Whether a row of this request needs more than the plain path (argmax, or softmax
        and a draw): a penalty, a logit bias, logprobs, or a filter of a sampled
        (``temperature > 0``) row."""
        return (
            self.penalized
            or bool(self.logit_bias)
            or self.logprobs
            or (temperature > 0 and self.filtered)
        )


#: Every knob off.
OFF = Sampling()


@dataclass
class DraftState:
    """One request's speculative drafting (:mod:`radixkv.engine.speculative`): its next
    draft's length, its drafts in a row that had none accepted, the steps left in its pause
    and the pauses so far (each twice as long as the one before)."""

    k: int
    misses: int = 0
    pause: int = 0
    pauses: int = 0


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"  # queued for admission (new, or preempted)
    RUNNING = "running"  # holds a cache request; scheduled every step until done
    HELD = "held"  # a branch context, computed and pinned until its branches are admitted
    FINISHED = "finished"


@dataclass(frozen=True)
class Result:
    """What one request reports. Times are seconds; ``ttft_s`` is None for a request that
    generates nothing (``max_new_tokens=0``, a branch context) or ended without a token.

    ``cached_tokens``: prompt tokens whose KV came from the cache at its first admission.
    ``computed_tokens``: tokens computed until the first token was sampled (the prefill work,
    recomputation after a preemption included); ``total_computed_tokens`` adds decode steps.
    ``finish_reason``: ``"stop"``, ``"length"``, ``"cancelled"``, ``"context"`` (a branch
    context) or ``"error"``: the forward pass of a step that held it, its sampling, or a cache
    or scheduler call made for it raised an exception, or it made no progress for
    ``Engine.max_stalled_steps`` steps (a ``radixkv.Error`` saying what blocks it); ``error``
    holds the exception (None for every other reason). A failed request keeps the tokens it
    generated before. A request the pool could never hold is refused when it is submitted.

    ``logprobs``: with ``logprobs=True``, the log-probability of each output token (see
    :mod:`radixkv.engine.sampling`), else None. ``text``: with ``Engine(tokenizer=...)``, the
    decoded output (special tokens skipped, cut before a stop string, never the bytes of an
    unfinished UTF-8 character), else None. A request ended by a stop string reports
    ``finish_reason="stop"``; its ``output`` holds every token sampled, the one that completed
    the stop string included.

    With ``grammar=``: ``finish_reason="stop"`` once the grammar is complete (its output then
    parses), ``"length"`` when ``max_new_tokens`` came first, ``"error"`` when the grammar left
    no token to sample; ``output`` holds the forced tokens too (``forced_tokens`` of them; their
    logprob is 0.0).
    """

    id: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    total_computed_tokens: int
    output: list[int]
    ttft_s: float | None
    latency_s: float
    preemptions: int
    finish_reason: str
    error: BaseException | None = None
    logprobs: list[float] | None = None
    text: str | None = None
    #: Output tokens a grammar forced (jump-forward appended them without a decode step).
    forced_tokens: int = 0
    #: The prefix cache's retention of this request's pages (``retain=``), or None.
    retention: int | None = None
    #: With ``top_logprobs=k``: for each output token, the ``k`` most likely tokens at its
    #: position as ``(token, logprob)``, most likely first (empty for a forced token), else None.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: Seconds from submission to its first admission (its time in the queue, as vLLM's
    #: ``request_queue_time``); None when it was never admitted.
    queue_s: float | None = None


@dataclass(frozen=True)
class StreamEvent:
    """What ``on_token`` receives: one event per sampled token, the last one with
    ``finish_reason`` set.

    ``id``: the request (a branch's own id). ``token``: the sampled token; None in a final event
    that came with no token (a request cancelled, failed, or of ``max_new_tokens=0``): a
    request that ends on a sampled token (a stop token or string, its length) gets that token's
    event as its final one, so N tokens make N events. ``text``: the text that became final
    with this event ('' while held back: the first bytes of a character, text that may become
    a stop string; always '' without a tokenizer); a final event carries whatever was held
    back, so the texts of a request's events concatenate to ``Result.text``. ``logprob``: the
    token's log-probability with ``logprobs=True``, else None. ``finish_reason``: None until
    the final event, then as ``Result.finish_reason``.
    """

    id: int
    token: int | None
    text: str
    logprob: float | None
    finish_reason: str | None
    #: With ``top_logprobs=k``: the ``k`` most likely tokens at this token's position, as
    #: ``(token, logprob)``, most likely first; else None.
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request (see the module docstring for the index ranges)."""

    id: int
    prompt: np.ndarray
    max_new_tokens: int
    temperature: float = 0.0
    stop: frozenset[int] = frozenset()
    namespace: str | bytes | None = None
    seed: int = 0
    priority: int = 0
    parent: Sequence | None = None
    children: list[Sequence] = field(default_factory=list)

    #: Namespace the engine admits under (``namespace``, or a private one with caching off).
    cache_namespace: str | bytes | None = None
    status: Status = Status.WAITING
    req: radixkv.Request | None = None
    #: ``req.num_tokens`` and ``req.num_computed``, tracked here (0 while no request is open).
    num_tokens: int = 0
    num_computed: int = 0
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    #: The exception that failed this sequence (``finish_reason == "error"``).
    error: BaseException | None = None
    admissions: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    total_computed_tokens: int = 0
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    #: When it was first admitted (its queue time ends), and when its last token was sampled.
    admitted_at: float | None = None
    last_token_at: float | None = None
    #: Seconds between each sampled token and the one before (inter-token latency, read by
    #: the metrics when it finishes).
    token_gaps: list[float] = field(default_factory=list, repr=False)
    #: This sequence's own random generator (temperature sampling), made on first use.
    generator: torch.Generator | None = field(default=None, repr=False)
    _target: np.ndarray | None = field(default=None, repr=False)
    #: The sampling knobs when a row of it needs them (see ``Sampling.used``), else None.
    sampling: Sampling | None = None
    #: Stop strings (read by the detokenizer; rank 0 decides them under tensor parallelism).
    stop_strings: tuple[str, ...] = ()
    #: Each output token's logprob (``logprobs=True``), else None.
    logprobs: list[float] | None = None
    #: Each output token's most likely alternatives (``top_logprobs=k``), else None.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: The alternatives of the token sampled last (set by the sampler, read by the engine).
    last_top: list[tuple[int, float]] | None = field(default=None, repr=False)
    #: Rank 0: the streaming callback until its final event (or until it raised).
    on_token: Callable[[StreamEvent], object] | None = field(default=None, repr=False)
    #: Rank 0 with a tokenizer: the text of the output.
    detok: Detokenizer | None = field(default=None, repr=False)
    #: The distinct token ids of the prompt (int64), for the repetition penalty.
    prompt_ids: torch.Tensor | None = field(default=None, repr=False)
    #: Structured output: the request's matcher (``grammar=``), else None.
    grammar: GrammarState | None = field(default=None, repr=False)
    #: Output tokens its grammar forced (appended by jump-forward).
    forced_tokens: int = 0
    #: What its finish asks of the prefix cache: seconds its pages stay retained (0: none)
    #: and their eviction class; the retention made, if any.
    retain: float = 0.0
    cache_class: int = 0
    retention: int | None = None
    #: Speculative decoding: the draft tokens this step computes after its token (set by the
    #: engine, cut by the batcher; empty: none), and its drafter's state.
    draft: list[int] = field(default_factory=list, repr=False)
    #: Of this step's draft, the tokens the target accepted (set when it is verified).
    accepted: int = field(default=0, repr=False)
    spec: DraftState | None = field(default=None, repr=False)

    @property
    def target(self) -> np.ndarray:
        """The prompt and every sampled token so far (uint32)."""
        if self._target is None or len(self._target) != len(self.prompt) + len(self.output):
            out = np.asarray(self.output, dtype=np.uint32)
            self._target = np.concatenate([self.prompt, out])
        return self._target

    def tokens(self, start: int, n: int) -> np.ndarray | list[int]:
        """``target[start : start + n]``: uint32, or for a chunk inside the output (every
        decode step's) a slice of the output list, which the cache takes as it is: building the
        whole target each step would copy the context, tens of thousands of tokens for an
        agent, per request per step, and an array of one token costs more than the list."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p : start - p + n]
        return self.target[start : start + n]

    @property
    def target_len(self) -> int:
        """``len(target)``, without building the target."""
        return len(self.prompt) + len(self.output)

    @property
    def remaining_new_tokens(self) -> int:
        """Tokens it may still generate."""
        return max(self.max_new_tokens - len(self.output), 0)

    @property
    def done(self) -> bool:
        """Whether the sequence has finished (for any reason)."""
        return self.status is Status.FINISHED

    def record_token(self, token: int, now: float) -> None:
        """Appends a sampled token; ends the sequence on a stop token or at its length limit."""
        self.output.append(token)
        if self.first_token_at is None:
            self.first_token_at = now
        if self.last_token_at is not None:
            self.token_gaps.append(now - self.last_token_at)
        self.last_token_at = now
        if token in self.stop:
            self.finish_reason = "stop"
        elif len(self.output) >= self.max_new_tokens:
            self.finish_reason = "length"

    def result(self) -> Result:
        """The report of this sequence (latency so far if it has not finished)."""
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        return Result(
            id=self.id,
            prompt_tokens=len(self.prompt),
            cached_tokens=self.cached_tokens,
            computed_tokens=self.computed_tokens,
            total_computed_tokens=self.total_computed_tokens,
            output=list(self.output),
            ttft_s=ttft,
            latency_s=end - self.arrival,
            preemptions=self.preemptions,
            finish_reason=self.finish_reason or self.status.value,
            error=self.error,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            text=None if self.detok is None else self.detok.text,
            forced_tokens=self.forced_tokens,
            retention=self.retention,
            top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
            queue_s=None if self.admitted_at is None else self.admitted_at - self.arrival,
        )
