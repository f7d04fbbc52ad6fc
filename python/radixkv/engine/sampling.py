"""Token ids in (validated arrays) and out (sampling of a batch, with its knobs).

Each row of a batch's logits is turned into a token for its request, in this order (as vLLM and
Hugging Face transformers do):

0. ``logit_bias`` (OpenAI's): each listed token's bias, in [-100, 100], added to its logit
   (:func:`apply_logit_bias`; as in vLLM, before the penalties): -100 all but bans a token and
   100 all but forces it;
1. penalties (:func:`apply_penalties`): ``repetition_penalty`` over every token of the prompt
   and the output so far (a positive logit divided by it, a negative one multiplied), then
   ``presence_penalty`` and ``frequency_penalty`` over the output tokens (OpenAI's definition:
   ``logit - frequency * count - presence * (count > 0)``);
2. temperature: ``temperature=0`` takes the argmax of the penalized logits (greedy) and ignores
   the filters; otherwise the logits are divided by it;
3. filters (:func:`filter_logits`): ``top_k`` (the k largest, ties kept), ``top_p`` (the smallest
   set of most likely tokens holding ``top_p`` of the mass, every token as likely as its least
   likely one kept), ``min_p`` (tokens at least ``min_p`` times as likely as the most likely);
4. a draw from the softmax of what is left, with the request's own ``torch.Generator`` (seeded
   with its seed, on the logits' device), so its samples never depend on its batch-mates.

All of it runs on the logits' own device, and a step reads back one small tensor (the tokens,
NaN flags, logprobs and alternatives together): no copy of the logits to the CPU. A seed repeats
on one kind of device; CUDA's generators draw other streams than the CPU's.

A row that uses none of the knobs costs what it did before they existed: greedy rows are one
batched argmax, temperature rows one softmax and draw. ``logprobs``: the log-probability of the
chosen token under the model's own distribution, ``log_softmax`` of the logits before the bias,
penalties, temperature and filters (OpenAI's meaning, and vLLM's default ``raw_logprobs``; a
grammar's mask is part of the model's output here, as in vLLM); ``top_logprobs=k``: the ``k``
largest of that same distribution, with their tokens (OpenAI's ``top_logprobs``, at most
:data:`MAX_TOP_LOGPROBS`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import numpy as np
import torch

from radixkv.engine import batch_sampling
from radixkv.engine.batch_sampling import TOP_P_CANDIDATES, Drawn, generator_of, prompt_ids
from radixkv.engine.params import (
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    check_logit_bias,
    check_sampling,
)
from radixkv.engine.sequence import OFF, Sampling, Sequence
from radixkv.kv.host_copy import to_device

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_TOP_LOGPROBS",
    "OFF",
    "Sampling",
    "check_logit_bias",
    "check_sampling",
    "sample_tokens",
    "to_token_array",
    "verify_draft",
]


def to_token_array(
    tokens: Seq[int] | np.ndarray | torch.Tensor,
    name: str,
    vocab_size: int,
    allow_empty: bool = False,
) -> np.ndarray:
    """``tokens`` as a 1-D uint32 array, each id checked against ``vocab_size``."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise ValueError(f"{name} must be a 1-D sequence of ints, got {type(tokens).__name__}")
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as e:  # ragged nesting, unconvertible items
        raise ValueError(f"{name} must be a 1-D sequence of ints: {e}") from None
    if arr.size == 0:
        if allow_empty:
            return np.zeros(0, dtype=np.uint32)
        raise ValueError(f"{name} must hold at least one token, got none")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{name} must be a 1-D sequence of ints, got shape {arr.shape} of {arr.dtype}"
        )
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.uint32, copy=False)


