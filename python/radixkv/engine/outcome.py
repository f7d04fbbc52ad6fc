"""What a sampled token does to its request, once a step's rows are sampled.

:meth:`radixkv.Engine.step` samples one token per ready row (or verifies a draft: several);
:class:`Outcome` then walks each request through what that token means, in this order:

```text
  token id outside the vocabulary, or the row's sampling failed   -> the request fails
  max_new_tokens == 0 (a prefill, a branch context)               -> held for its branches,
                                                                     or ends ("length")
  the tokens it appends: the verified drafts and the model's own token; with a grammar, the
  tokens the grammar forced before, the sampled one (or its retokenization), the tokens it
  forces after (jump-forward)
  each appended token: recorded, logprobs, text (a stop string ends it), on_token's event
  a speculative step: the request keeps the KV of its kept tokens, gives back the rest
  an end: the batcher finishes it, its final event, its result
```

A request that its text or its callback ends (a stop string completed before its last token,
``on_token`` raising) is ended *late*, after every other request of the step: the other ranks
of a tensor-parallel group learn of it from rank 0's next broadcast (an ``"end"`` call) and end
it in the same order. Token masks of constrained rows (:func:`mask`) are applied before the
sampling, in one batched operation.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import radixkv
from radixkv.engine.grammar import apply_masks, fill_masks
from radixkv.engine.sequence import Result, Sequence, StreamEvent

if TYPE_CHECKING:
    import torch

#: The :class:`radixkv.Engine` whose step this is (not imported: the engine imports this
#: module): its ``vocab_size``, ``stats``, ``batcher`` and ``jump_forward``, and the request
#: ends it owns (``_fail``, ``_settle``, ``_record``, ``_sampled``).
Engine = Any

#: What one appended token is: ``(token, logprob, forced by the grammar)``.
Item = tuple[int, "float | None", bool]


class Outcome:
    """The outcome of one step's sampled tokens on ``engine``'s requests (see the module
    docstring): :meth:`apply` once, then discarded."""

    def __init__(self, engine: Engine) -> None:
        self.eng = engine
        self.now = time.perf_counter()
        self.finished: list[Result] = []
        #: Rank 0: requests its text or callback ends, ended after every other one.
        self.late: list[tuple[Sequence, int, float | None, str]] = []
        #: The first exception of a ``Batcher.finish`` (a bug), raised once all ended.
        self.bug: Exception | None = None

    def apply(
        self,
        seqs: list[Sequence],
        tokens: list,
        lps: list | None,
        verified: dict[int, tuple[list, list]],
        drafting: list[Sequence] | None = None,
    ) -> list[Result]:
        """Applies ``tokens[k]`` (an id, or the exception its row's sampling raised) and its
        logprob ``lps[k]`` to ``seqs[k]``; ``verified``: by row, the tokens a verified draft
        appends (with their logprobs) and their alternatives. ``drafting``: the step's
        requests with a draft (batch order): under tensor parallelism each records as many
        tokens as it did on rank 0 (:meth:`Engine._kept`). Returns the results of the
        requests that ended."""
        eng = self.eng
        if eng._sampled is not None:
            eng._sampled.extend(
                (s.id, t if isinstance(t, int) else -1) for s, t in zip(seqs, tokens)
            )
        drafting = drafting or []
        lead = eng.lockstep is None or eng.lockstep.rank == 0
        if drafting and not lead:  # rank 0's kept counts first: it may have kept fewer
            kept = dict(zip((s.id for s in drafting), eng._kept(drafting, None)))
            for k, seq in enumerate(seqs):
                n = kept.get(seq.id, 0)
                if k in verified and 0 < n < len(verified[k][0]):
                    verified[k] = (verified[k][0][:n], verified[k][1][:n])
        before = {s.id: len(s.output) for s in drafting}
        for k, (seq, tok) in enumerate(zip(seqs, tokens)):
            if not isinstance(tok, Exception) and not 0 <= tok < eng.vocab_size:
                tok = ValueError(
                    f"the model's logits gave token id {tok}, outside the "
                    f"vocabulary [0, {eng.vocab_size})"
                )
            if isinstance(tok, Exception):
                self.finished.extend(eng._fail([seq], tok))
                continue
            self._one(seq, tok, None if lps is None else lps[k], verified.get(k))
        if drafting and lead:
            eng._kept(drafting, [len(s.output) - before[s.id] for s in drafting])
        for seq, tok, lp, delta in self.late:
            self._end(seq, "stop" if seq.error is None else "error", tok, lp, delta)
        if self.bug is not None:
            raise self.bug
        return self.finished

    def _one(
        self, seq: Sequence, tok: int, lp: float | None, verified: tuple[list, list] | None
    ) -> None:
        """What the sampled ``tok`` (logprob ``lp``) does to ``seq``."""
        eng = self.eng
        if seq.max_new_tokens == 0:
            if seq.children:
                eng.batcher.hold(seq)
                return
            seq.finish_reason = "length"
            self._end(seq, "length", None, lp, "", natural="length")
            return
        items: list[Item] = [(tok, lp, False)]
        tops: list | None = None
        if verified is not None:  # the drafts it accepted and the target's own token
            items = [(t, p, False) for t, p in verified[0]]
            tops = verified[1]
        if seq.grammar is not None:
            try:
                if verified is not None:  # the accepted drafts, then the target's own token
                    for t, *_ in items[:-1]:
                        seq.grammar.consume(t)
                    items = items[:-1] + grammar_tokens(eng, seq, *items[-1][:2])
                else:
                    items = grammar_tokens(eng, seq, tok, lp)
            except radixkv.Error as e:  # the grammar refused it: never seen
                self.finished.extend(eng._fail([seq], e))
                return
            if tops is not None and len(tops) < len(items):  # forced tokens: no alternatives
                tops = tops + [None] * (len(items) - len(tops))
        ends, natural, last, lp, delta = self._append(seq, items, tops)
        if seq.draft:
            try:
                eng._settle(seq)
            except Exception as e:  # the cache refused: this request ends with it
                self.finished.extend(eng._fail([seq], e))
                return
        if ends:
            self._end(seq, seq.finish_reason, last, lp, delta, natural)

    def _append(
        self, seq: Sequence, items: list[Item], tops: list | None
    ) -> tuple[bool, str | None, int, float | None, str]:
        """Records ``items`` on ``seq`` one by one until one ends it; returns whether one did
        (not late), why every rank ends it (the others lack the text), and the last token
        recorded, its logprob and its text."""
        eng, late = self.eng, self.late
        natural: str | None = "length"
        tok, lp, delta = items[0][0], items[0][1], ""
        for j, (tok, lp, forced) in enumerate(items):
            delta = ""
            if tops is not None:
                seq.last_top = tops[j]
            seq.record_token(tok, self.now)
            if forced:
                seq.forced_tokens += 1
                eng.stats.forced_tokens += 1
            if (
                j == len(items) - 1
                and seq.grammar is not None
                and seq.finish_reason != "stop"
                and seq.grammar.complete
            ):
                seq.finish_reason = "stop"  # the grammar is complete
            natural = seq.finish_reason
            if seq.logprobs is not None:
                seq.logprobs.append(lp)  # type: ignore[arg-type]
            if seq.top_logprobs is not None:
                seq.top_logprobs.append([] if forced else list(seq.last_top or []))
            if seq.detok is not None:
                delta = seq.detok.add(tok)
                if seq.detok.stopped:
                    if seq.finish_reason is None:
                        late.append((seq, tok, lp, delta))
                        return False, natural, tok, lp, delta
                    seq.finish_reason = "stop"  # a stop string with the last token
            if seq.finish_reason is not None:
                return True, natural, tok, lp, delta
            if seq.on_token is not None and not emit(
                seq, StreamEvent(seq.id, tok, delta, lp, None, last_top(seq))
            ):
                late.append((seq, tok, lp, ""))
                return False, natural, tok, lp, delta
        return False, natural, tok, lp, delta

    def _end(
        self,
        seq: Sequence,
        reason: str | None,
        token: int | None,
        lp: float | None,
        delta: str,
        natural: str | bool | None = True,
    ) -> None:
        """Ends ``seq`` for ``reason`` after its last ``token``: the batcher finishes it, its
        final event, its result. ``natural``: why every rank ends it (they all know its
        tokens); when its ``finish_reason`` is another in the end (a stop string, its final
        event raising), or always where ``natural`` is True (a late end), the other ranks are
        told."""
        eng = self.eng
        try:
            eng.batcher.finish(seq, reason)  # type: ignore[arg-type]
        except Exception as e:  # a bug: the request ended (with it); the rest go on
            self.bug = self.bug or e
        notify_end(seq, token, lp, delta)
        if natural is True or seq.finish_reason != natural:
            eng._record(("end", seq.id, seq.finish_reason, message(seq)))
        self.finished.append(seq.result())


def mask(engine: Engine, rows: torch.Tensor, seqs: list[Sequence]) -> dict[int, Exception]:
    """Applies the token mask of every constrained row of ``rows`` (the logits of ``seqs``) in
    one batched operation; returns the error of each row whose grammar leaves no token (by
    row)."""
    t = time.perf_counter()
    idx = [k for k, s in enumerate(seqs) if s.grammar is not None]
    states = [seqs[k].grammar for k in idx]
    compiler = states[0].compiler  # type: ignore[union-attr]
    masks = fill_masks(compiler, states)  # type: ignore[arg-type]
    left = apply_masks(rows, idx, masks)
    refused: dict[int, Exception] = {}
    for k, state, ok in zip(idx, states, left):
        error = state.error  # type: ignore[union-attr]
        if error is not None or not ok:
            why = (
                f"the grammar failed: {error}"
                if error is not None
                else (
                    f"the grammar allows no token of the model's vocabulary [0, "
                    f"{engine.vocab_size}) after {len(seqs[k].output)} output tokens"
                )
            )
            refused[k] = radixkv.Error(f"request {seqs[k].id}: {why}")
    engine.stats.mask_s += time.perf_counter() - t
    return refused


def grammar_tokens(engine: Engine, seq: Sequence, tok: int, lp: float | None) -> list[Item]:
    """What ``seq`` appends for its sampled ``tok``, as ``(token, logprob, forced)``: the tokens
    its grammar forced before its first step (reported now, with the first sampled token), then
    ``tok`` and, with ``engine.jump_forward``, the tokens the grammar forces after it (consumed
    by the matcher; where the tokenizer merges ``tok`` with them, the merged tokens in its
    place, the first with ``tok``'s logprob). A forced token's logprob is 0.0 (it is certain
    under the grammar). ``radixkv.Error`` if the grammar refuses ``tok``."""
    state = seq.grammar
    assert state is not None
    state.consume(tok)
    sure = None if lp is None else 0.0
    early: list[Item] = []
    if state.unannounced:  # the only output so far: taken out to be recorded again
        n, state.unannounced = state.unannounced, 0
        early = [(t, sure, True) for t in seq.output[-n:]]
        del seq.output[-n:]
        engine.stats.jumps += 1
    items: list[Item] = [(tok, lp, False)]
    if engine.jump_forward:
        room = seq.remaining_new_tokens - len(early) - 1
        forced, replaces = state.jump(tok, room, engine.vocab_size)
        if forced:
            engine.stats.jumps += 1
            if replaces:
                items = [(forced[0], lp, False)]
                forced = forced[1:]
            items += [(t, sure, True) for t in forced]
    return early + items


def emit(seq: Sequence, event: StreamEvent) -> bool:
    """Calls ``seq.on_token(event)``; returns whether it did not raise. If it raised, the
    exception is ``seq.error`` and the callback is dropped (the request is to end)."""
    try:
        seq.on_token(event)  # type: ignore[misc]
    except Exception as e:
        seq.on_token, seq.error = None, e
        return False
    return True


def notify_end(
    seq: Sequence, token: int | None = None, logprob: float | None = None, text: str = ""
) -> None:
    """``seq`` ended: the rest of its text is decoded and its final event sent (with ``token``,
    ``logprob`` and ``text`` when it ended on a sampled token), once. An exception from it
    turns a request that ended normally into a failed one."""
    if seq.detok is not None:
        if seq.grammar is not None and seq.grammar.unannounced:  # forced, never reported
            for t in seq.output[-seq.grammar.unannounced :]:
                text += seq.detok.add(t)
            seq.grammar.unannounced = 0
        text += seq.detok.finish()
    callback, seq.on_token = seq.on_token, None
    if callback is None:
        return
    try:
        top = last_top(seq) if token is not None else None
        callback(StreamEvent(seq.id, token, text, logprob, seq.finish_reason, top))
    except Exception as e:
        if seq.finish_reason not in ("error", "cancelled"):
            seq.finish_reason, seq.error = "error", e


def message(seq: Sequence) -> str | None:
    """What rank 0 tells the other ranks of ``seq``'s error (exceptions are not sent)."""
    return None if seq.error is None else repr(seq.error)


def last_top(seq: Sequence) -> list[tuple[int, float]] | None:
    """The alternatives of ``seq``'s last output token (``top_logprobs``), else None."""
    return seq.top_logprobs[-1] if seq.top_logprobs else None
