"""The engine's sampling knobs (``top_p``, ``top_k``, ``min_p``, the penalties, ``logprobs``):
checked like every argument, equal to greedy at their greedy limits, equal to a straightforward
reference implementation, independent of batch-mates, and free for requests that do not use
them (the default path samples exactly as before)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

import radixkv
from radixkv.engine import batch_sampling, sampling
from radixkv.engine.sampling import Sampling, apply_penalties, check_sampling, filter_logits
from tiny_model import VOCAB, dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=11)


def prompt(seed: int, n: int = 20) -> np.ndarray:
    return ids(np.random.default_rng(seed), n)


# ---- the knobs are checked -----------------------------------------------------------------

BAD = [
    ("top_p", 0.0, r"top_p must be a number in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be a number in \(0, 1\]"),
    ("top_p", float("nan"), "top_p must be"),
    ("top_p", "0.5", "top_p must be"),
    ("top_k", -1, r"top_k must be an int >= 0"),
    ("top_k", 2.0, r"top_k must be an int >= 0"),
    ("top_k", True, r"top_k must be an int >= 0"),
    ("min_p", 1.0, r"min_p must be a number in \[0, 1\)"),
    ("min_p", -0.1, r"min_p must be a number in \[0, 1\)"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be a number in \[0.01, 10000\]"),
    ("repetition_penalty", -1.0, r"repetition_penalty must be a number in \[0.01, 10000\]"),
    ("repetition_penalty", math.inf, r"repetition_penalty must be a number in \[0.01, 10000\]"),
    ("repetition_penalty", 1e-300, r"must be a number in \[0.01, 10000\] \(1: off\), got 1e-300"),
    ("repetition_penalty", 1.5e4, r"repetition_penalty must be a number in \[0.01, 10000\]"),
    ("presence_penalty", 2.5, r"presence_penalty must be a number in \[-2, 2\]"),
    ("presence_penalty", math.nan, "presence_penalty must be"),
    ("frequency_penalty", -2.01, r"frequency_penalty must be a number in \[-2, 2\]"),
    ("frequency_penalty", None, "frequency_penalty must be"),
    ("logprobs", 1, "logprobs must be a bool"),
    ("top_logprobs", 21, r"top_logprobs must be an int in \[0, 20\]"),
    ("top_logprobs", -1, r"top_logprobs must be an int in \[0, 20\]"),
    ("top_logprobs", 2, "top_logprobs=2 needs logprobs=True"),
    ("logit_bias", {VOCAB: 5.0}, rf"logit_bias holds token id {VOCAB}, outside the vocabulary"),
    ("logit_bias", {-1: 5.0}, "logit_bias holds token id -1, outside the vocabulary"),
    ("logit_bias", {"7": 5.0}, r"logit_bias keys must be token ids \(ints\), got '7'"),
    ("logit_bias", {7: 100.5}, r"logit_bias of token 7 must be a number in \[-100, 100\]"),
    ("logit_bias", {7: math.nan}, r"logit_bias of token 7 must be a number"),
    ("logit_bias", {7: "1"}, r"logit_bias of token 7 must be a number"),
    ("logit_bias", [7], "logit_bias must be a mapping of token id to bias"),
    ("stop_strings", "stop", "stop_strings must be an iterable of non-empty str"),
    ("stop_strings", [""], "stop_strings must be an iterable of non-empty str"),
    ("stop_strings", [3], "stop_strings must be an iterable of non-empty str"),
    ("on_token", 3, "on_token must be None or callable"),
]


@pytest.mark.parametrize(("name", "value", "match"), BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_every_knob_is_checked_and_nothing_is_registered(name, value, match, engine):
    eng = engine()
    calls = [
        lambda: eng.submit(prompt(0), **{name: value}),
        lambda: eng.branch(prompt(0), [[1], [2]], **{name: value}),
        lambda: eng.generate([prompt(0)], **{name: value}),
        lambda: radixkv.Session(eng).send(prompt(0), **{name: value}),
        lambda: radixkv.Session(eng, system=prompt(1)).branch([[1], [2]], **{name: value}),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()
    assert not eng.sequences and not eng.has_work


def test_a_temperature_below_the_floor_samples_as_the_floor(engine):
    """A temperature in (0, 0.01) is raised to 0.01 (vLLM's rule): logits / 1e-300 overflowed
    and failed the request."""
    from radixkv.engine.engine import MIN_TEMPERATURE

    p = prompt(3)
    eng = engine()
    (floor,) = eng.generate([p], max_new_tokens=8, temperature=MIN_TEMPERATURE, seed=4)
    assert floor.finish_reason == "length"
    for t in (1e-300, 5e-324, 1e-3):
        (r,) = eng.generate([p], max_new_tokens=8, temperature=t, seed=4, logprobs=True)
        assert r.finish_reason == "length" and r.output == floor.output, t
        assert all(math.isfinite(lp) for lp in r.logprobs)


def test_the_order_of_bias_and_penalty_matters_and_is_bias_first():
    """logit_bias before the penalties (vLLM's order): logits [3, 1, 0, -1], +4 on token 1,
    repetition_penalty 2 with token 1 in the prompt: bias first, token 1's 5 halves to 2.5 and
    token 0 (3) wins; penalty first, token 1 gets 0.5 + 4 = 4.5 and wins."""
    from radixkv.engine.sequence import Sequence

    row = torch.tensor([3.0, 1.0, 0.0, -1.0])
    sp = check_sampling(repetition_penalty=2.0, logit_bias={1: 4.0})
    for temperature in (0.0, 0.05):  # greedy, and a draw this cold that takes the top token
        seq = Sequence(0, np.array([1, 1]), 1, temperature=temperature, seed=0, sampling=sp)
        tok, _ = sampling.sample_row(row, seq, greedy_token=0)
        assert tok == 0, temperature
    # Without the penalty the bias wins: the order, not the bias alone, decides.
    seq = Sequence(0, np.array([1, 1]), 1, sampling=check_sampling(logit_bias={1: 4.0}))
    assert sampling.sample_row(row, seq, greedy_token=0)[0] == 1


def test_good_knobs_are_normalized():
    s = check_sampling(top_p=np.float32(0.5), top_k=np.int64(3), stop_strings=("a", "b", "a"))
    assert s == Sampling(top_p=0.5, top_k=3, stop_strings=("a", "b"))
    assert type(s.top_k) is int and type(s.top_p) is float
    assert check_sampling() is sampling.OFF
    # Greedy with filters only: the filters do nothing, so the row takes the plain path.
    assert not Sampling(top_k=5).used(0.0) and Sampling(top_k=5).used(0.5)
    assert Sampling(logprobs=True).used(0.0) and Sampling(repetition_penalty=1.1).used(0.0)
    # logit_bias: sorted pairs, zero biases dropped (all zeros: off), used greedy or not
    s = check_sampling(logit_bias={np.int64(9): 2, 3: -1.5, 4: 0.0})
    assert s == Sampling(logit_bias=((3, -1.5), (9, 2.0))) and s.used(0.0)
    assert check_sampling(logit_bias={4: 0.0}) is sampling.OFF
    assert check_sampling(logit_bias={}) is sampling.OFF


# ---- greedy limits ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "knob", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 0.999}], ids=["top_k=1", "top_p", "min_p"]
)
def test_filters_at_their_greedy_limit_equal_greedy(knob, engine):
    prompts = [prompt(s) for s in range(3)]
    got = engine().generate(prompts, max_new_tokens=10, temperature=1.5, seed=4, **knob)
    want = [dense_greedy(MODEL, p, 10) for p in prompts]
    assert [r.output for r in got] == want
    # The same temperature without the filter samples something else.
    free = engine().generate(prompts, max_new_tokens=10, temperature=1.5, seed=4)
    assert [r.output for r in free] != want


# ---- reference implementations -------------------------------------------------------------


def ref_penalize(logits, prompt_ids, output, rp=1.0, presence=0.0, frequency=0.0):
    """Penalties written out one token at a time (HF / vLLM / OpenAI definitions)."""
    x = [float(v) for v in logits]
    for t in set(int(p) for p in prompt_ids) | set(output):
        x[t] = x[t] / rp if x[t] > 0 else x[t] * rp
    for t, c in Counter(output).items():
        x[t] -= frequency * c + presence * 1.0
    return torch.tensor(x, dtype=torch.float64)


def ref_keep(logits, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    """The tokens the filters keep, written out with sorted lists."""
    x = [float(v) for v in logits]
    keep = set(range(len(x)))
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = {i for i in keep if x[i] >= kth}
    if top_p < 1.0:
        z = sum(math.exp(x[i]) for i in keep)
        p = {i: math.exp(x[i]) / z for i in keep}
        order = sorted(keep, key=lambda i: -p[i])
        total, cut = 0.0, order[-1]
        for i in order:
            total += p[i]
            if total >= top_p:
                cut = i
                break
        keep = {i for i in keep if p[i] >= p[cut]}
    if min_p > 0.0:
        best = max(x[i] for i in keep)
        keep = {i for i in keep if math.exp(x[i] - best) >= min_p}
    return keep


def test_apply_penalties_matches_the_reference():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        row = torch.randn(VOCAB, generator=g) * 3
        prompt_ids = torch.randint(0, VOCAB, (30,), generator=g)
        output = [*torch.randint(0, VOCAB, (12,), generator=g).tolist(), 7, 7, 7]
        rp, pres, freq = 1.0 + trial / 5, (trial % 5 - 2) / 1.5, (trial % 3 - 1) * 0.7
        sp = Sampling(repetition_penalty=rp, presence_penalty=pres, frequency_penalty=freq)
        got = apply_penalties(row, prompt_ids, output, sp)
        want = ref_penalize(row, prompt_ids.tolist(), output, rp, pres, freq)
        assert torch.allclose(got.double(), want, atol=1e-5), trial
        assert not torch.equal(got, row)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(top_k=7),
        dict(top_p=0.5),
        dict(top_p=0.97),
        dict(min_p=0.3),
        dict(top_k=40, top_p=0.8, min_p=0.05),
        dict(top_k=VOCAB + 5, top_p=0.9),
    ],
)
def test_filter_logits_matches_the_reference(knobs):
    g = torch.Generator().manual_seed(1)
    for scale in (0.5, 2.0, 8.0):  # flat distributions need the full sort for top_p
        row = torch.randn(VOCAB, generator=g) * scale
        got = filter_logits(row, Sampling(**knobs))
        kept = set(torch.nonzero(torch.isfinite(got)).flatten().tolist())
        assert kept == ref_keep(row, **knobs), scale
        assert torch.equal(got[list(kept)], row[list(kept)])


def test_greedy_with_penalties_and_logprobs_match_a_dense_reference(engine):
    knobs = dict(repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.9)
    p = prompt(0)
    (r,) = engine().generate([p], max_new_tokens=16, logprobs=True, **knobs)
    seq, out, lps = [int(t) for t in p], [], []
    for _ in range(16):
        logits = MODEL.forward_dense(seq)[-1]
        pen = ref_penalize(logits, p, out, 1.8, 0.5, 0.9)
        tok = int(pen.argmax())
        lps.append(float(torch.log_softmax(logits.double(), -1)[tok]))  # the model's own
        out.append(tok)
        seq.append(tok)
    assert r.output == out
    assert r.output != dense_greedy(MODEL, p, 16)  # the penalties changed something
    assert np.allclose(r.logprobs, lps, atol=1e-4)


def ref_biased_greedy(prompt_, n: int, bias: dict[int, float]) -> tuple[list[int], list[float]]:
    """Greedy decoding over the dense logits plus ``bias``, and each pick's logprob under the
    model's own (unbiased) distribution."""
    seq, out, lps = [int(t) for t in prompt_], [], []
    for _ in range(n):
        raw = MODEL.forward_dense(seq)[-1].double()
        logits = raw.clone()
        for t, b in bias.items():
            logits[t] += b
        tok = int(logits.argmax())
        lps.append(float(torch.log_softmax(raw, -1)[tok]))
        out.append(tok)
        seq.append(tok)
    return out, lps


def test_logit_bias_forces_and_bans_as_a_dense_reference(engine):
    p = prompt(5)
    plain = dense_greedy(MODEL, p, 8)
    forced = next(t for t in range(VOCAB) if t not in plain)
    eng = engine()
    # 100 on a token greedy never picks: it is picked at every step
    (r,) = eng.generate([p], max_new_tokens=8, logit_bias={forced: 100})
    assert r.output == [forced] * 8
    # -100 on greedy's first pick: never picked, and the rest follows the biased reference
    ban = {plain[0]: -100.0}
    (r,) = eng.generate([p], max_new_tokens=8, logit_bias=ban, logprobs=True)
    want, lps = ref_biased_greedy(p, 8, ban)
    assert plain[0] not in r.output and r.output == want
    assert np.allclose(r.logprobs, lps, atol=1e-4)
    # moderate biases on several tokens, batched with a plain request, which is unchanged
    mild = {plain[1]: -3.0, plain[2]: 2.5, forced: 4.0}
    rid = eng.submit(p, max_new_tokens=8, logit_bias=mild)
    other = eng.submit(prompt(6), max_new_tokens=8)
    biased, unbiased = eng.run([rid, other])
    assert biased.output == ref_biased_greedy(p, 8, mild)[0] != plain
    assert unbiased.output == dense_greedy(MODEL, prompt(6), 8)


def test_logit_bias_reaches_every_entry_point_and_sampled_rows(engine):
    p = prompt(7)
    forced = next(t for t in range(VOCAB) if t not in dense_greedy(MODEL, p, 4))
    bias = {forced: 100}
    eng = engine()
    assert (
        eng.generate([p], max_new_tokens=4, temperature=1.0, seed=1, logit_bias=bias)[0].output
        == [forced] * 4
    )
    for r in eng.run(eng.branch(p, [[], [3]], max_new_tokens=3, logit_bias=bias)):
        assert r.output == [forced] * 3
    assert radixkv.Session(eng).send(p, max_new_tokens=3, logit_bias=bias).output == [forced] * 3
    (r,) = radixkv.Session(eng, system=p).branch([[1]], max_new_tokens=3, logit_bias=bias)
    assert r.output == [forced] * 3


def test_sampled_logprobs_are_the_models_own_before_penalties_and_temperature(engine):
    p = prompt(1)
    (r,) = engine().generate(
        [p], max_new_tokens=12, temperature=0.7, top_k=50, seed=3, logprobs=True,
        repetition_penalty=1.3, frequency_penalty=0.4,
    )  # fmt: skip
    seq, want = [int(t) for t in p], []
    for tok in r.output:
        want.append(float(torch.log_softmax(MODEL.forward_dense(seq)[-1].double(), -1)[tok]))
        seq.append(tok)
    assert len(r.logprobs) == len(r.output) == 12
    assert np.allclose(r.logprobs, want, atol=1e-4)


def test_logprobs_of_plain_greedy_rows(engine):
    p = prompt(2)
    (r,) = engine().generate([p], max_new_tokens=6, logprobs=True)
    assert r.output == dense_greedy(MODEL, p, 6)
    seq, want = [int(t) for t in p], []
    for tok in r.output:
        want.append(float(torch.log_softmax(MODEL.forward_dense(seq)[-1].double(), -1)[tok]))
        seq.append(tok)
    assert np.allclose(r.logprobs, want, atol=1e-4)
    (plain,) = engine().generate([p], max_new_tokens=6)
    assert plain.logprobs is None and plain.text is None


def test_a_huge_repetition_penalty_never_repeats_a_token_when_greedy(engine):
    p = prompt(0)
    seen = set(p.tolist())
    plain = dense_greedy(MODEL, p, 24)  # greedy alone repeats itself and the prompt here
    assert len(set(plain)) < len(plain) and seen & set(plain)
    (r,) = engine().generate([p], max_new_tokens=24, repetition_penalty=1e4)
    assert len(set(r.output)) == len(r.output) == 24
    assert not seen & set(r.output)


def test_penalties_apply_to_sampled_rows_too(engine):
    p = prompt(0)
    (r,) = engine().generate(
        [p], max_new_tokens=30, temperature=0.3, seed=2, repetition_penalty=1e4
    )
    assert len(set(r.output)) == 30 and not set(p.tolist()) & set(r.output)


# ---- independence and the default path -----------------------------------------------------

KNOBS = dict(
    temperature=0.9, top_k=60, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
    presence_penalty=0.3, frequency_penalty=0.2, logprobs=True,
)  # fmt: skip


def test_a_request_samples_the_same_alone_and_batched(engine):
    target = prompt(5, 30)
    alone = engine()
    a = alone.submit(target, max_new_tokens=14, seed=21, **KNOBS)
    (ra,) = alone.run([a])
    busy = engine(token_budget=40, max_batch=4)
    busy.submit(prompt(6, 50), max_new_tokens=20, temperature=1.0, seed=21)
    busy.submit(prompt(7, 10), max_new_tokens=20)
    b = busy.submit(target, max_new_tokens=14, seed=21, **KNOBS)
    busy.submit(prompt(8, 33), max_new_tokens=9, seed=1, **KNOBS)
    (rb,) = busy.run([b])
    assert ra.output == rb.output
    assert np.allclose(ra.logprobs, rb.logprobs, atol=1e-4)
    other = engine().generate([target], max_new_tokens=14, seed=22, **KNOBS)[0]
    assert other.output != ra.output  # the seed matters


def test_rows_without_knobs_never_take_the_knob_path(monkeypatch, engine):
    calls = []
    real = batch_sampling.draw

    def spy(rows, seqs, greedy):
        calls.extend(s.id for s in seqs)
        return real(rows, seqs, greedy)

    monkeypatch.setattr(batch_sampling, "draw", spy)
    prompts = [prompt(s) for s in range(4)]
    eng = engine()
    plain = eng.generate(prompts, max_new_tokens=8, top_k=3, top_p=0.5)  # greedy: no-ops
    assert not calls
    assert [r.output for r in plain] == [dense_greedy(MODEL, p, 8) for p in prompts]
    ids_ = [eng.submit(p, max_new_tokens=8) for p in prompts[:3]]
    knob = eng.submit(prompts[3], max_new_tokens=8, repetition_penalty=1.5)
    got = eng.run([*ids_, knob])
    assert calls == [knob] * 8
    assert [r.output for r in got[:3]] == [dense_greedy(MODEL, p, 8) for p in prompts[:3]]


def old_sample(logits_row: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    """The engine's sampling before the knobs existed."""
    probs = torch.softmax(logits_row.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def test_temperature_sampling_without_knobs_is_unchanged(engine):
    p = prompt(3)
    (r,) = engine().generate([p], max_new_tokens=12, temperature=0.8, seed=17)
    gen = torch.Generator().manual_seed(17)
    seq, want = [int(t) for t in p], []
    for _ in range(12):
        tok = old_sample(MODEL.forward_dense(seq)[-1], 0.8, gen)
        want.append(tok)
        seq.append(tok)
    assert r.output == want


def test_default_greedy_path_is_unchanged(engine):
    prompts = [prompt(s, 10 + 7 * s) for s in range(5)]
    eng = engine(token_budget=64, max_batch=3)
    got = eng.generate(prompts, max_new_tokens=9, stop=[int(dense_greedy(MODEL, prompts[0], 9)[4])])
    want = [dense_greedy(MODEL, p, 9, stop=got[0].output[-1:]) for p in prompts]
    assert [r.output for r in got] == want
    assert all(r.logprobs is None and r.text is None for r in got)


def test_a_row_with_one_nan_is_refused_alone():
    """A single NaN among a row's logits makes that row an error; the other rows sample."""
    from radixkv.engine.sampling import sample_tokens
    from radixkv.engine.sequence import Sequence

    logits = torch.randn(3, 1000)
    logits[1, 123] = float("nan")
    seqs = [Sequence(id=i, prompt=np.zeros(1, np.uint32), max_new_tokens=1) for i in range(3)]
    tokens, _ = sample_tokens(logits, seqs)
    assert isinstance(tokens[1], ValueError) and "request 1" in str(tokens[1])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_greedy_rows_are_torchs_argmax_and_name_the_nan_rows(dtype):
    """The greedy pick (numpy's argmax for float32/64 on the CPU) is torch's: the first maximum
    of each row, the first NaN of a row holding one, on contiguous and strided logits; the rows
    holding NaN are named."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=g).to(dtype)
    x[1, 7] = x[1, 200] = x[1].max() + 1  # a tie: the first wins
    x[2, 50] = x[2, 9] = float("nan")
    x[3] = float("-inf")
    x[4, 299] = float("inf")
    x[6, 0] = float("nan")
    for logits in (x, x[:, ::2], x.t().contiguous().t()):
        tokens, nan_rows = sampling.greedy_rows(logits)
        assert tokens == logits.argmax(dim=-1).tolist()
        assert nan_rows == [i for i in range(9) if bool(logits[i].isnan().any())]
    tokens, nan_rows = sampling.greedy_rows(x)
    assert tokens[1] == 7 and tokens[2] == 9 and nan_rows == [2, 6]
    clean = torch.randn(3, 5, generator=g).to(dtype)
    assert sampling.greedy_rows(clean) == (clean.argmax(dim=-1).tolist(), [])


def test_top_logprobs_are_the_largest_of_the_same_distribution(engine):
    p = prompt(4)
    events = []
    (r,) = engine().generate(
        [p], max_new_tokens=5, temperature=0.8, seed=2, logprobs=True, top_logprobs=4,
        on_token=events.append,
    )  # fmt: skip
    seq = [int(t) for t in p]
    assert len(r.top_logprobs) == len(r.output) == 5
    for tok, top in zip(r.output, r.top_logprobs):
        logp = torch.log_softmax(MODEL.forward_dense(seq)[-1].double(), -1)
        values, want = torch.topk(logp, 4)
        assert [t for t, _ in top] == want.tolist()
        assert np.allclose([v for _, v in top], values.numpy(), atol=1e-4)
        seq.append(tok)
    assert [e.top_logprobs for e in events] == r.top_logprobs
    (plain,) = engine().generate([p], max_new_tokens=2, logprobs=True)
    assert plain.top_logprobs is None
