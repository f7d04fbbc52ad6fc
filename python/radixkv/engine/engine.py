"""`Engine`: continuous batching over a prefix cache.

Requests come in through :meth:`Engine.submit` (one prompt), :meth:`Engine.branch` (N branches
of one context) or a :class:`radixkv.Session` (multi-turn). Every :meth:`Engine.step` is one
forward pass: the :class:`~radixkv.engine.batcher.Batcher` packs a batch under the token budget
(decodes, prefill chunks, admissions through the Rust scheduler, preemption), then one
``kv.plan``, one model forward, one ``kv.commit``, and sampling for every sequence whose whole
target is now computed. The engine owns the model, the KV tensors, the sequences and sampling;
the batcher owns the queue and the cache requests. A step crosses into Rust a fixed number of
times, however many requests it holds (admissions and ends aside, once per request).

Failures: every argument is checked when a request is made (``ValueError`` naming it, nothing
registered). A forward pass (or plan, or commit) that raises ends every request of its batch
with ``finish_reason="error"`` and the exception in ``Result.error``, their cache requests
aborted; a row whose sampling fails (NaN logits, say) ends that request alone. Requests outside
the failed batch run on. An interrupt (``KeyboardInterrupt``) during a forward pass puts the
batch back in the queue, as a preemption does, and propagates; the next ``run()`` resumes.

A cache or scheduler call made for one request while a step is packed or a request ends
(``extend``, ``finish``, ``abort``, ``Scheduler.add``) that raises ``radixkv.OutOfPages``,
``radixkv.InvalidRequest`` or ``ValueError`` ends that request alone with
``finish_reason="error"`` and the exception (its cache request aborted; see
:mod:`radixkv.engine.batcher`); it is among the results of the step. Any other exception while a
step is packed (a bug) propagates after the packed requests are put back in the queue, so the
engine stays usable: the next ``run()`` resumes.

No progress: a step that computes nothing and ends no request while requests are pending (they
can wait for pages that requests opened outside this engine pin, on a cache it shares, or for an
admission the scheduler keeps refusing) is counted; after :attr:`Engine.max_stalled_steps` such
steps in a row, every unfinished request ends with ``finish_reason="error"`` and a
``radixkv.Error`` naming the request, why it is stuck and the state of the pool (the
scheduler's last exception as its ``__cause__``), so :meth:`Engine.run` returns instead of
spinning.

Sampling, text and streaming: the knobs of :meth:`Engine.submit` (``top_p``, ``top_k``,
``min_p``, the penalties, ``logprobs``; see :mod:`radixkv.engine.sampling`) cost nothing to a
request that leaves them off. With ``Engine(tokenizer=...)`` every request's output is
detokenized as it grows (:mod:`radixkv.engine.detok`): ``Result.text``, and ``stop_strings``,
which end a request as soon as its text holds one (the text cut before it,
``finish_reason="stop"``). ``on_token`` gets a :class:`~radixkv.engine.sequence.StreamEvent`
per sampled token on the thread that runs :meth:`Engine.step` (the final one with
``finish_reason``; a request cancelled or failed gets a final event too, from
:meth:`Engine.cancel` or the step that failed it). An exception raised by ``on_token`` ends
that request alone with ``finish_reason="error"`` and the exception in ``Result.error``; it is
not called again for that request. :meth:`Engine.stream` yields one request's events.

Speculative decoding (``speculative=``, :mod:`radixkv.engine.speculative`): before each step
the drafter gives every decoding request a draft; the batcher plans it after the request's
token as one chunk; the model returns the logits of each row of that chunk; the drafts equal to
what the row gives (:func:`radixkv.engine.sampling.verify_draft`) and one token of the model's
own are recorded as sampled tokens one by one, and only those are committed (the rest given
back: ``KVCache.settle``).

Tensor parallelism (``group=``): one engine per rank, each over its shard of the model
(:meth:`radixkv.models.CausalLM.shard`) and its own ``KVCache``. Rank 0 takes the calls and
steps; the other ranks call :meth:`Engine.follow`, which replays rank 0's calls (broadcast at
each step) and steps in lockstep until rank 0 calls :meth:`Engine.close`. Every rank makes the
same decisions (``docs/DETERMINISM.md``), so ids and results agree; mismatches are detected
(see :mod:`radixkv.engine.lockstep`) and raise ``radixkv.Error`` on every rank.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

import radixkv
from radixkv.engine.batcher import Batcher
from radixkv.engine.chat import render as render_chat
from radixkv.engine.defaults import DEFAULT_MAX_NEW_TOKENS, DEFAULT_POLICY
from radixkv.engine.detok import CONTEXT_TOKENS, Detokenizer
from radixkv.engine.fetch import TierFetch
from radixkv.engine.grammar import Compiler, Grammar, apply_masks, compiler_for
from radixkv.engine.graphs import DecodeGraphs, why_not
from radixkv.engine.lockstep import Lockstep, check_same_config
from radixkv.engine.outcome import Outcome, mask, notify_end
from radixkv.engine.params import (
    MIN_TEMPERATURE as MIN_TEMPERATURE,  # re-exported: where it was
)
from radixkv.engine.params import (
    RequestParams,
    check_keep,
    check_logit_bias,
    check_namespace,
    check_seeds,
    check_stop,
    defaults,
    field_names,
)
from radixkv.engine.replay import Replay
from radixkv.engine.sampling import OFF, sample_tokens, to_token_array, verify_draft
from radixkv.engine.sequence import Result, Sequence, Status, StreamEvent
from radixkv.engine.speculative import Drafter
from radixkv.engine.states import EngineStates, engine_states
from radixkv.kv.kv_cache import KVCache
from radixkv.spec_config import SpecConfig


@dataclass
class EngineStats:
    """Counters and wall time per phase, summed over every step so far."""

    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    max_step_tokens: int = 0
    max_step_requests: int = 0
    schedule_s: float = 0.0
    plan_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    #: Structured output: time computing and applying token masks (part of ``sample_s``),
    #: tokens jump-forward appended without sampling them, and the chunks they came in.
    mask_s: float = 0.0
    forced_tokens: int = 0
    jumps: int = 0
    #: Disk tier: prompt tokens read back from disk (at submit and at the queue's head), the
    #: time it took, and the reads that failed.
    disk_tokens: int = 0
    disk_s: float = 0.0
    disk_errors: int = 0
    #: Shared tier: prompt tokens installed from the shared store (fetched off the step), apart
    #: from the disk's (``disk_s`` holds the time both took on the engine's thread).
    shared_tokens: int = 0
    #: Speculative decoding (vLLM's meanings): drafts verified (one per request and step that
    #: carried one), draft tokens verified, draft tokens accepted, and accepted tokens by
    #: position in the draft (``spec_accepted_per_pos[j]``: drafts whose token ``j`` was
    #: accepted).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    #: A hybrid model's recurrent-state snapshots (:mod:`radixkv.engine.states`): snapshots
    #: restored into a request's state at admission, the prompt tokens those hits covered,
    #: snapshots taken, and snapshots the cache evicted (for a slot, with a page they needed, or
    #: as damaged) since the engine started, as of the last step.
    state_restored: int = 0
    state_hit_tokens: int = 0
    state_taken: int = 0
    state_evicted: int = 0


class Engine:
    """Continuous batching of generation requests over ``model`` and its paged ``kv``.

    ``token_budget``: tokens computed per step at most (prefill chunks and decodes together); a
    prompt longer than that is prefilled in chunks over several steps. ``max_batch``: requests
    per step at most. ``prefix_caching=False`` turns reuse off while keeping everything else
    identical: each admission goes to a private namespace of its own, so no prompt ever finds a
    cached prefix. ``policy``: the admission order of the :class:`radixkv.Scheduler` every
    waiting request is queued in: ``"lpm"`` (longest cached prefix first, the default, as the
    Scheduler's; why: :data:`radixkv.engine.defaults.DEFAULT_POLICY`), ``"fcfs"`` (arrival
    order) or ``"dfs-weight"``; ``max_wait`` bounds how many steps a request waits behind
    others (0: no bound). Under ``"lpm"`` and ``"dfs-weight"``, requests that share an uncached
    prefix of at least 64 tokens (one scheduler chunk, rounded up to whole pages:
    :func:`radixkv.engine.defaults.sharing_threshold`) are admitted one step apart, so the
    prefix is computed once; a shorter shared prefix is computed by each.

    ``kv`` must be shaped for ``model``: a model that states its KV shape (``model.kv_shape``,
    ``(layers, KV heads, head dim)``: :class:`radixkv.models.CausalLM`, ``radixkv.hf``'s
    models) is checked against ``kv`` here, a ``ValueError`` naming both shapes.

    ``sequences`` holds every request submitted and not yet released, finished ones included
    (their results stay readable with :meth:`result`). A long-running server releases what it
    has read with :meth:`release` (given ids) or :meth:`forget_finished` (every finished
    request), or passes ``release=True`` to :meth:`run`/:meth:`generate`, so memory stays flat.
    ``release_hooks``: callables given the list of sequences about to be released (a metrics
    exporter folds them into its totals).

    Failures and the no-progress guard: see the module docstring. Stuck requests are failed
    (``finish_reason="error"``, ``Result.error`` a ``radixkv.Error`` saying what blocks them)
    rather than raised, so that the results of every other request stay readable and the
    engine stays usable: a request submitted once the pages are free runs as usual.

    ``group``: a ``torch.distributed`` process group for tensor parallelism (see the module
    docstring); every rank builds its engine with equal settings and pool (checked here,
    collectively: ``ValueError`` on every rank naming what differs). Rank 0 alone takes
    ``submit``, ``branch``, ``cancel``, ``generate``, ``run``, ``step`` and ``release`` (the
    others raise ``radixkv.Error``) and ends with :meth:`close`; the others call
    :meth:`follow`. ``digest_every``: every that many steps the ranks compare their caches'
    ``state_digest()`` (0: never; the step number and batch shape are compared every step).
    ``check_tokens``: compare the sampled token ids after every step too.

    ``stop_tokens``: the token ids a request stops at when ``submit`` is given no ``stop``.
    ``tokenizer``: the model's tokenizer (a transformers tokenizer, or any object with its
    ``decode(ids, skip_special_tokens=...)``), for ``Result.text`` and ``stop_strings`` (see
    the module docstring); nothing else needs it. Under tensor parallelism rank 0's is used
    (rank 0 decides where a stop string ends a request and tells the other ranks), but
    ``grammar=`` needs it on every rank (each rank masks its own logits).

    ``cuda_graphs``: run decode steps as CUDA graphs, one per padded batch bucket
    (:mod:`radixkv.engine.graphs`); ``None`` (the default) turns them on where they can run (a
    CUDA pool whose decode attention is Triton's, no window group, one process), ``True``
    demands them (``ValueError`` saying why where they cannot run; on the CPU the same
    static-buffer steps run without a graph, for tests), ``False`` keeps every step eager.
    Tokens are the same either way.

    ``speculative``: speculative decoding without a draft model (:mod:`radixkv.engine.speculative`),
    a dict of vLLM's ``speculative_config`` keys: ``method`` (``"ngram"``: prompt lookup over the
    request's tokens; ``"suffix"``: what the prefix cache holds after them in the request's
    namespace, then prompt lookup), ``num_speculative_tokens`` (K >= 1, the most drafts a step
    verifies per request), ``prompt_lookup_min`` and ``prompt_lookup_max`` (default 1 and 4).
    Greedy outputs are the same as without it, token for token; sampled ones keep their
    distribution (rejection sampling with the request's own generator: a seed repeats, but
    draws other tokens than without speculation). A request with ``grammar=`` drafts what its
    grammar accepts, each row masked as the grammar stands after the drafts before it. Under
    tensor parallelism rank 0 drafts and tells the other ranks, and how many tokens each
    request kept (a stop string only rank 0 sees may end it early).
    ``None`` (the default): off.
    """

    #: Steps in a row that may compute nothing and end no request while requests are pending
    #: before those requests fail (see the module docstring). Such a step is cheap (one
    #: scheduler call); the margin lets another user of a shared cache free its pages.
    max_stalled_steps: int = 64
    #: Structured output: append the tokens a request's grammar forces at once, computed as
    #: one chunk in the next step, instead of one decode step each (see
    #: :mod:`radixkv.engine.grammar`). Greedy text is the same either way.
    jump_forward: bool = True

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        token_budget: int = 2048,
        max_batch: int = 64,
        prefix_caching: bool = True,
        policy: str = DEFAULT_POLICY,
        max_wait: int = 256,
        group: object | None = None,
        digest_every: int = 16,
        check_tokens: bool = False,
        tokenizer: object | None = None,
        stop_tokens: Iterable[int] = (),
        cuda_graphs: bool | None = None,
        speculative: Mapping | SpecConfig | None = None,
    ) -> None:
        spec = SpecConfig.of(speculative)
        if cuda_graphs is not None and not isinstance(cuda_graphs, (bool, np.bool_)):
            raise ValueError(f"cuda_graphs must be None, True or False, got {cuda_graphs!r}")
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(
                "tokenizer must be None or have a decode(ids, skip_special_tokens=...) method "
                f"(a transformers tokenizer), got {type(tokenizer).__name__}"
            )
        for name, value in (("token_budget", token_budget), ("max_batch", max_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(digest_every, bool) or not isinstance(digest_every, int) or digest_every < 0:
            raise ValueError(f"digest_every must be an int >= 0, got {digest_every!r}")
        if not isinstance(check_tokens, (bool, np.bool_)):
            raise ValueError(f"check_tokens must be a bool, got {check_tokens!r}")
        if not isinstance(prefix_caching, (bool, np.bool_)):
            raise ValueError(f"prefix_caching must be a bool, got {prefix_caching!r}")
        if not isinstance(kv, KVCache):
            raise ValueError(f"kv must be a radixkv.KVCache, got {type(kv).__name__}")
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(
                f"model must have config.vocab_size (a positive int), got {type(model).__name__}"
            )
        _check_kv_shape(model, kv)
        self.model, self.kv, self.cache = model, kv, kv.cache
        self.vocab_size: int = model.config.vocab_size
        self.token_budget, self.max_batch = token_budget, max_batch
        self.prefix_caching = bool(prefix_caching)
        self.tokenizer = tokenizer
        #: What a request stops at when its ``stop`` is left out (None): the model's
        #: end-of-sequence ids for ``radixkv.hf.engine``; ``stop=()`` stops at nothing.
        self.stop_tokens = check_stop(stop_tokens, self.vocab_size, "stop_tokens")
        self.stats = EngineStats()
        tiers = kv.disk is not None or kv.shared is not None
        self.batcher = Batcher(
            kv.cache,
            token_budget,
            max_batch,
            self.prefix_caching,
            policy,
            max_wait,
            fetch=TierFetch(kv, self.stats) if tiers and self.prefix_caching else None,
        )
        self.sequences: dict[int, Sequence] = {}
        self.release_hooks: list[Callable[[list[Sequence]], None]] = []
        #: The drafter of speculative decoding (``speculative=``), or None.
        self.speculative: SpecConfig | None = spec
        self.drafter: Drafter | None = None if spec is None else Drafter(spec, kv.cache)
        if spec is not None:
            self.stats.spec_accepted_per_pos = [0] * spec.num_speculative_tokens
        #: The cache's clock is seconds since this engine was made, advanced at every step
        #: once a request asked for retention.
        self._t0 = time.monotonic()
        self._retaining = False
        self._ids = itertools.count()
        self._stalled_steps = 0  # steps in a row without progress
        #: With a group: the collectives (:mod:`radixkv.engine.lockstep`).
        self.lockstep: Lockstep | None = None
        self._sampled: list[tuple[int, int]] | None = None
        if group is not None and kv.shared is not None:
            raise ValueError(
                "a KVCache with a shared tier cannot run tensor-parallel yet: the ranks' pages "
                "would need keys of their own, and one rank's miss would part the ranks"
            )
        #: Decode steps as CUDA graphs (:mod:`radixkv.engine.graphs`), or None.
        self.graphs: DecodeGraphs | None = None
        #: A hybrid model's recurrent states (:mod:`radixkv.engine.states`), or None.
        self.states: EngineStates | None = engine_states(model, kv, max_batch, spec, cuda_graphs)
        if self.states is not None:
            model.states = self.states  # what its forward reads each step's rows from
            self.batcher.states = self.states
            self.states.stats = self.stats
            cuda_graphs = False
        if cuda_graphs is None:  # on where they can run: CUDA, Triton decode, one process
            cuda_graphs = kv.device.type == "cuda" and group is None and why_not(kv) is None
        if cuda_graphs:
            if group is not None:
                raise ValueError("cuda_graphs=True cannot run tensor-parallel yet: pass False")
            self.graphs = DecodeGraphs(model, kv, max_batch)
        if group is not None and kv.disk is not None:
            raise ValueError(
                "a KVCache with a disk tier cannot run tensor-parallel yet: each rank would "
                "read its own directory, and one bad page on one rank would part the ranks"
            )
        if group is not None:
            self.lockstep = Lockstep(group, digest_every, bool(check_tokens))
            stats = kv.cache.stats
            check_same_config(
                self.lockstep,
                {
                    "cache kind": type(kv.cache).__name__,
                    "num_pages": stats.num_pages,
                    "page_size": stats.page_size,
                    "host_pages": kv.cache.host_pages,
                    "num_layers": kv.num_layers,
                    "KV dtype": str(kv.dtype),
                    "vocab_size": self.vocab_size,
                    "token_budget": token_budget,
                    "max_batch": max_batch,
                    "prefix_caching": self.prefix_caching,
                    "policy": policy,
                    "max_wait": max_wait,
                    "digest_every": digest_every,
                    "check_tokens": bool(check_tokens),
                    "max_stalled_steps": self.max_stalled_steps,
                    "speculative": None if spec is None else str(spec),
                    "cache state digest": kv.cache.state_digest(),
                },
            )
        #: Rank 0's record of its calls, the other ranks' replay (:mod:`radixkv.engine.replay`).
        self.replay = Replay(self.lockstep, self._handlers())

    # ---- tensor parallelism -----------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This engine's rank in its group (0 without one)."""
        return self.replay.rank

    def _lead(self, what: str) -> None:
        """Refuses ``what`` (a call that changes the engine) on ranks other than 0, after
        :meth:`close`, and once the ranks diverged (:meth:`Replay.lead`)."""
        self.replay.lead(what)

    def _record(self, call: tuple) -> None:
        """Rank 0: keeps ``call`` for the broadcast of the next step."""
        self.replay.record(call)

    def _handlers(self) -> dict[str, Callable[..., object]]:
        """What each call rank 0 records does when another rank replays it."""
        return {
            "submit": self._register,
            "branch": self._branch,
            "cancel": self._cancel,
            "release": lambda ids: self._drop([self._get(i) for i in ids]),
            "end": self._end,
            "clock": self._tick,
            "reset": lambda: self.cache.reset(),
            "unretain": lambda retention: self.cache.release_retention(retention),
            "retain": self._retain,
            "drafts": self._set_drafts,
        }

    def follow(self) -> int:
        """Ranks other than 0: replays rank 0's calls and steps in lockstep with it until rank
        0 calls :meth:`close`; returns the number of steps taken. Afterwards ``result(id)``
        gives what rank 0's does. Raises ``radixkv.Error`` when the ranks diverge or a rank's
        step fails (rank 0 raises it too; see :mod:`radixkv.engine.lockstep`), and
        ``LeaderClosedError`` at once once rank 0 closed."""
        return self.replay.follow(self._step_once)

    def close(self) -> None:
        """Rank 0: sends the calls taken since the last step (a release, say) and ends the other
        ranks' :meth:`follow`, whose last check it waits for (``DivergedError`` if a rank's
        last forward pass failed alone); the engine takes no more calls. A no-op without a
        group, on other ranks, and when closed already."""
        self.replay.close()

    # ---- requests in ------------------------------------------------------------------------

    def submit(
        self,
        prompt: Seq[int] | np.ndarray | torch.Tensor,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        stop: Iterable[int] | None = None,
        namespace: str | bytes | None = None,
        seed: int = 0,
        priority: int = 0,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: bool = False,
        stop_strings: Iterable[str] = (),
        top_logprobs: int = 0,
        logit_bias: Mapping[int, float] | None = None,
        on_token: Callable[[StreamEvent], object] | None = None,
        grammar: Grammar | dict | None = None,
        retain: float = 0.0,
        cache_priority: int = 0,
        params: RequestParams | None = None,
    ) -> int:
        """Queues one request; returns its id. ``params``: a :class:`RequestParams`, every knob
        of a request documented and checked there; or its fields as these arguments (the same
        names and defaults), from which one is built, not both (``TypeError``). Raises
        ``ValueError`` for a bad argument (naming it; nothing is registered) and for a request
        the pool could never hold (prompt and output together, but the last token).

        In short: ``temperature=0`` is greedy; generation ends at a token of ``stop`` (left
        out, the engine's ``stop_tokens``), at one of ``stop_strings`` in the text (needs
        ``Engine(tokenizer=...)``) or after ``max_new_tokens``; higher ``priority`` is
        admitted first; ``on_token`` gets a :class:`StreamEvent` per token and at the end, on
        the thread that steps the engine (see the module docstring); ``grammar`` constrains
        the output (the tokens it forces are appended at once: :attr:`jump_forward`; a request
        whose grammar leaves no token of the vocabulary ends with ``finish_reason="error"``);
        ``retain`` and ``cache_priority`` say what outlives the request in the prefix cache
        (the engine advances the cache's clock in seconds at every step)."""
        self._lead("submit")
        knobs = {n: v for n, v in locals().items() if n in _FIELDS}
        arr, checked, on_token = self._check_submit(prompt, RequestParams.of(params, **knobs))
        seq_id = self._register(arr, checked, on_token).id
        self._record(("submit", arr, checked))
        return seq_id

    def _check_submit(
        self, prompt, params: RequestParams, name: str = "prompt"
    ) -> tuple[np.ndarray, RequestParams, Callable[[StreamEvent], object] | None]:
        """Everything :meth:`submit` checks beyond what ``params`` checked itself, registering
        nothing: the prompt, then :meth:`_resolve`; returns the prompt's array, the resolved
        params and the request's ``on_token``."""
        arr = to_token_array(prompt, name, self.vocab_size)
        checked = self._resolve(params)
        self.batcher.check_fits(name, len(arr), checked.max_new_tokens)
        return arr, checked, params.on_token

    def _resolve(self, params: RequestParams, num_seeds: int = 1) -> RequestParams:
        """``params`` checked against this engine (token ids against its vocabulary, what needs
        its tokenizer, the seeds of ``num_seeds`` branches, the grammar compiled) and resolved
        as every rank replays it: ``stop`` the engine's ``stop_tokens`` when None, ``grammar``
        a :class:`Grammar`, no ``on_token`` (rank 0 keeps the callback)."""
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(
                "stop_strings need a tokenizer to decode the output: make the engine with "
                "Engine(..., tokenizer=...) or radixkv.hf.engine(..., tokenizer=...)"
            )
        if params.logit_bias:
            check_logit_bias(dict(params.logit_bias), self.vocab_size)
        stop = self.stop_tokens if params.stop is None else check_stop(params.stop, self.vocab_size)
        if num_seeds > 1:
            check_seeds(params.seed, num_seeds)
        grammar = self._check_grammar(params.grammar)
        if params.retain > 0:
            self._retaining = True
        return dataclasses.replace(params, stop=stop, grammar=grammar, on_token=None)

    def _check_grammar(self, grammar) -> Grammar | None:
        """``grammar`` of :meth:`submit` checked and compiled (the compiled copy cached)."""
        if grammar is None:
            return None
        grammar = Grammar.of(grammar)
        # Under tensor parallelism every rank compiles it (from its own tokenizer) when it
        # replays the request, and masks and jumps as rank 0 does: the same logits, the same
        # tokens. Compiled here first, so that a bad grammar is rank 0's ValueError alone.
        self._grammar_compiler().compile(grammar)
        return grammar

    def _grammar_compiler(self) -> Compiler:
        """The compiler of this engine's tokenizer (``ValueError`` without one)."""
        if self.tokenizer is None:
            raise ValueError(
                "grammar= needs the model's tokenizer: make the engine with "
                "Engine(..., tokenizer=...) or radixkv.hf.engine(..., tokenizer=...)"
            )
        return compiler_for(self.tokenizer, tuple(sorted(self.stop_tokens)))

    def _register(
        self,
        prompt: np.ndarray,
        params: RequestParams,
        on_token: Callable[[StreamEvent], object] | None = None,
    ) -> Sequence:
        """Registers and queues one checked request (``on_token``: rank 0's callback)."""
        seq = self._new(prompt, params)
        seq.on_token = on_token
        try:
            self.batcher.submit(seq)
        except BaseException:
            del self.sequences[seq.id]
            raise
        return seq

    def branch(
        self,
        context: Seq[int] | np.ndarray | torch.Tensor,
        suffixes: Seq[Seq[int] | np.ndarray],
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        stop: Iterable[int] | None = None,
        namespace: str | bytes | None = None,
        seed: int = 0,
        *,
        params: RequestParams | None = None,
        **knobs,
    ) -> list[int]:
        """N branches (sub-agents, samples) from one context: branch ``i`` is the request
        ``context + suffixes[i]`` (an empty suffix samples from the context itself), with seed
        ``seed + i``. The context is computed once and held; the branches are then admitted
        and find every full page of it cached. Returns the branch ids. Checks every branch
        (as :meth:`submit` does) before queueing anything. ``params`` (or the keyword options
        of :class:`RequestParams`, :meth:`submit`'s) hold for every branch; ``on_token`` gets
        every branch's events (each event's ``id`` is its branch's); ``grammar`` constrains
        every branch (each its own matcher), not the context; ``priority`` must be 0."""
        self._lead("branch")
        ctx = to_token_array(context, "context", self.vocab_size)
        if isinstance(suffixes, (str, bytes, bytearray, np.ndarray, torch.Tensor)) or not (
            isinstance(suffixes, Iterable)
        ):
            raise ValueError(
                f"suffixes must be a list of token sequences, got {type(suffixes).__name__}"
            )
        suffixes = list(suffixes)
        if len(suffixes) == 0:
            raise ValueError("suffixes must hold at least one branch, got none")
        given = RequestParams.of(
            params,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop=stop,
            namespace=namespace,
            seed=seed,
            **knobs,
        )
        if given.priority != 0:
            raise ValueError(
                f"priority={given.priority}: branches are queued once their context is "
                "computed, at priority 0; pass priority=0"
            )
        checked = self._resolve(given, len(suffixes))
        prompts = []
        for i, s in enumerate(suffixes):
            part = to_token_array(s, f"suffixes[{i}]", self.vocab_size, allow_empty=True)
            prompts.append(np.concatenate([ctx, part]))
            self.batcher.check_fits(f"branch {i}", len(prompts[-1]), checked.max_new_tokens)
        ids = self._branch(ctx, prompts, checked, given.on_token)
        self._record(("branch", ctx, prompts, checked))
        return ids

    def _branch(
        self,
        ctx: np.ndarray,
        prompts: list[np.ndarray],
        params: RequestParams,
        on_token: Callable[[StreamEvent], object] | None = None,
    ) -> list[int]:
        """Registers the checked branches of :meth:`branch` (``on_token``: rank 0's callback,
        for each branch); returns their ids."""
        parent = None
        if self.prefix_caching:
            ctx_params = RequestParams(0, stop=(), namespace=params.namespace, seed=params.seed)
            parent = self._register(ctx, ctx_params)
        ids = []
        for i, prompt in enumerate(prompts):
            own = dataclasses.replace(params, seed=params.seed + i)
            if parent is None:
                seq = self._register(prompt, own, on_token)
            else:
                seq = self._new(prompt, own)
                seq.on_token = on_token
                seq.parent = parent  # queued once the context is computed
                parent.children.append(seq)
            ids.append(seq.id)
        return ids

    def cancel(self, seq_id: int) -> bool:
        """Ends a request that has not finished; returns whether it had not."""
        self._lead("cancel")
        if not self._cancel(seq_id):
            return False
        self._record(("cancel", int(seq_id)))
        return True

    def _cancel(self, seq_id: int) -> bool:
        seq = self._get(seq_id)
        if seq.done:
            return False
        self.batcher.finish(seq, "cancelled")
        notify_end(seq)
        return True

    def result(self, seq_id: int) -> Result:
        """The report of request ``seq_id``."""
        return self._get(seq_id).result()

    def _get(self, seq_id: int) -> Sequence:
        """The sequence of ``seq_id``; ``KeyError`` naming it if there is none."""
        seq = self.sequences.get(seq_id) if isinstance(seq_id, (int, np.integer)) else None
        if seq is None:
            raise KeyError(f"no request with id {seq_id!r} in this engine")
        return seq

    @property
    def has_work(self) -> bool:
        """Whether any request waits, runs or is held."""
        return self.batcher.has_work

    def run(self, ids: Iterable[int] | None = None, release: bool = False) -> list[Result]:
        """Steps until the requests ``ids`` (default: every request) have finished; returns
        their results in that order. ``release``: then releases those requests (see
        :meth:`release`). Never spins: requests that stop making progress fail (see
        :attr:`max_stalled_steps`)."""
        self._lead("run")
        ids = list(self.sequences) if ids is None else list(ids)
        pending = [self._get(i) for i in ids]
        while not all(s.done for s in pending):
            if not self.has_work:
                raise RuntimeError("requests left unfinished with nothing queued (engine bug)")
            self.step()
        self.batcher.retry_aborts()  # a failed request whose abort raised: try it once more
        results = [s.result() for s in pending]
        if release:
            self.release(ids)
        return results

    def generate(
        self,
        prompts: Seq[Seq[int] | np.ndarray],
        release: bool = False,
        *,
        params: RequestParams | None = None,
        **knobs,
    ) -> list[Result]:
        """Submits every prompt with ``params`` (or the keyword options of
        :class:`RequestParams`, as :meth:`submit`) and runs them to the end (``release``: as
        :meth:`run`). Every prompt is checked before any is queued."""
        self._lead("generate")
        given = RequestParams.of(params, **knobs)
        checked = [self._check_submit(p, given) for p in prompts]
        ids = []
        for arr, ps, on_token in checked:
            ids.append(self._register(arr, ps, on_token).id)
            self._record(("submit", arr, ps))
        return self.run(ids, release=release)

    def chat(
        self,
        messages: list[dict],
        *,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        params: RequestParams | None = None,
        **knobs,
    ) -> str:
        """The reply to OpenAI-style ``messages`` (``[{"role": "user", "content": ...}]``), as
        text: the prompt is rendered by the tokenizer's chat template (:mod:`radixkv.engine.chat`:
        ``tools``, ``chat_template`` and ``chat_template_kwargs`` go to it, as ``radixkv serve``
        renders a request), run to the end with ``params`` (a :class:`RequestParams`, or its
        keyword options: ``max_new_tokens``, ``temperature``, ``namespace``, ...) and released.
        Needs ``Engine(tokenizer=...)`` (``radixkv.hf.engine(..., tokenizer=tok)``); a request
        that failed raises its error. The prompt's prefix is cached like any other, so a
        conversation sent again turn after turn is served from the cache; :meth:`Session.send`
        with messages keeps the conversation."""
        prompt = render_chat(
            self.tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        (result,) = self.generate([prompt], release=True, params=params, **knobs)
        if result.error is not None:
            raise result.error
        return result.text

    def stream(
        self,
        prompt: Seq[int] | np.ndarray | torch.Tensor,
        *,
        params: RequestParams | None = None,
        **knobs,
    ) -> Iterator[StreamEvent]:
        """Submits ``prompt`` with ``params`` (as :meth:`submit`, but ``on_token``) and returns
        an iterator of its :class:`StreamEvent`: it steps the engine (every other request
        included) while it waits, and ends after the final event. For single-threaded use;
        bad arguments raise here, before anything is queued. Closing the iterator early
        cancels the request. The request stays readable (``result(event.id)``) until released.
        """
        self._lead("stream")
        given = RequestParams.of(params, **knobs)
        if "on_token" in knobs or given.on_token is not None:
            raise TypeError("stream() takes no on_token: it yields the events itself")
        events: collections.deque[StreamEvent] = collections.deque()
        seq_id = self.submit(prompt, params=dataclasses.replace(given, on_token=events.append))
        return self._stream(self.sequences[seq_id], events)

    def _stream(self, seq: Sequence, events: collections.deque) -> Iterator[StreamEvent]:
        try:
            while True:
                while events:
                    event = events.popleft()
                    yield event
                    if event.finish_reason is not None:
                        return
                if seq.done:  # ended without a final event: its callback was dropped
                    return
                self.step()
        finally:
            if not seq.done and self.sequences.get(seq.id) is seq and self.replay.broken is None:
                self.cancel(seq.id)

    def release(self, ids: Iterable[int]) -> None:
        """Forgets the finished requests ``ids`` (their results must have been read: ``result``
        and ``cancel`` no longer know them). ``KeyError`` for an unknown id, ``ValueError`` for
        one not finished; either way nothing is released."""
        self._lead("release")
        seqs = [self._get(i) for i in ids]
        for seq in seqs:
            if not seq.done:
                raise ValueError(
                    f"request {seq.id} has not finished ({seq.status.value}); cancel it first"
                )
        self._drop(seqs)
        self._record(("release", [s.id for s in seqs]))

    def forget_finished(self) -> int:
        """Forgets every finished request (as :meth:`release`); returns how many."""
        self._lead("forget_finished")
        seqs = [s for s in self.sequences.values() if s.done]
        self._drop(seqs)
        self._record(("release", [s.id for s in seqs]))
        return len(seqs)

    def reset_cache(self) -> int:
        """Drops every page no running request holds (retained ones too) from the cache and its
        tiers (:meth:`radixkv.RadixCache.reset`); returns how many. Between steps: with a
        group, on rank 0, and the other ranks drop theirs before the next step."""
        self._lead("reset_cache")
        self._record(("reset",))
        return int(self.cache.reset())

    def _drop(self, seqs: list[Sequence]) -> None:
        for hook in self.release_hooks:
            hook(seqs)
        for seq in seqs:
            self.sequences.pop(seq.id, None)
            seq.parent, seq.children = None, []  # no references between released ones

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[Result]:
        """One forward pass; returns the results of the requests it finished (those that
        failed while it was packed included). With a group: rank 0 only; it first broadcasts
        the calls taken since the last step."""
        self._lead("step")
        if self._retaining:  # rank 0's clock, sent to the other ranks with the step's calls
            now = time.monotonic() - self._t0
            self._record(("clock", now))
            self._tick(now)
        if self.lockstep is None:
            return self._step_once()
        if self.drafter is not None:  # rank 0 drafts; the others take its drafts
            self._propose()
            self._record(("drafts", {s.id: s.draft for s in self.batcher.running if s.draft}))
        return self.replay.step(self._step_once)

    def _check_step(self, batch: list[Sequence]) -> None:
        """With a group: the ranks compare their batch (and every ``digest_every`` steps their
        cache digest) before the forward pass."""
        if self.lockstep is None:
            return
        t = time.perf_counter()
        num_tokens = sum(s.num_tokens - s.num_computed for s in batch)
        self.lockstep.check_step(self.cache, len(batch), num_tokens, self.states)
        self.lockstep.check_s += time.perf_counter() - t

    def _tick(self, now: float) -> None:
        """Advances the cache's clock to ``now`` (seconds) unless it is there already."""
        if now > self.cache.now:
            self.cache.advance(now)

    def release_retention(self, retention: int) -> bool:
        """Ends a retention a request's finish made (``Result.retention``) before its time; on
        every rank of a group. Returns whether it was live."""
        self._lead("release_retention")
        live = self.cache.release_retention(retention)
        self._record(("unretain", retention))
        return live

    def retain_prefix(
        self,
        tokens: Seq[int] | np.ndarray,
        seconds: float,
        namespace: str | bytes | None = None,
        cache_priority: int = 0,
    ) -> tuple[int | None, int]:
        """Retains the cached prefix of ``tokens`` in ``namespace`` for ``seconds`` (see
        SEMANTICS.md, "Eviction classes and retention"), however much longer the requests that
        computed it were: a cache breakpoint that ends inside a prompt. Returns ``(retention,
        retained)``: the retention's id (None when nothing is cached or prefix caching is off)
        and how many tokens it holds, ``len(tokens)`` when all of them are cached (rounded
        down to whole pages; on the device: a prefix's pages on the host tier are not held).

        No admission (the core's ``Cache.retain_prefix``): nothing is pinned or allocated, and
        the cache's queries and hits do not count it. Between steps: with a group, on rank 0,
        and the other ranks retain theirs before the next step."""
        self._lead("retain_prefix")
        # every argument checked before anything is recorded for the other ranks or ticked
        arr = to_token_array(tokens, "tokens", self.vocab_size, allow_empty=True)
        check_namespace(namespace)
        keep = check_keep(seconds, cache_priority, "seconds")
        if keep == (0.0, 0) or len(arr) == 0 or not self.prefix_caching:
            return None, 0
        if keep[0] > 0:
            self._retaining = True
        now = time.monotonic() - self._t0  # the retention runs from now, not the last step
        self._record(("clock", now))
        self._tick(now)
        self._record(("retain", arr, keep, namespace))
        return self._retain(arr, keep, namespace)

    def _retain(
        self, arr: np.ndarray, keep: tuple[float, int], namespace: str | bytes | None
    ) -> tuple[int | None, int]:
        """:meth:`retain_prefix` on this rank's cache."""
        retention, held = self.cache.retain_prefix(arr, namespace, retain=keep[0], priority=keep[1])
        return (retention, held) if held else (None, 0)

    def _step_once(self) -> list[Result]:
        try:
            return self._step_body()
        finally:
            if self.states is not None:
                self.states.count_evicted()

    def _step_body(self) -> list[Result]:
        st = self.stats
        ended = self.batcher.num_ended
        t0 = time.perf_counter()
        if self.drafter is not None and self.lockstep is None:
            self._propose()  # with a group, before the broadcast (step, _set_drafts)
        batch = self.batcher.next_batch()
        t1 = time.perf_counter()
        st.schedule_s += t1 - t0
        st.preemptions = self.batcher.preemptions
        self._check_step(batch)
        if self.lockstep is not None and self.lockstep.check_tokens:
            self._sampled = []
        if not batch and self.batcher.num_held_back and self.kv.shared is not None:
            # Nothing to compute but requests whose pages are on the way: no stall; wait a
            # moment for a fetch to come back rather than spin.
            self.kv.shared.wait(HELD_BACK_WAIT_S)
            return self._with_failed([])
        if not batch:
            if self._sampled is not None:
                self.lockstep.check_sampled(self._sampled)  # type: ignore[union-attr]
            stalled = self._stalled(self.batcher.num_ended != ended)
            return self._with_failed(stalled)
        self._stalled_steps = 0
        lock = self.lockstep
        drafting = sum(1 for s in batch if s.draft)  # rows whose kept count the ranks share
        try:
            if lock is not None:
                lock.forward_begins()
            if self.states is not None:
                self.states.plan([(s.id, s.req, s.num_computed, s.num_tokens) for s in batch])
            step = self.kv.plan([s.req for s in batch])
            spans = self._draft_rows(batch, step) if self.drafter is not None else None
            t2 = time.perf_counter()
            graphs = self.graphs
            logits = graphs.run(step) if graphs and graphs.fits(step) else self.model(step)
            drafts: dict[int, torch.Tensor] | None = None
            if spans is None:
                self.kv.commit(step)
            else:  # drafts are committed once verified (_settle)
                last, rows = spans
                drafts = {b: logits[a:z] for b, (a, z) in rows.items()}
                logits = logits[last]
                counts = [s.num_computed if s.draft else s.num_tokens for s in batch]
                self.kv.commit(step, counts)
        except Exception as e:  # the batch's requests fail with it
            failed = self._with_failed(self._fail(batch, e))
            if lock is not None:  # raises DivergedError unless the others are past the model
                lock.forward_failed(e, drafting)
                if drafting:
                    lock.check_kept([0] * drafting)
                if self._sampled is not None:
                    lock.check_sampled(self._sampled)
            return failed
        except BaseException:  # KeyboardInterrupt and the like: undo the step, then stop
            self.batcher.requeue(batch)
            raise
        if lock is not None:
            lock.forward_ends(drafting)
        t3 = time.perf_counter()
        finished = self._with_failed(self._sample(batch, logits, drafts))
        if self._sampled is not None:
            self.lockstep.check_sampled(self._sampled)  # type: ignore[union-attr]
        t4 = time.perf_counter()
        st.steps += 1
        st.tokens += step.num_tokens
        st.max_step_tokens = max(st.max_step_tokens, step.num_tokens)
        st.max_step_requests = max(st.max_step_requests, len(batch))
        st.plan_s, st.forward_s, st.sample_s = (
            st.plan_s + t2 - t1,
            st.forward_s + t3 - t2,
            st.sample_s + t4 - t3,
        )
        return finished

    def _sample(
        self,
        batch: list[Sequence],
        logits: torch.Tensor,
        drafts: dict[int, torch.Tensor] | None = None,
    ) -> list[Result]:
        """Accounts the committed tokens, samples where a target is computed, ends sequences.
        ``drafts``: the logits of each batch row that carried a draft, at its token and at
        each draft token (``logits`` holds each row's last)."""
        drafting = [s for s in batch if s.draft]
        ready = self.batcher.committed(batch)
        if not ready:
            self._kept(drafting, None)
            return []
        seqs = [batch[b] for b in ready]
        refused: dict[int, Exception] = {}
        verified: dict[int, tuple[list, list]] = {}
        try:
            if drafts is not None:
                tokens, lps, refused, verified = self._verify(logits, ready, seqs, drafts)
            else:
                constrained = any(s.grammar is not None for s in seqs)
                # Every row sampled, in order (a decode step), none masked in place: the
                # logits as they are, not a copy.
                full = len(ready) == logits.shape[0] and not constrained
                rows = logits if full else logits[ready]
                if constrained:
                    refused = mask(self, rows, seqs)
                tokens, lps = sample_tokens(rows, seqs)
        except Exception as e:  # logits of the wrong shape, say
            self._kept(drafting, None)
            return self._fail(seqs, e)
        for k, error in refused.items():
            tokens[k] = error
        return Outcome(self).apply(seqs, tokens, lps, verified, drafting)

    # ---- speculative decoding ----------------------------------------------------------------

    def _propose(self) -> None:
        """Sets the draft of every running sequence that decodes next (none for the others, and
        for one whose next token is its last); a grammar's draft is cut to what the grammar
        accepts (none before its first token)."""
        drafter = self.drafter
        assert drafter is not None
        k = drafter.config.num_speculative_tokens
        for seq in self.batcher.running:
            seq.draft = []
            room = min(k, seq.remaining_new_tokens - 1)
            state = seq.grammar
            if (
                room > 0
                and (state is None or not state.unannounced)
                and seq.num_computed == seq.num_tokens == seq.target_len - 1
            ):
                draft = drafter.propose(seq, room)
                seq.draft = draft if state is None else state.allowed_prefix(draft)

    def _set_drafts(self, drafts: dict[int, list[int]]) -> None:
        """Other ranks: the drafts rank 0 proposed for this step (by request id; every other
        running request drafts nothing), so that every rank plans and verifies the same."""
        for seq in self.batcher.running:
            seq.draft = list(drafts.get(seq.id, ()))

    def _kept(self, drafting: list[Sequence], counts: list[int] | None) -> list[int] | None:
        """With a group and a step with drafts: how many tokens each of ``drafting`` (this
        step's drafting requests, in batch order) recorded on rank 0, which every rank keeps
        (a stop string, which only rank 0 sees, or its ``on_token`` raising may end one before
        its verified tokens do). ``counts``: rank 0's (None: it recorded none). Without a
        group or drafts: ``counts``."""
        lock = self.lockstep
        if lock is None or not drafting:
            return counts
        t = time.perf_counter()
        kept = lock.check_kept(counts if counts is not None else [0] * len(drafting))
        lock.check_s += time.perf_counter() - t
        return kept

    def _draft_rows(
        self, batch: list[Sequence], step
    ) -> tuple[list[int], dict[int, tuple[int, int]]] | None:
        """With a draft in ``batch``: makes the model return the logits of every row of a
        drafting sequence's chunk (its token and each draft) besides each other sequence's
        last row (``step.last_token_index``, which the models gather), and returns where each
        batch row's last logits are and each drafting row's span, in the logits. None without
        a draft."""
        if not any(s.draft for s in batch):
            return None
        rows: list[int] = []
        last: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        end = 0
        for b, (seq, q) in enumerate(zip(batch, step.q_len_list)):
            end += q
            k = len(seq.draft)
            if k:
                spans[b] = (len(rows), len(rows) + k + 1)
                rows.extend(range(end - k - 1, end))
            else:
                rows.append(end - 1)
            last.append(len(rows) - 1)
        step.last_token_index = torch.tensor(rows, dtype=torch.long, device=step.kv.device)
        return last, spans

    def _verify(
        self,
        logits: torch.Tensor,
        ready: list[int],
        seqs: list[Sequence],
        drafts: dict[int, torch.Tensor],
    ) -> tuple[list, list | None, dict[int, Exception], dict[int, tuple[list, list]]]:
        """:meth:`_sample`'s sampling in a step with drafts: the rows without a draft as usual,
        each drafting one through :func:`verify_draft` (its first kept token in ``tokens``,
        every kept token and its alternatives in ``verified``, by row)."""
        tokens: list = [None] * len(seqs)
        lps: list | None = None
        refused: dict[int, Exception] = {}
        verified: dict[int, tuple[list, list]] = {}
        plain = [k for k, s in enumerate(seqs) if not s.draft]
        if plain:
            pseqs = [seqs[k] for k in plain]
            rows = logits[[ready[k] for k in plain]]
            if any(s.grammar is not None for s in pseqs):
                refused = {plain[i]: e for i, e in mask(self, rows, pseqs).items()}
            toks, plps = sample_tokens(rows, pseqs)
            for i, k in enumerate(plain):
                tokens[k] = toks[i]
            if plps is not None:
                lps = [None] * len(seqs)
                for i, k in enumerate(plain):
                    lps[k] = plps[i]
        st = self.stats
        drafter = self.drafter
        assert drafter is not None
        for k, seq in enumerate(seqs):
            if not seq.draft:
                continue
            try:
                rows = drafts[ready[k]]
                if seq.grammar is not None:  # row j masked as the grammar stands after j drafts
                    t = time.perf_counter()
                    rows = rows.clone()  # a view of the forward's (inference) logits
                    left = apply_masks(
                        rows, list(range(len(rows))), seq.grammar.masks_along(seq.draft)
                    )
                    st.mask_s += time.perf_counter() - t
                    if not left[0]:
                        raise radixkv.Error(
                            f"request {seq.id}: the grammar allows no token of the model's "
                            f"vocabulary [0, {self.vocab_size}) after {len(seq.output)} output "
                            "tokens"
                        )
                items, tops, accepted = verify_draft(rows, seq, seq.draft)
                seq.accepted = accepted
            except Exception as e:  # reported on the row's request
                tokens[k] = e
                continue
            tokens[k] = items[0][0]
            if items[0][1] is not None:
                lps = lps or [None] * len(seqs)
                lps[k] = items[0][1]
            verified[k] = (items, tops)
            st.spec_drafts += 1
            st.spec_draft_tokens += len(seq.draft)
            st.spec_accepted_tokens += accepted
            for j in range(accepted):
                st.spec_accepted_per_pos[j] += 1
            drafter.accepted(seq, len(seq.draft), accepted)
        return tokens, lps, refused, verified

    def _settle(self, seq: Sequence) -> None:
        """After a speculative step recorded ``seq``'s tokens: its request keeps the KV of
        every token but the last of its target (the verified drafts, never a token past a stop
        or past what it kept), and gives back the rest of the chunk."""
        assert seq.req is not None
        # The tokens whose KV this step computed from kept tokens: the last one and the accepted
        # drafts; tokens a grammar forced after them (appended past the target) come next step.
        n = min(seq.target_len - 1, seq.num_computed + 1 + seq.accepted)
        self.kv.settle(seq.req, n)
        seq.num_tokens = seq.num_computed = n
        seq.draft = []

    def _end(self, seq_id: int, reason: str, message: str | None) -> None:
        """Other ranks: rank 0 ended request ``seq_id`` in its last step for a reason only it
        knows (a stop string in its text, its ``on_token`` raising): it ends here too, as it
        did there, after every other request that step ended; one that ended here already
        takes rank 0's ``finish_reason`` (``message``: what its error says)."""
        seq = self._get(seq_id)
        if message is not None:
            seq.error = radixkv.Error(f"rank 0: {message}")
        if seq.done:
            seq.finish_reason = reason
        else:
            self.batcher.finish(seq, reason)

    def _fail(self, seqs: list[Sequence], error: Exception) -> list[Result]:
        """Ends ``seqs`` with ``finish_reason="error"`` and ``error`` (their requests aborted:
        nothing of the failed step is published); returns their results."""
        out = []
        for seq in seqs:
            if not seq.done:
                seq.error = error
                self.batcher.finish(seq, "error", abort=True)
                notify_end(seq)
                out.append(seq.result())
        return out

    def _with_failed(self, results: list[Result]) -> list[Result]:
        """``results`` and those of the sequences the batcher failed meanwhile."""
        failed = self.batcher.take_failed()
        if not failed:
            return results
        for s in failed:
            notify_end(s)
        return results + [s.result() for s in failed]

    def _stalled(self, progress: bool) -> list[Result]:
        """Nothing could be scheduled although work may be left. Held contexts pin pages that
        their branches need: they are released. Otherwise, unless the step ended a request
        (``progress``), the step counts as stalled: every queued request fits the pool alone
        and the scheduler admits the first one while it does, so what blocks them is outside
        the engine (pages pinned by requests it did not open, a scheduler that raises). After
        :attr:`max_stalled_steps` in a row the stuck requests fail (:meth:`_fail_stuck`)."""
        if self.batcher.release_held():
            progress = True
        if progress or not self.has_work:
            self._stalled_steps = 0
            return []
        self._stalled_steps += 1
        if self._stalled_steps < self.max_stalled_steps:
            return []
        self._stalled_steps = 0
        return self._fail_stuck()

    def _fail_stuck(self) -> list[Result]:
        """Ends every unfinished request with ``finish_reason="error"`` and a ``radixkv.Error``
        saying why it is stuck; returns their results."""
        b, stats = self.batcher, self.cache.stats
        own: set[int] = set()
        for s in b.running + b.held:
            if s.req is not None:
                own.update(int(p) for p in s.req.pages)
        outside = max(stats.used_pages - len(own), 0)
        pool = (
            f"the pool of {stats.num_pages} pages of {stats.page_size} tokens has "
            f"{stats.free_pages} free and {stats.evictable_pages} evictable; {outside} of its "
            f"{stats.used_pages} used pages are pinned by requests this engine did not open"
        )
        if stats.window_pages:
            pool += (
                f"; its window pool of {stats.window_pages} pages has {stats.window_free_pages} "
                f"free and {stats.window_evictable_pages} evictable"
            )
        cause = b.last_error
        if cause is not None:
            pool += f"; the scheduler's last admission attempt raised {cause!r}"
        out = []
        for seq in [s for s in self.sequences.values() if not s.done]:
            if seq.done:  # a branch failed along with its context
                continue
            if seq.status is Status.RUNNING:
                what = "it runs and cannot grow"
            elif seq.status is Status.HELD:
                what = "it is a computed branch context whose branches cannot be admitted"
            elif seq.parent is not None and not b.is_queued(seq):
                what = f"it is a branch whose context (request {seq.parent.id}) is not computed"
            else:
                what = f"it waits for admission with {seq.target_len} tokens to hold"
            error = radixkv.Error(
                f"request {seq.id} made no progress in {self.max_stalled_steps} steps: {what}; "
                f"{pool}"
            )
            error.__cause__ = cause
            out.extend(self._fail([seq], error))
        return out

    # ---- helpers ----------------------------------------------------------------------------

    def _new(self, prompt: np.ndarray, params: RequestParams) -> Sequence:
        seq = Sequence(
            id=next(self._ids),
            prompt=prompt,
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            stop=params.stop,
            namespace=params.namespace,
            seed=params.seed,
            priority=params.priority,
            retain=params.retain,
            cache_class=params.cache_priority,
        )
        sp = params.sampling
        if sp is not OFF:
            if sp.used(seq.temperature):
                seq.sampling = sp
            seq.stop_strings = sp.stop_strings
            if sp.logprobs:
                seq.logprobs = []
            if sp.top_logprobs:
                seq.top_logprobs = []
        if self.tokenizer is not None and self.rank == 0:
            context = prompt[-CONTEXT_TOKENS:].tolist()
            seq.detok = Detokenizer(self.tokenizer, seq.stop_strings, context)
        if params.grammar is not None and params.max_new_tokens > 0:
            seq.grammar = self._grammar_compiler().start(params.grammar)
            if self.jump_forward:  # what the grammar forces first is prefilled with the prompt
                forced, _ = seq.grammar.jump(None, params.max_new_tokens - 1, self.vocab_size)
                if forced:
                    seq.output.extend(forced)
                    seq.grammar.unannounced = len(forced)
        self.sequences[seq.id] = seq
        return seq


def _check_kv_shape(model: torch.nn.Module, kv: KVCache) -> None:
    """``ValueError`` when ``model`` states its KV shape (``kv_shape``: layers, KV heads, head
    dim) and ``kv``'s pools have another: its forward passes would fail on every step."""
    want = getattr(model, "kv_shape", None)
    if want is None:
        return
    got = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
    if tuple(want) != got:
        raise ValueError(
            f"kv is shaped (layers, KV heads, head dim) = {got}, the model needs {tuple(want)}: "
            "make it with model.make_kv_cache(cache)"
        )


def _submit_defaults(params: dict) -> dict:
    """``params`` completed with the defaults of :class:`RequestParams` (what
    :meth:`Engine.generate` submits); ``TypeError`` for a name it has no field for."""
    unknown = sorted(set(params) - set(_FIELDS))
    if unknown:
        raise TypeError(f"unknown parameters {unknown}; a request takes {list(_FIELDS)}")
    return {**defaults(), **params}


#: The fields of a request's parameters, the keyword options of :meth:`Engine.submit`.
_FIELDS = field_names()
#: Seconds a step with nothing to compute waits for a shared fetch of a held-back request.
HELD_BACK_WAIT_S = 0.005
