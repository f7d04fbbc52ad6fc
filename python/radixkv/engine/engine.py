"""`Engine`: continuous batching over a prefix cache.

Requests come in through :meth:`Engine.submit` (one prompt), :meth:`Engine.branch` (N branches
of one context) or a :class:`radixkv.Session` (multi-turn). Every :meth:`Engine.step` is one
forward pass: the :class:`~radixkv.engine.batcher.Batcher` packs a batch under the token budget
(decodes, prefill chunks, admissions through the Rust scheduler, preemption), then one
``kv.plan``, one model forward, one ``kv.commit``, and sampling for every sequence whose whole
target is now computed. The engine owns the model, the KV tensors, the sequences and sampling;
the batcher owns the queue and the cache requests. A step crosses into Rust a fixed number of
times, however many requests it holds (admissions and ends aside, once per request).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from radixkv.engine.batcher import Batcher
from radixkv.engine.sampling import sample_tokens, to_token_array
from radixkv.engine.sequence import Result, Sequence
from radixkv.kv.kv_cache import KVCache


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


class Engine:
    """Continuous batching of generation requests over ``model`` and its paged ``kv``.

    ``token_budget``: tokens computed per step at most (prefill chunks and decodes together); a
    prompt longer than that is prefilled in chunks over several steps. ``max_batch``: requests
    per step at most. ``prefix_caching=False`` turns reuse off while keeping everything else
    identical: each admission goes to a private namespace of its own, so no prompt ever finds a
    cached prefix. ``policy``: the admission order of the :class:`radixkv.Scheduler` every
    waiting request is queued in: ``"fcfs"`` (arrival order, the default), ``"lpm"`` (longest
    cached prefix first) or ``"dfs-weight"``; ``max_wait`` bounds how many steps a request
    waits behind others (0: no bound).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        token_budget: int = 2048,
        max_batch: int = 64,
        prefix_caching: bool = True,
        policy: str = "fcfs",
        max_wait: int = 256,
    ) -> None:
        for name, value in (("token_budget", token_budget), ("max_batch", max_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model, self.kv, self.cache = model, kv, kv.cache
        self.vocab_size: int = model.config.vocab_size
        self.token_budget, self.max_batch = token_budget, max_batch
        self.prefix_caching = prefix_caching
        self.batcher = Batcher(kv.cache, token_budget, max_batch, prefix_caching, policy, max_wait)
        self.sequences: dict[int, Sequence] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()

    # ---- requests in ------------------------------------------------------------------------

    def submit(
        self,
        prompt: Seq[int] | np.ndarray | torch.Tensor,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        stop: Iterable[int] = (),
        namespace: str | bytes | None = None,
        seed: int = 0,
        priority: int = 0,
    ) -> int:
        """Queues one request; returns its id. ``temperature=0`` is greedy; generation ends at a
        token of ``stop`` (kept in the output) or after ``max_new_tokens`` (0: prefill only).
        Higher ``priority`` is admitted first. Raises ``ValueError`` for bad arguments and for a
        request the pool could never hold (prompt and output together, but the last token)."""
        arr = to_token_array(prompt, "prompt", self.vocab_size)
        _check_params(max_new_tokens, temperature)
        self.batcher.check_fits("prompt", len(arr), max_new_tokens)
        seq = self._new(arr, max_new_tokens, temperature, stop, namespace, seed, priority)
        self.batcher.queue(seq)
        return seq.id

    def branch(
        self,
        context: Seq[int] | np.ndarray | torch.Tensor,
        suffixes: Seq[Seq[int] | np.ndarray],
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        stop: Iterable[int] = (),
        namespace: str | bytes | None = None,
        seed: int = 0,
    ) -> list[int]:
        """N branches (sub-agents, samples) from one context: branch ``i`` is the request
        ``context + suffixes[i]`` (an empty suffix samples from the context itself), with seed
        ``seed + i``. The context is computed once and held; the branches are then admitted
        and find every full page of it cached. Returns the branch ids. Checks every branch
        (as :meth:`submit` does) before queueing anything."""
        ctx = to_token_array(context, "context", self.vocab_size)
        if len(suffixes) == 0:
            raise ValueError("suffixes must hold at least one branch, got none")
        _check_params(max_new_tokens, temperature)
        prompts = []
        for i, s in enumerate(suffixes):
            part = to_token_array(s, f"suffixes[{i}]", self.vocab_size, allow_empty=True)
            prompts.append(np.concatenate([ctx, part]))
            self.batcher.check_fits(f"branch {i}", len(prompts[-1]), max_new_tokens)
        parent = None
        if self.prefix_caching:
            parent = self._new(ctx, 0, 0.0, (), namespace, seed, 0)
            self.batcher.queue(parent)
        ids = []
        for i, prompt in enumerate(prompts):
            seq = self._new(prompt, max_new_tokens, temperature, stop, namespace, seed + i, 0)
            if parent is None:
                self.batcher.queue(seq)
            else:
                seq.parent = parent  # queued once the context is computed
                parent.children.append(seq)
            ids.append(seq.id)
        return ids

    def cancel(self, seq_id: int) -> bool:
        """Ends a request that has not finished; returns whether it had not."""
        seq = self.sequences[seq_id]
        if seq.done:
            return False
        self.batcher.finish(seq, "cancelled")
        return True

    def result(self, seq_id: int) -> Result:
        """The report of request ``seq_id``."""
        return self.sequences[seq_id].result()

    @property
    def has_work(self) -> bool:
        """Whether any request waits, runs or is held."""
        return self.batcher.has_work

    def run(self, ids: Iterable[int] | None = None) -> list[Result]:
        """Steps until the requests ``ids`` (default: every request) have finished; returns
        their results in that order."""
        ids = list(self.sequences) if ids is None else list(ids)
        pending = [self.sequences[i] for i in ids]
        while not all(s.done for s in pending):
            if not self.has_work:
                raise RuntimeError("requests left unfinished with nothing queued (engine bug)")
            self.step()
        return [s.result() for s in pending]

    def generate(self, prompts: Seq[Seq[int] | np.ndarray], **params) -> list[Result]:
        """Submits every prompt with ``params`` (as :meth:`submit`) and runs them to the end."""
        return self.run([self.submit(p, **params) for p in prompts])

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[Result]:
        """One forward pass; returns the results of the requests it finished."""
        st = self.stats
        t0 = time.perf_counter()
        batch = self.batcher.next_batch()
        t1 = time.perf_counter()
        st.schedule_s += t1 - t0
        st.preemptions = self.batcher.preemptions
        if not batch:
            return self._stalled()
        step = self.kv.plan([s.req for s in batch])
        t2 = time.perf_counter()
        logits = self.model(step)
        self.kv.commit(step)
        t3 = time.perf_counter()
        finished = self._sample(batch, logits)
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

    def _sample(self, batch: list[Sequence], logits: torch.Tensor) -> list[Result]:
        """Accounts the committed tokens, samples where a target is computed, ends sequences."""
        ready = []
        for b, seq in enumerate(batch):
            q = seq.num_tokens - seq.num_computed
            seq.num_computed = seq.num_tokens  # what kv.commit just recorded
            seq.total_computed_tokens += q
            if seq.first_token_at is None:
                seq.computed_tokens += q
            if seq.num_tokens == seq.target_len:
                ready.append(b)
        if not ready:
            return []
        seqs = [batch[b] for b in ready]
        tokens = sample_tokens(logits[ready], seqs)
        now = time.perf_counter()
        finished = []
        for seq, tok in zip(seqs, tokens):
            if seq.max_new_tokens == 0:
                if seq.children:
                    self.batcher.hold(seq)
                    continue
                seq.finish_reason = "length"
            else:
                seq.record_token(tok, now)
            if seq.finish_reason is not None:
                self.batcher.finish(seq, seq.finish_reason)
                finished.append(seq.result())
        return finished

    def _stalled(self) -> list[Result]:
        """Nothing could be scheduled although work may be left: held contexts pin pages that
        their branches need, so they are released. Anything else would be a bug: every queued
        request fits the pool alone, and the scheduler admits the first one while it does."""
        if self.batcher.release_held():
            return []
        if self.batcher.num_waiting and not self.batcher.running:
            raise RuntimeError(
                f"{self.batcher.num_waiting} requests wait and none could be admitted into an "
                "idle pool (engine bug)"
            )
        return []

    # ---- helpers ----------------------------------------------------------------------------

    def _new(self, prompt, max_new_tokens, temperature, stop, namespace, seed, priority):
        seq = Sequence(
            id=next(self._ids),
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            stop=frozenset(int(t) for t in stop),
            namespace=namespace,
            seed=seed,
            priority=priority,
        )
        self.sequences[seq.id] = seq
        return seq


def _check_params(max_new_tokens: int, temperature: float) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