def apply_logit_bias(row: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``row`` (logits ``[vocab]``, float) with ``sampling.logit_bias`` added, as a new
    tensor on ``row``'s device."""
    ids, biases = zip(*sampling.logit_bias)
    row = row.clone()
    idx = to_device(np.asarray(ids, dtype=np.int64), row.device)
    row[idx] += to_device(np.asarray(biases, dtype=np.float32), row.device).to(row.dtype)
    return row


def apply_penalties(
    row: torch.Tensor, seen: torch.Tensor, output: Seq[int], sampling: Sampling
) -> torch.Tensor:
    """``row`` (logits ``[vocab]``, float) penalized, as a new tensor on ``row``'s device.
    ``seen``: token ids of the prompt (int64 on that device, repeats allowed); ``output``: the
    tokens generated so far (moved with one pinned, non-blocking copy). Nothing here waits for
    the device: the counts are an ``index_add_`` over the vocabulary (``torch.unique`` and
    ``bincount`` size their output from the data, which reads it back)."""
    row = row.clone()
    out = to_device(np.asarray(list(output), dtype=np.int64), row.device)
    rp = sampling.repetition_penalty
    if rp != 1.0:
        idx = torch.cat([seen, out]) if len(out) else seen
        if len(idx):
            vals = row[idx]
            row[idx] = torch.where(vals > 0, vals / rp, vals * rp)
    if len(out) and (sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0):
        counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        # A count of 0 subtracts 0.0, which leaves the logit as it is.
        penalty = counts * sampling.frequency_penalty + sampling.presence_penalty
        row = row - torch.where(counts > 0, penalty, 0.0)
    return row


#: Candidates ``top_p`` looks at before it sorts the whole vocabulary (on the CPU).
_TOP_P_CANDIDATES = TOP_P_CANDIDATES


def top_p_threshold(probs: torch.Tensor, top_p: float, shortcut: bool) -> torch.Tensor:
    """The probability of the least likely token ``top_p`` keeps (0-d, on ``probs``' device):
    the sorted probabilities' first whose running sum reaches ``top_p``. ``shortcut``: look at
    the :data:`_TOP_P_CANDIDATES` largest first and sort everything only where they hold too
    little of the mass (one read of a value: free on the CPU, a sync on a GPU, which sorts the
    whole vocabulary instead). Both give the same threshold: the candidates' running sums are
    the first of the full sort's."""
    n = probs.numel()
    if shortcut:
        k = min(_TOP_P_CANDIDATES, n)
        top = torch.topk(probs, k).values  # sorted, largest first
        csum = torch.cumsum(top, dim=-1)
        if k == n or bool(csum[-1] >= top_p):
            return top[torch.searchsorted(csum, top_p).clamp(max=k - 1)]
    top = torch.sort(probs, descending=True).values
    csum = torch.cumsum(top, dim=-1)
    return top[torch.searchsorted(csum, top_p).clamp(max=n - 1)]


def filter_logits(row: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``row`` (temperature-scaled logits ``[vocab]``) with the tokens ``top_k``, ``top_p`` and
    ``min_p`` remove set to ``-inf`` (in that order; the most likely token always stays), on
    ``row``'s device without reading a value back (but on the CPU, where reading costs
    nothing: :func:`top_p_threshold`)."""
    k = sampling.top_k
    if 0 < k < row.numel():
        kth = torch.topk(row, k).values[-1]
        row = row.masked_fill(row < kth, -math.inf)
    if sampling.top_p < 1.0:
        probs = torch.softmax(row, dim=-1)
        threshold = top_p_threshold(probs, sampling.top_p, row.device.type == "cpu")
        row = row.masked_fill(probs < threshold, -math.inf)
    if sampling.min_p > 0.0:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
        row = row.masked_fill(row < row.max() + math.log(sampling.min_p), -math.inf)
    return row


def _checked(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``probs`` made safe to draw from, and whether they were not (0-d bool): a distribution
    holding NaN (from an infinite logit, say) becomes uniform, so the draw runs on every
    device (CUDA's ``multinomial`` would stop the process with a device-side assert) and the
    row is refused once the flags are read back."""
    bad = torch.isnan(probs).any()
    return torch.where(bad, torch.ones_like(probs), probs), bad


class Pick(tuple):
    """What :func:`sample_row` picks in one row, as 0-d tensors on the row's device:
    ``(token, logprob)`` (``logprob`` None unless asked); ``top``: the ``top_logprobs``
    alternatives as ``(values, ids)``, or None; ``bad``: whether the row's distribution held
    NaN (a sampled row; None otherwise)."""

    top: tuple[torch.Tensor, torch.Tensor] | None
    bad: torch.Tensor | None

    def __new__(
        cls,
        token: torch.Tensor,
        logprob: torch.Tensor | None,
        top: tuple[torch.Tensor, torch.Tensor] | None = None,
        bad: torch.Tensor | None = None,
    ) -> Pick:
        self = super().__new__(cls, (token, logprob))
        self.top, self.bad = top, bad
        return self


def sample_row(
    row: torch.Tensor,
    seq: Sequence,
    greedy_token: int | torch.Tensor,
    output: Seq[int] | None = None,
    draft: int | None = None,
) -> Pick:
    """The token (and its logprob when ``seq`` asks for them) of one row of float logits, with
    every knob of ``seq``, computed on the row's device without waiting for it (see
    :class:`Pick`); ``greedy_token``: the argmax of the raw row. ``output``: the output
    the penalties count (default ``seq.output``). ``draft``: a draft token to verify at this
    row: a sampled row accepts it with its probability under the row's distribution, else draws
    from that distribution without it (:func:`verify_draft`, which reads values back); a greedy
    row takes its argmax as always (the caller compares)."""
    sp = seq.sampling or OFF
    dev = row.device
    raw = row
    if sp.logit_bias:
        row = apply_logit_bias(row, sp)
    if sp.penalized:
        row = apply_penalties(
            row, prompt_ids(seq, dev), seq.output if output is None else output, sp
        )
    bad = None
    if seq.temperature > 0:
        row = row / seq.temperature
        if sp.filtered:
            row = filter_logits(row, sp)
        probs = torch.softmax(row, dim=-1)
        if draft is None:
            probs, bad = _checked(probs)
            tok = torch.multinomial(probs, 1, generator=generator_of(seq, dev))[0]
        else:
            tok = torch.tensor(_accept_or_resample(probs, draft, generator_of(seq, dev)))
    elif sp.penalized or sp.logit_bias:
        tok = row.argmax()
    else:
        tok = torch.as_tensor(greedy_token)
    if not sp.logprobs:
        return Pick(tok, None, None, bad)
    logp = torch.log_softmax(raw, dim=-1)  # the model's own (see the module docstring)
    top = None
    if sp.top_logprobs:
        values, ids = torch.topk(logp, sp.top_logprobs)
        top = (values, ids)
    return Pick(tok, logp[tok.to(dev)], top, bad)


def _accept_or_resample(probs: torch.Tensor, draft: int, generator: torch.Generator) -> int:
    """Rejection sampling of a point-mass draft (Leviathan et al.): ``draft`` with probability
    ``probs[draft]``, else a draw from ``probs`` without it, renormalized. The token's
    distribution is ``probs`` exactly: ``P(x) = p(x)`` for the draft, and ``(1 - p(d)) * p(x) /
    (1 - p(d)) = p(x)`` for every other ``x``."""
    p = float(probs[draft])
    if float(torch.rand((), generator=generator, device=probs.device)) < p:
        return draft
    rest = probs.clone()
    rest[draft] = 0.0
    return int(torch.multinomial(rest, 1, generator=generator))


def _host_pick(pick: Pick, seq: Sequence) -> tuple[int, float | None]:
    """``pick`` read back (``top`` into ``seq.last_top``); a row whose distribution held NaN
    raises ``ValueError``."""
    if pick.bad is not None and bool(pick.bad):
        raise ValueError(_bad_distribution(seq))
    tok, lp = pick
    if pick.top is not None:
        values, ids = pick.top
        seq.last_top = list(zip(ids.tolist(), values.tolist()))
    return int(tok), None if lp is None else float(lp)


def _bad_distribution(seq: Sequence) -> str:
    return (
        f"the sampling distribution of request {seq.id} holds NaN (an infinite logit, or "
        f"every token filtered or banned)"
    )


def verify_draft(
    rows: torch.Tensor, seq: Sequence, draft: Seq[int]
) -> tuple[list[tuple[int, float | None]], list[list[tuple[int, float]] | None], int]:
    """The tokens ``seq`` keeps of one speculative step: ``rows`` (``[len(draft) + 1,
    vocab]``) are the logits after its last token and after each draft token. Row ``j`` gives
    the token at draft position ``j`` exactly as a decode step would (every knob of the request,
    the penalties counting the tokens kept before it): greedy, its argmax, which accepts the
    draft where they are equal; sampled, rejection sampling with the request's own generator
    (:func:`_accept_or_resample`). The first token that differs from its draft (or the token
    after the last draft) ends the list; so does a stop token or the request's length. Each
    row's token is read back before the next (the next row's penalties count it).

    Returns ``(token, logprob)`` per kept token, each token's ``top_logprobs`` alternatives
    (None where not asked), and how many drafts were accepted. A row holding NaN raises
    ``ValueError``."""
    best, nan_rows = greedy_rows(rows)
    plain = seq.sampling is None
    output = list(seq.output)
    items: list[tuple[int, float | None]] = []
    tops: list[list[tuple[int, float]] | None] = []
    room = seq.remaining_new_tokens
    accepted = 0
    for j in range(len(draft) + 1):
        if j in nan_rows:
            raise ValueError(f"the model's logits for request {seq.id} hold NaN")
        d = draft[j] if j < len(draft) else None
        if plain and seq.temperature == 0:
            tok, lp = best[j], None
        else:
            tok, lp = _host_pick(sample_row(rows[j].float(), seq, best[j], output, d), seq)
        items.append((tok, lp))
        tops.append(seq.last_top)
        if d is None or tok != d:
            break
        accepted += 1
        output.append(tok)
        if tok in seq.stop or len(items) >= room:
            break
    return items, tops, accepted


def _argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``argmax`` as torch gives it and whether the value it picked is NaN (int64
    and bool ``[N]`` on ``logits``' device; argmax propagates NaN, so the values it picked tell
    which rows hold one, without scanning ``[N, vocab]`` again). Through numpy for
    float32/float64 logits on the CPU: its argmax runs about 10x faster than torch's there
    (0.23 ms against 2.3 ms for 32 rows of a 49,152-token vocabulary, one thread), and after a
    forward pass every call runs cold, numpy's four here against torch's eight (0.29 -> 0.16 ms
    a step at 8 rows of 8,192)."""
    on_host = _argmax_on_host(logits)
    if on_host is not None:
        best, nan = on_host
        return torch.from_numpy(best.astype(np.int64, copy=False)), torch.from_numpy(nan)
    best_t = logits.argmax(dim=-1)
    return best_t, torch.isnan(logits.gather(-1, best_t[:, None])[:, 0])


def _argmax_on_host(logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """numpy's argmax of each row and whether its pick is NaN, for float32/float64 logits on
    the CPU; None elsewhere."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64):
        return None
    rows = logits.detach().numpy()
    best = rows.argmax(axis=-1)
    return best, np.isnan(rows[np.arange(len(best)), best])


def greedy_rows(logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each row's ``argmax`` as torch gives it (the first maximum of a row, the first NaN of a
    row holding one), and the rows holding NaN (:func:`_argmax_rows`). On a GPU, one
    device-to-host copy of the picks and NaN flags together."""
    on_host = _argmax_on_host(logits)
    if on_host is not None:  # numpy all the way: the CPU's greedy step, as cheap as it was
        best, nan = on_host
        return best.tolist(), np.flatnonzero(nan).tolist() if nan.any() else []
    best_t, nan_t = _argmax_rows(logits)
    both = torch.stack((best_t, nan_t.to(best_t.dtype))).cpu().numpy()
    nan_rows = np.flatnonzero(both[1]).tolist() if both[1].any() else []
    return both[0].tolist(), nan_rows


def sample_tokens(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int | Exception], list[float | None] | None]:
    """One token per row of ``logits [N, vocab]`` (see the module docstring for the knobs):
    argmax where the row's sequence has temperature 0, else a draw from ``softmax(logits /
    temperature)`` with that sequence's own generator (so a request's samples do not depend on
    what it was batched with). A row holding NaN gets an exception in place of a token (greedy
    or not: argmax would pick the NaN); the other rows are unaffected. Also returns each row's
    logprob (None for rows that do not ask), or None when no row asks.

    Everything is computed on the logits' device, the rows with a temperature or knobs all at
    once (:func:`radixkv.engine.batch_sampling.draw`: a step's operations do not grow with its
    rows but for one draw a sampled row, from its generator); what the host needs (the tokens,
    NaN flags, logprobs and alternatives) comes back in one copy at the end, the step's only
    wait for the device."""
    hot = [i for i, s in enumerate(seqs) if s.temperature > 0 or s.sampling is not None]
    if not hot:
        best, nan_rows = greedy_rows(logits)
        tokens: list[int | Exception] = list(best)
        for i in nan_rows:
            tokens[i] = ValueError(f"the model's logits for request {seqs[i].id} hold NaN")
        return tokens, None
    dev = logits.device
    best_t, nan_t = _argmax_rows(logits)
    if len(hot) == len(seqs):
        rows, greedy = logits.float(), best_t
    else:
        idx = to_device(np.asarray(hot, dtype=np.int64), dev)
        rows, greedy = logits.index_select(0, idx).float(), best_t.index_select(0, idx)
    drawn = batch_sampling.draw(rows, [seqs[i] for i in hot], greedy)
    return _read_back(best_t, nan_t, drawn, hot, seqs)


def _read_back(
    best_t: torch.Tensor,
    nan_t: torch.Tensor,
    drawn: Drawn,
    hot: list[int],
    seqs: list[Sequence],
) -> tuple[list[int | Exception], list[float | None] | None]:
    """:func:`sample_tokens`' results in one device-to-host copy: int64 ``[greedy picks (N) |
    NaN flags (N) | drawn tokens (H) | their NaN flags (H) | alternatives' ids | logprobs |
    alternatives' logprobs]``, the float32 values carried as their bits; ``drawn``'s rows are
    the rows ``hot`` of the batch."""
    n, h = len(seqs), len(hot)
    ints = [best_t.long(), nan_t.long(), drawn.tokens.long(), drawn.bad.long()]
    ints += [ids.reshape(-1).long() for _, _, ids in drawn.tops]
    floats = [] if drawn.logprobs is None else [drawn.logprobs]
    floats += [values.reshape(-1) for _, values, _ in drawn.tops]
    if floats:
        ints.append(torch.cat([f.float() for f in floats]).view(torch.int32).long())
    flat = torch.cat(ints).cpu().numpy()  # the one copy
    tokens: list[int | Exception] = flat[:n].tolist()
    sampled = flat[2 * n : 2 * n + h].tolist()
    bad = flat[2 * n + h : 2 * n + 2 * h]
    for j, i in enumerate(hot):
        tokens[i] = ValueError(_bad_distribution(seqs[i])) if bad[j] else int(sampled[j])
    for i in np.flatnonzero(flat[n : 2 * n]).tolist():  # NaN logits: whatever was drawn
        tokens[i] = ValueError(f"the model's logits for request {seqs[i].id} hold NaN")
    at = 2 * n + 2 * h
    top_ids = []
    for _, _, ids in drawn.tops:
        top_ids.append(flat[at : at + ids.numel()].reshape(ids.shape).tolist())
        at += ids.numel()
    values = flat[at:].astype(np.int32).view(np.float32).tolist()
    logprobs: list[float | None] | None = None
    for j, r in enumerate(drawn.logprob_rows):
        i = hot[r]
        if not isinstance(tokens[i], Exception):
            if logprobs is None:
                logprobs = [None] * n
            logprobs[i] = values[j]
    at = len(drawn.logprob_rows)
    for (rows, vals, _), ids in zip(drawn.tops, top_ids):
        k = vals.shape[-1]
        for r, row_ids in zip(rows, ids):
            seqs[hot[r]].last_top = list(zip(row_ids, values[at : at + k]))
            at += k
    return tokens, logprobs
