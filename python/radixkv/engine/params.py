"""`RequestParams`: every per-request knob of the engine, documented and checked once.

:meth:`radixkv.Engine.submit`, :meth:`~radixkv.Engine.branch`, :meth:`~radixkv.Engine.generate`,
:meth:`~radixkv.Engine.chat`, :meth:`~radixkv.Engine.stream` and :class:`radixkv.Session` take
``params=RequestParams(...)``; their keyword form builds one. A ``RequestParams`` checks itself
when it is made (``ValueError`` naming the first bad field and its value) and holds its fields
normalized (``stop`` a frozenset, ``logit_bias`` sorted pairs, a temperature below
:data:`MIN_TEMPERATURE` raised to it). What depends on the engine (token ids against its
vocabulary, a grammar compiled with its tokenizer, whether the pool can hold the request) is
checked by the engine when the request is made.

This module imports no torch (the checks are plain Python and numpy), so the parameters of a
request can be built and checked where torch is absent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

import radixkv
from radixkv.engine.defaults import DEFAULT_MAX_NEW_TOKENS
from radixkv.engine.sequence import OFF, Sampling

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_NEW_TOKENS_LIMIT",
    "MAX_TOP_LOGPROBS",
    "MIN_TEMPERATURE",
    "PRIORITY_MAX",
    "PRIORITY_MIN",
    "SEED_LIMIT",
    "RequestParams",
    "check_logit_bias",
    "check_sampling",
    "check_stop",
]

#: ``max_new_tokens`` bound (exclusive): what the :class:`radixkv.Scheduler` takes.
MAX_NEW_TOKENS_LIMIT = 2**32
#: ``seed`` range: what ``torch.Generator.manual_seed`` takes without wrapping around.
SEED_LIMIT = 2**63
#: ``priority`` range of the :class:`radixkv.Scheduler` (a 32-bit signed integer).
PRIORITY_MIN = -(2**31)
PRIORITY_MAX = 2**31 - 1
#: The lowest temperature sampled with: a temperature in ``(0, MIN_TEMPERATURE)`` is raised to
#: it (vLLM's rule and bound), since dividing logits by less overflows to ``inf``.
MIN_TEMPERATURE = 0.01
#: The most ``top_logprobs`` a request may ask for (OpenAI's bound, and vLLM's default).
MAX_TOP_LOGPROBS = 20
#: The largest ``logit_bias`` magnitude (OpenAI's bound).
MAX_LOGIT_BIAS = 100.0
#: The range of ``repetition_penalty``: a logit is divided (or multiplied) by it, so a value
#: near 0 overflows to ``inf`` (1e-300 did) and a huge one to ``-inf``; 1e4 already bans every
#: token seen.
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 1e4
#: Token ids a request may name before the engine checks them against its vocabulary.
_TOKEN_LIMIT = 2**32


@dataclass(frozen=True)
class RequestParams:
    """How one request generates (every field has the default of :meth:`radixkv.Engine.submit`).

    Length and stopping:

    - ``max_new_tokens``: tokens generated at most (0: prefill only; default 16, why:
      :data:`radixkv.engine.defaults.DEFAULT_MAX_NEW_TOKENS`), an int in ``[0, 2**32)``.
    - ``stop``: token ids that end generation (kept in the output); None: the engine's
      ``stop_tokens`` (the model's end-of-sequence ids for ``radixkv.hf.engine``); ``()``: none.
    - ``stop_strings``: end the request as soon as its text holds one (needs
      ``Engine(tokenizer=...)``; the text is cut before it), non-empty str, repeats dropped.

    Sampling (all off by default; see :mod:`radixkv.engine.sampling`):

    - ``temperature``: 0 is greedy; a finite number >= 0 (one in ``(0, 0.01)`` is raised to
      0.01, :data:`MIN_TEMPERATURE`).
    - ``top_p`` in (0, 1]; ``top_k`` (0: off); ``min_p`` in [0, 1).
    - ``repetition_penalty`` in [0.01, 1e4] (1: off; over prompt and output);
      ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (over the output).
    - ``logit_bias``: OpenAI's, token id -> bias in [-100, 100] added to that token's logit
      before sampling (and before the penalties); held as sorted ``(id, bias)`` pairs without
      the zeros (those pairs are accepted too).
    - ``seed``: the request's own ``torch.Generator`` seed, an int in ``[0, 2**63)`` (branch
      ``i`` of :meth:`~radixkv.Engine.branch` uses ``seed + i``).

    Reporting: ``logprobs`` fills ``Result.logprobs``; ``top_logprobs=k`` (0-20, with
    ``logprobs``) also the ``k`` most likely tokens at each position. ``on_token``: called with
    a :class:`~radixkv.engine.sequence.StreamEvent` per token and at the end, on the thread that
    steps the engine.

    Structured output: ``grammar``, a :class:`radixkv.engine.grammar.Grammar` (a JSON schema, a
    regex, a Lark grammar, any JSON) or a dict (a JSON schema); needs ``Engine(tokenizer=...)``
    and the ``grammar`` extra, and is compiled by the engine when the request is made.

    Scheduling and the cache: ``priority`` (admitted first when higher, an int in
    ``[-2**31, 2**31)``); ``namespace`` (None, a str or bytes: requests in different namespaces
    never share KV); ``retain``, seconds the request's prompt and output stay cached after it
    ends while anything else can be evicted (``math.inf``: until released), and
    ``cache_priority``, the eviction class its pages are raised to (0 ..
    ``radixkv.EVICTION_CLASSES - 1``, 0 evicted first; see SEMANTICS.md, "Eviction classes and
    retention").

    Speculative decoding is an engine setting (``Engine(speculative=...)``), not a request's:
    every request without a grammar is drafted for.
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    stop: frozenset[int] | None = None
    namespace: str | bytes | None = None
    seed: int = 0
    priority: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    stop_strings: tuple[str, ...] = ()
    top_logprobs: int = 0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    on_token: Callable[[Any], object] | None = None
    grammar: Any = None
    retain: float = 0.0
    cache_priority: int = 0
    #: The sampling knobs as the sampler reads them (:data:`OFF` when all are off).
    sampling: Sampling = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        on_token = self.on_token
        if on_token is not None and not callable(on_token):
            raise ValueError(
                f"on_token must be None or callable, got {on_token!r} ({type(on_token).__name__})"
            )
        bias = self.logit_bias
        if isinstance(bias, tuple):  # the normalized pairs (a replace() of a RequestParams)
            bias = dict(bias)
        sampling = check_sampling(
            self.top_p,
            self.top_k,
            self.min_p,
            self.repetition_penalty,
            self.presence_penalty,
            self.frequency_penalty,
            self.logprobs,
            self.stop_strings,
            self.top_logprobs,
            bias,
        )
        set_ = object.__setattr__  # normalized values in a frozen dataclass
        set_(self, "sampling", sampling)
        for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty"):
            set_(self, name, getattr(sampling, name))
        set_(self, "frequency_penalty", sampling.frequency_penalty)
        set_(self, "logprobs", sampling.logprobs)
        set_(self, "stop_strings", sampling.stop_strings)
        set_(self, "top_logprobs", sampling.top_logprobs)
        set_(self, "logit_bias", sampling.logit_bias)
        set_(
            self,
            "max_new_tokens",
            _as_int(
                self.max_new_tokens,
                "max_new_tokens",
                0,
                MAX_NEW_TOKENS_LIMIT - 1,
                "an int in [0, 2**32)",
            ),
        )
        set_(self, "temperature", _check_temperature(self.temperature))
        if self.stop is not None:
            set_(self, "stop", check_stop(self.stop))
        check_namespace(self.namespace)
        set_(self, "seed", _as_int(self.seed, "seed", 0, SEED_LIMIT - 1, "an int in [0, 2**63)"))
        set_(
            self,
            "priority",
            _as_int(
                self.priority, "priority", PRIORITY_MIN, PRIORITY_MAX, "an int in [-2**31, 2**31)"
            ),
        )
        retain, cls = check_keep(self.retain, self.cache_priority)
        set_(self, "retain", retain)
        set_(self, "cache_priority", cls)

    @classmethod
    def of(cls, params: RequestParams | None = None, **knobs) -> RequestParams:
        """``params`` when given (then ``knobs`` must be empty: ``TypeError`` naming them), else
        a ``RequestParams`` of ``knobs`` (``TypeError`` naming a knob it has no field for)."""
        if params is not None:
            if not isinstance(params, RequestParams):
                raise ValueError(
                    f"params must be a radixkv.RequestParams, got {type(params).__name__}"
                )
            base = defaults()
            given = sorted(k for k, v in knobs.items() if k not in base or not _same(v, base[k]))
            if given:
                raise TypeError(
                    f"pass params= or the keyword options, not both (got {given} besides params=)"
                )
            return params
        names = field_names()
        unknown = sorted(set(knobs) - set(names))
        if unknown:
            raise TypeError(f"unknown parameters {unknown}; a request takes {list(names)}")
        return cls(**knobs)

    def keep(self) -> tuple[float, int] | None:
        """``(retain, cache_priority)``, what the request's finish asks of the prefix cache, or
        None when both are off."""
        if self.retain == 0 and self.cache_priority == 0:
            return None
        return self.retain, self.cache_priority


def field_names() -> tuple[str, ...]:
    """The fields a :class:`RequestParams` is made with, in order."""
    return tuple(f.name for f in dataclasses.fields(RequestParams) if f.init)


def defaults() -> dict[str, Any]:
    """Every field of :class:`RequestParams` and its default."""
    return {f.name: f.default for f in dataclasses.fields(RequestParams) if f.init}


def _same(value, default) -> bool:
    """Whether a keyword option was left at its ``default`` (the same object, or an equal one
    of the same type: an array or a list passed for ``()`` counts as given)."""
    return value is default or (type(value) is type(default) and value == default)


# ---- the checks ------------------------------------------------------------------------------


def _as_int(value, name: str, lo: int, hi: int, what: str) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (ints and numpy integers; never ``bool``),
    else ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be {what}, got {v}")
    return v


def _number(value, name: str, what: str) -> float:
    """``value`` as a finite float (ints, floats and numpy numbers; never ``bool``), else
    ``ValueError`` naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ValueError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return v


def _check_temperature(temperature) -> float:
    """``temperature`` as a float, raised to :data:`MIN_TEMPERATURE` when below it but not 0."""
    if isinstance(temperature, (bool, np.bool_)) or not isinstance(
        temperature, (int, float, np.integer, np.floating)
    ):
        raise ValueError(
            f"temperature must be a finite number >= 0, got {temperature!r} "
            f"({type(temperature).__name__})"
        )
    t = float(temperature)
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if 0 < t < MIN_TEMPERATURE:  # logits / 1e-300 overflow to inf: raised, as vLLM does
        t = MIN_TEMPERATURE
    return t


def check_stop(stop, vocab_size: int | None = None, name: str = "stop") -> frozenset[int]:
    """``stop`` (an iterable of token ids, the argument ``name``) as a frozenset; ids in
    ``[0, vocab_size)`` (None: in ``[0, 2**32)``), else ``ValueError`` naming ``name``."""
    if isinstance(stop, (str, bytes, bytearray)) or not isinstance(stop, Iterable):
        raise ValueError(
            f"{name} must be an iterable of token ids, got {stop!r} ({type(stop).__name__})"
        )
    hi = _TOKEN_LIMIT if vocab_size is None else vocab_size
    bound = "2**32" if vocab_size is None else str(vocab_size)
    return frozenset(_as_int(tok, name, 0, hi - 1, f"token ids in [0, {bound})") for tok in stop)


def check_namespace(namespace) -> None:
    """``ValueError`` naming ``namespace`` unless it is None, a str or bytes."""
    if namespace is not None and not isinstance(namespace, (str, bytes)):
        raise ValueError(
            f"namespace must be None, a str or bytes, got {namespace!r} "
            f"({type(namespace).__name__})"
        )


def check_keep(retain, cache_priority, name: str = "retain") -> tuple[float, int]:
    """``retain`` (seconds, the argument ``name``) as a float and ``cache_priority`` (an
    eviction class) as an int, else ``ValueError`` naming the bad one."""
    if isinstance(retain, bool) or not isinstance(retain, (int, float, np.number)):
        raise ValueError(f"{name} must be seconds (a number >= 0), got {retain!r}")
    seconds = float(retain)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"{name} must be seconds >= 0 (or math.inf), got {seconds}")
    top = radixkv.EVICTION_CLASSES - 1
    cls = _as_int(cache_priority, "cache_priority", 0, top, f"an eviction class in [0, {top}]")
    return seconds, cls


def check_seeds(seed: int, num_seeds: int) -> None:
    """``ValueError`` unless the seeds ``seed .. seed + num_seeds - 1`` of a call's branches
    are all valid."""
    what = f"an int in [0, 2**63 - {num_seeds}] (branch i uses seed + i)"
    _as_int(seed, "seed", 0, SEED_LIMIT - num_seeds, what)


def check_sampling(
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    logprobs=False,
    stop_strings=(),
    top_logprobs=0,
    logit_bias=None,
    vocab_size: int | None = None,
) -> Sampling:
    """The knobs checked and normalized; ``ValueError`` naming the first bad one.
    ``vocab_size``: the bound of ``logit_bias``'s token ids (None: not checked)."""
    p = _number(top_p, "top_p", "a number in (0, 1]")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, (int, np.integer)):
        raise ValueError(
            f"top_k must be an int >= 0 (0: off), got {top_k!r} ({type(top_k).__name__})"
        )
    k = int(top_k)
    if k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0: off), got {k}")
    mp = _number(min_p, "min_p", "a number in [0, 1)")
    if not 0.0 <= mp < 1.0:
        raise ValueError(f"min_p must be a number in [0, 1), got {min_p!r}")
    what = f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1: off)"
    rp = _number(repetition_penalty, "repetition_penalty", what)
    if not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
        raise ValueError(f"repetition_penalty must be {what}, got {repetition_penalty!r}")
    pens = []
    for name, value in (
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
    ):
        v = _number(value, name, "a number in [-2, 2]")
        if not -2.0 <= v <= 2.0:
            raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        pens.append(v)
    if not isinstance(logprobs, (bool, np.bool_)):
        raise ValueError(f"logprobs must be a bool, got {logprobs!r} ({type(logprobs).__name__})")
    if isinstance(stop_strings, (str, bytes, bytearray)) or not isinstance(stop_strings, Iterable):
        raise ValueError(
            f"stop_strings must be an iterable of non-empty str, got {stop_strings!r} "
            f"({type(stop_strings).__name__})"
        )
    stops = tuple(stop_strings)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop_strings must be an iterable of non-empty str, holds {s!r}")
    stops = tuple(dict.fromkeys(stops))  # without repeats, in order
    if (
        isinstance(top_logprobs, (bool, np.bool_))
        or not isinstance(top_logprobs, (int, np.integer))
        or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS
    ):
        raise ValueError(
            f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}"
        )
    if top_logprobs and not logprobs:
        raise ValueError(f"top_logprobs={top_logprobs} needs logprobs=True")
    sampling = Sampling(
        p,
        k,
        mp,
        rp,
        pens[0],
        pens[1],
        bool(logprobs),
        stops,
        top_logprobs=int(top_logprobs),
        logit_bias=check_logit_bias(logit_bias, vocab_size),
    )
    return OFF if sampling == OFF else sampling


def check_logit_bias(logit_bias, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (a mapping of token id to a bias in [-100, 100], or None) as
    sorted ``(id, bias)`` pairs without the zero biases; ``ValueError`` naming the first bad id
    or value (messages start with ``logit_bias``, which the server answers as the field)."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, Mapping):
        raise ValueError(
            f"logit_bias must be a mapping of token id to bias, got {logit_bias!r} "
            f"({type(logit_bias).__name__})"
        )
    pairs = {}
    for tok, bias in logit_bias.items():
        if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)):
            raise ValueError(
                f"logit_bias keys must be token ids (ints), got {tok!r} ({type(tok).__name__})"
            )
        tok = int(tok)
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"logit_bias holds token id {tok}, outside the vocabulary {bound}")
        what = f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
        v = _number(bias, f"logit_bias of token {tok}", what)
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias of token {tok} must be {what}, got {bias!r}")
        pairs[tok] = v
    return tuple(sorted((t, v) for t, v in pairs.items() if v != 0.0))
