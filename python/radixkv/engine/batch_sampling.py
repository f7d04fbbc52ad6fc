"""The knobs of a step's sampled rows, applied to all of them at once.

:func:`draw` does for ``H`` rows what :func:`radixkv.engine.sampling.sample_row` does for one
(the order and meaning of the knobs are in :mod:`radixkv.engine.sampling`'s docstring), in a
number of torch operations that does not grow with ``H`` but for one: each sampled row's noise
comes from its request's own generator, one call a row. Everything else is batched:

- the knobs travel as a few small host arrays whatever ``H`` is (the per-row floats
  ``[H, 6]``; the (row, token id) pairs; the biases; the rows each filter takes), each one
  pinned, non-blocking copy on a GPU;
- ``logit_bias`` is one ``index_put`` over every biased row's ids; the penalties are a
  ``[H, vocab]`` mask of the tokens seen (prompt and output) and a ``[H, vocab]`` count of the
  output's tokens, each built by one ``index_put``;
- ``top_k`` is one ``topk`` of the largest ``k`` asked, each row's threshold gathered at its own
  ``k``; ``top_p`` one softmax, one sort (on the CPU the 256 largest first, as the per-row path)
  and one ``searchsorted`` of each row's ``top_p``; ``min_p`` one row-wise max;
- the draw is ``torch.multinomial``'s own for one sample: ``argmax(probs / q)`` with ``q ~
  Exp(1)`` drawn by the row's generator into its row of ``q``. That is the arithmetic
  ``multinomial`` runs for one sample (the exponential race), on the same generator, so a
  seeded request draws the very tokens it drew row by row (``tests/python/engine``'s
  reference sampler checks it), and a seed repeats;
- logprobs are one ``log_softmax`` of the rows that ask, their alternatives one ``topk`` per
  distinct ``top_logprobs`` (grouped so that ties order as they did row by row).

Nothing here reads a value back to the host, but on the CPU, where the ``top_p`` shortcut reads
one flag (free there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from radixkv.engine.sequence import OFF, Sampling, Sequence
from radixkv.kv.host_copy import to_device

#: Candidates ``top_p`` looks at before it sorts the whole vocabulary (on the CPU), as
#: :func:`radixkv.engine.sampling.top_p_threshold`.
TOP_P_CANDIDATES = 256

# The columns of the per-row float knobs.
_TEMP, _RP, _FREQ, _PRES, _TOP_P, _LOG_MIN_P = range(6)


@dataclass
class Drawn:
    """What :func:`draw` picked for ``H`` rows, on their device: ``tokens`` (int64 ``[H]``),
    ``bad`` (bool ``[H]``: a sampled row whose distribution held NaN); ``logprob_rows`` and
    ``logprobs`` (float32, one per such row); ``tops``: per distinct ``top_logprobs``, the rows
    asking it and their alternatives' values and ids (``[rows, k]`` each)."""

    tokens: torch.Tensor
    bad: torch.Tensor
    logprob_rows: list[int]
    logprobs: torch.Tensor | None
    tops: list[tuple[list[int], torch.Tensor, torch.Tensor]]


class _Knobs:
    """A batch's knobs on its device, from three host arrays: floats ``[H, 6]``, one int64
    array of (row, token id) pairs for the bias, the repetition penalty and the output counts,
    and the biases' values."""

    def __init__(self, seqs: list[Sequence], dev: torch.device) -> None:
        self.sps: list[Sampling] = [s.sampling or OFF for s in seqs]
        floats = np.zeros((len(seqs), 6), dtype=np.float32)
        for j, (s, sp) in enumerate(zip(seqs, self.sps)):
            floats[j] = (
                s.temperature if s.temperature > 0 else 1.0,
                sp.repetition_penalty,
                sp.frequency_penalty,
                sp.presence_penalty,
                sp.top_p,
                math.log(sp.min_p) if sp.min_p > 0.0 else -math.inf,
            )
        self.floats = to_device(floats, dev)
        # (rows, ids) of the biases, of the output tokens the repetition penalty sees, and of
        # the output tokens the presence and frequency penalties count; the biases' values.
        parts: list[list[np.ndarray]] = [[], [], [], [], [], []]
        biases: list[float] = []
        for j, (s, sp) in enumerate(zip(seqs, self.sps)):
            if sp.logit_bias:
                ids, vals = zip(*sp.logit_bias)
                parts[0].append(np.full(len(ids), j))
                parts[1].append(np.asarray(ids))
                biases.extend(vals)
            if not s.output:
                continue
            out = np.asarray(s.output, dtype=np.int64)
            if sp.repetition_penalty != 1.0:
                parts[2].append(np.full(len(out), j))
                parts[3].append(out)
            if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0:
                parts[4].append(np.full(len(out), j))
                parts[5].append(out)
        arrays = [np.concatenate(p).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]
        self.sizes = [len(a) for a in arrays]
        flat = to_device(np.concatenate(arrays), dev)
        self.ints = list(torch.split(flat, self.sizes)) if len(flat) else [flat] * 6
        self.biases = to_device(np.asarray(biases, dtype=np.float32), dev) if biases else None

    def column(self, c: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Float knob ``c`` as a column ``[H, 1]`` (or of the batch's ``rows``)."""
        col = self.floats[:, c : c + 1]
        return col if rows is None else col[rows]


def draw(raw: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor) -> Drawn:
    """The token of each row of ``raw`` (float32 logits ``[H, vocab]``, one row a request of
    ``seqs``, each with a temperature or knobs), every knob applied (see the module);
    ``greedy``: each raw row's argmax (int64 ``[H]``), the pick of a greedy row no bias or
    penalty changes."""
    dev = raw.device
    knobs = _Knobs(seqs, dev)
    rows = raw
    if knobs.biases is not None or any(sp.penalized for sp in knobs.sps):
        rows = _penalized(_biased(raw.clone(), knobs), seqs, knobs)
    tokens = greedy
    changed = [
        j
        for j, (s, sp) in enumerate(zip(seqs, knobs.sps))
        if s.temperature <= 0 and (sp.penalized or sp.logit_bias)
    ]
    if changed:
        idx = to_device(np.asarray(changed, dtype=np.int64), dev)
        tokens = tokens.index_copy(0, idx, rows.index_select(0, idx).argmax(dim=-1))
    bad = torch.zeros(len(seqs), dtype=torch.bool, device=dev)
    hot = [j for j, s in enumerate(seqs) if s.temperature > 0]
    if hot:
        whole = len(hot) == len(seqs)
        idx = to_device(np.asarray(hot, dtype=np.int64), dev)
        part = rows if whole else rows.index_select(0, idx)
        part = part / knobs.column(_TEMP, None if whole else idx)
        part = _filtered(part, [knobs.sps[j] for j in hot], knobs, None if whole else hot)
        probs = torch.softmax(part, dim=-1)
        noise = torch.empty_like(probs)
        # The one loop over rows: each request's generator draws its own row.
        for q, j in zip(noise.unbind(0), hot):
            q.exponential_(generator=generator_of(seqs[j], dev))
        picks = (probs / noise).argmax(dim=-1)
        nan = torch.isnan(probs).any(dim=-1)
        tokens = picks if whole else tokens.index_copy(0, idx, picks)
        bad = nan if whole else bad.index_copy(0, idx, nan)
    return _with_logprobs(raw, tokens, bad, knobs)


def generator_of(seq: Sequence, device: torch.device | str = "cpu") -> torch.Generator:
    """``seq``'s own generator, made on ``device`` (the logits') and seeded with ``seq.seed``
    on first use. A seed repeats on one kind of device: CUDA's generators (Philox) give other
    streams than the CPU's (Mersenne Twister), so a seeded request samples the same tokens
    every time on the CPU and every time on a GPU, not the same on both."""
    if seq.generator is None:
        seq.generator = torch.Generator(device=device).manual_seed(seq.seed)
    return seq.generator


def prompt_ids(seq: Sequence, device: torch.device | str = "cpu") -> torch.Tensor:
    """The distinct token ids of ``seq``'s prompt (int64 on ``device``), computed and moved
    once."""
    device = torch.device(device)
    if seq.prompt_ids is None or seq.prompt_ids.device != device:
        seq.prompt_ids = to_device(np.unique(seq.prompt).astype(np.int64), device)
    return seq.prompt_ids


def _biased(rows: torch.Tensor, knobs: _Knobs) -> torch.Tensor:
    """``rows`` (the batch's own copy) with each row's ``logit_bias`` added, in place."""
    if knobs.biases is not None:
        rows.index_put_((knobs.ints[0], knobs.ints[1]), knobs.biases, accumulate=True)
    return rows


def _penalized(rows: torch.Tensor, seqs: list[Sequence], knobs: _Knobs) -> torch.Tensor:
    """``rows`` (the batch's own copy) with the repetition penalty over the prompt's and the
    output's tokens, then the presence and frequency penalties over the output's counts, in
    place. Only the penalized (row, token) pairs are read and written (a pair listed twice is
    written twice with the same value)."""
    dev = rows.device
    rep = [j for j, sp in enumerate(knobs.sps) if sp.repetition_penalty != 1.0]
    if rep:
        prompts = [prompt_ids(seqs[j], dev) for j in rep]
        owner = to_device(
            np.repeat(np.asarray(rep, dtype=np.int64), [len(p) for p in prompts]), dev
        )
        at = (torch.cat([owner, knobs.ints[2]]), torch.cat([*prompts, knobs.ints[3]]))
        vals = rows[at]
        rp = knobs.floats[at[0], _RP]
        rows.index_put_(at, torch.where(vals > 0, vals / rp, vals * rp))
    if knobs.sizes[4]:
        at = (knobs.ints[4], knobs.ints[5])
        counts = torch.zeros_like(rows).index_put_(
            at, torch.ones((), dtype=rows.dtype, device=dev), accumulate=True
        )[at]
        penalty = counts * knobs.floats[at[0], _FREQ] + knobs.floats[at[0], _PRES]
        rows.index_put_(at, rows[at] - penalty)
    return rows


def _filtered(
    rows: torch.Tensor, sps: list[Sampling], knobs: _Knobs, at: list[int] | None
) -> torch.Tensor:
    """Temperature-scaled ``rows`` (the batch's rows ``at``, or all; a tensor of this step's
    own, changed in place) with ``top_k``, ``top_p`` and ``min_p`` applied per row (in that
    order), each filter over the rows that ask it."""
    dev, vocab = rows.device, rows.shape[-1]
    which = [j for j, sp in enumerate(sps) if 0 < sp.top_k < vocab]
    if which:
        ks = [sps[j].top_k for j in which]
        part, put = _rows(rows, which, dev)
        top = torch.topk(part, max(ks)).values
        kth = top.gather(1, to_device(np.asarray(ks, dtype=np.int64) - 1, dev)[:, None])
        put(part.masked_fill_(part < kth, -math.inf))
    which = [j for j, sp in enumerate(sps) if sp.top_p < 1.0]
    if which:
        part, put = _rows(rows, which, dev)
        probs = torch.softmax(part, dim=-1)
        p = knobs.column(_TOP_P, _batch_rows(which, at, dev))
        threshold = top_p_thresholds(probs, p, dev.type == "cpu")
        put(part.masked_fill_(probs < threshold, -math.inf))
    which = [j for j, sp in enumerate(sps) if sp.min_p > 0.0]
    if which:
        part, put = _rows(rows, which, dev)
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p)
        floor = part.max(dim=-1, keepdim=True).values + knobs.column(
            _LOG_MIN_P, _batch_rows(which, at, dev)
        )
        put(part.masked_fill_(part < floor, -math.inf))
    return rows


def _batch_rows(which: list[int], at: list[int] | None, dev: torch.device) -> torch.Tensor:
    """Rows ``which`` of the filtered part as rows of the whole batch (an index tensor)."""
    rows = which if at is None else [at[j] for j in which]
    return to_device(np.asarray(rows, dtype=np.int64), dev)


def _rows(rows: torch.Tensor, which: list[int], dev: torch.device):
    """Rows ``which`` of ``rows`` (``rows`` itself where they are all), and how to put them
    back into ``rows`` (in place)."""
    if len(which) == len(rows):
        return rows, lambda part: None
    idx = to_device(np.asarray(which, dtype=np.int64), dev)
    return rows.index_select(0, idx), lambda part: rows.index_copy_(0, idx, part)


def top_p_thresholds(probs: torch.Tensor, top_p: torch.Tensor, shortcut: bool) -> torch.Tensor:
    """Each row's probability of the least likely token its ``top_p`` (float32 ``[R, 1]``)
    keeps (``[R, 1]``): the sorted probabilities' first whose running sum reaches it.
    ``shortcut`` (the CPU): the :data:`TOP_P_CANDIDATES` largest first, sorting everything only
    where they hold too little (one flag read back); the thresholds are the same either way."""
    n = probs.shape[-1]
    if shortcut:
        k = min(TOP_P_CANDIDATES, n)
        top = torch.topk(probs, k).values  # sorted, largest first
        csum = torch.cumsum(top, dim=-1)
        if k == n or bool((csum[:, -1:] >= top_p).all()):
            return top.gather(1, torch.searchsorted(csum, top_p).clamp(max=k - 1))
    top = torch.sort(probs, dim=-1, descending=True).values
    csum = torch.cumsum(top, dim=-1)
    return top.gather(1, torch.searchsorted(csum, top_p).clamp(max=n - 1))


def _with_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, bad: torch.Tensor, knobs: _Knobs
) -> Drawn:
    """``tokens`` with the logprobs and alternatives of the rows that ask (of the model's own
    distribution, ``raw``'s)."""
    asks = [j for j, sp in enumerate(knobs.sps) if sp.logprobs]
    if not asks:
        return Drawn(tokens, bad, [], None, [])
    dev = raw.device
    part, _ = _rows(raw, asks, dev)
    idx = to_device(np.asarray(asks, dtype=np.int64), dev)
    logp = torch.log_softmax(part, dim=-1)
    chosen = logp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0]
    tops = []
    for k in sorted({knobs.sps[j].top_logprobs for j in asks} - {0}):
        group = [a for a, j in enumerate(asks) if knobs.sps[j].top_logprobs == k]
        sub, _ = _rows(logp, group, dev)
        values, ids = torch.topk(sub, k)
        tops.append(([asks[a] for a in group], values, ids))
    return Drawn(tokens, bad, asks, chosen, tops)
