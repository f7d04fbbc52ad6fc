"""Structured output: a grammar that constrains what a request samples, compiled by llguidance.

``Engine.submit(..., grammar=...)`` takes a :class:`Grammar` (a JSON schema, a regular
expression, a Lark grammar, or any JSON value), or a plain ``dict`` read as a JSON schema.
Each request holds a :class:`GrammarState` (its matcher): every step the engine asks the
matchers of the rows it samples for their token masks (:func:`fill_masks`, filled in parallel
by llguidance's executor, one bit per token), applies them to those rows in one batched
operation (:func:`apply_masks`) before penalties, temperature and the filters, then feeds the
sampled tokens back (:meth:`GrammarState.consume`). A request whose grammar is complete (no
byte can follow) stops at once with ``finish_reason="stop"``.

Jump-forward (:meth:`GrammarState.jump`): where the grammar allows one continuation only (the
keys and punctuation of a JSON object with fixed keys, a tool's name), those bytes are
tokenized and appended at once instead of one decode step each; the batcher computes them as
one chunk in the next step, together with the token sampled before them (what the grammar
forces first is prefilled with the prompt). At the boundary the forced bytes are tokenized
together with that sampled token, as SGLang retokenizes (the LMSYS blog post of February 2024
on its compressed finite-state machine): when the tokenizer would merge the two (``"`` then
``, "age": `` is ``",`` `` "`` ``age`` ``":`` for a BPE tokenizer), the merged tokens replace
the sampled one, which has not been computed yet. Trailing tokens that later bytes could still
merge with are left for the model to sample (llguidance's ``compute_ff_tokens`` and
``tokenize_partial`` both hold them back). The forced tokens are output tokens like any other:
they count against ``max_new_tokens`` and are published into the prefix cache.

Why llguidance (over xgrammar and outlines-core, the other libraries vLLM and SGLang use): its
core is Rust, as radixkv's is, and ships as one abi3 wheel per platform with no torch or CUDA
dependency, so it installs wherever radixkv does (xgrammar is C++ with wheels per Python
version and torch among its requirements); it compiles lazily, an Earley parser over a lexer
of derivative-based regexes, so a new JSON schema costs milliseconds and recursive schemas
need no depth bound (outlines-core turns a schema into one regex and indexes its automaton
against the whole vocabulary up front); its JSON-schema support covers ``anyOf``, ``pattern``,
numeric bounds and bounded arrays; and it computes the forced bytes and tokens that
jump-forward needs, with masks in the packed 32-bit layout vLLM and SGLang use.

Compiled grammars are cached per :class:`Compiler` (one per tokenizer and end-of-sequence ids,
shared by every engine that uses that tokenizer): a request gets a copy of the cached matcher,
so a tool schema sent every turn compiles once.

JSON schemas compile with fixed separators (``", "`` between items, ``": "`` after keys) and no
other whitespace unless the schema's ``"x-guidance"`` options say otherwise: a small model left
free to emit whitespace can loop on newlines, and fixed separators are what the jump-forward
forces along with the keys.
"""

from __future__ import annotations

import collections
import json
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import radixkv

__all__ = ["Compiler", "Grammar", "GrammarState", "apply_masks", "compiler_for", "fill_masks"]

#: What ``pip`` installs to make ``grammar=`` work.
INSTALL = "pip install 'radixkv[grammar]'"
#: JSON compile options applied before the schema's own ``"x-guidance"`` (see the docstring).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
#: Compiled grammars a :class:`Compiler` keeps (least recently used dropped first).
CACHE_SIZE = 512

_KINDS = ("json_schema", "regex", "lark", "json")


def llguidance() -> Any:
    """The ``llguidance`` module; when it is not installed, a ``ModuleNotFoundError`` whose one
    line says what to install."""
    try:
        import llguidance
        import llguidance.hf
    except ModuleNotFoundError as e:
        if e.name not in ("llguidance", "transformers"):
            raise
        raise ModuleNotFoundError(
            f"grammar= needs {e.name}, which is not installed: {INSTALL}", name=e.name
        ) from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. Make one with :meth:`json_schema`, :meth:`regex`,
    :meth:`lark` or :meth:`json`; ``kind`` names which, ``source`` is its text (a JSON schema
    serialized as given, key order kept: it is the order the properties are generated in).
    Equal grammars share one compiled copy."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Grammar kind must be one of {_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"Grammar source must be a str, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """Output that is JSON valid under ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"grammar: the JSON schema is not valid JSON: {e}") from None
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(
                    f"grammar: a JSON schema must be an object, got {type(parsed).__name__}"
                )
            schema = parsed
        if not isinstance(schema, (dict, bool)):
            raise ValueError(
                f"grammar: a JSON schema must be a dict or its JSON text, got "
                f"{type(schema).__name__}"
            )
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"grammar: the JSON schema does not serialize to JSON: {e}") from None
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output that matches the regular expression ``pattern`` whole (Rust ``regex``
        syntax, as llguidance reads it)."""
        if not isinstance(pattern, str):
            raise ValueError(f"grammar: a regex must be a str, got {type(pattern).__name__}")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Output that the Lark grammar ``grammar`` (llguidance's dialect, rule ``start``)
        derives."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"grammar: a Lark grammar must be a non-empty str, got {grammar!r}")
        return cls("lark", grammar)

    @classmethod
    def json(cls) -> Grammar:
        """Any JSON value (an object, array, string, number, ``true``, ``false``, ``null``)."""
        return cls("json", "{}")

    @classmethod
    def of(cls, value: Grammar | dict) -> Grammar:
        """``value`` as a grammar: a :class:`Grammar` as is, a dict as a JSON schema; else
        ``ValueError`` saying what to pass."""
        if isinstance(value, Grammar):
            return value
        if isinstance(value, dict):
            return cls.json_schema(value)
        raise ValueError(
            "grammar must be None, a radixkv.Grammar (Grammar.json_schema(...), .regex(...), "
            f".lark(...), .json()) or a dict (a JSON schema), got {value!r} "
            f"({type(value).__name__})"
        )

    def __repr__(self) -> str:
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"Grammar.{self.kind}({text!r})"


class Compiler:
    """Compiles grammars for one tokenizer and caches them; fills masks of a batch.

    ``tokenizer``: a transformers fast tokenizer. ``eos``: the token ids that end a request
    (allowed by the mask once the grammar accepts); empty: the tokenizer's EOS."""

    def __init__(self, tokenizer: Any, eos: tuple[int, ...] = ()) -> None:
        llg = llguidance()
        eos_tokens = list(eos) or None
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, eos_token=eos_tokens)
        except Exception as e:  # a slow (Python) tokenizer, or one llguidance cannot read
            raise ValueError(
                "grammar= needs a transformers fast tokenizer (Engine(tokenizer=...)); "
                f"llguidance cannot use {type(tokenizer).__name__}: {e}"
            ) from None
        self._llg = llg
        self.executor = llg.LLExecutor()
        # Errors name the problem without a dump of the parser's state and the grammar.
        self._limits = llg.LLParserLimits(verbose_errors=False)
        #: Bits per mask row: 32 tokens per int32 word.
        self.words = (self.tokenizer.vocab_size + 31) // 32
        self._cache: collections.OrderedDict[Grammar, Any] = collections.OrderedDict()
        #: Grammars compiled so far (cache misses) and cache hits.
        self.compiled = 0
        self.hits = 0

    def compile(self, grammar: Grammar) -> Any:
        """The fresh (never advanced) llguidance matcher of ``grammar``, compiled once.
        ``ValueError`` naming the problem when it does not compile."""
        template = self._cache.get(grammar)
        if template is not None:
            self._cache.move_to_end(grammar)
            self.hits += 1
            return template
        matcher_cls = self._llg.LLMatcher
        try:
            if grammar.kind in ("json_schema", "json"):
                text = matcher_cls.grammar_from_json_schema(grammar.source, defaults=JSON_DEFAULTS)
            elif grammar.kind == "regex":
                text = matcher_cls.grammar_from_regex(grammar.source)
            else:
                text = matcher_cls.grammar_from_lark(grammar.source)
            template = matcher_cls(self.tokenizer, text, log_level=0, limits=self._limits)
        except ValueError as e:
            raise ValueError(f"grammar: the {_what(grammar)} does not compile: {e}") from None
        if template.is_error():
            raise ValueError(
                f"grammar: the {_what(grammar)} does not compile: {template.get_error().strip()}"
            )
        # llguidance builds the lexer lazily: a grammar it cannot use at all (a schema that is
        # only a reference to itself, say) fails at its first mask. Computed here, on a copy,
        # that is the caller's error before the request runs, not a failure in the middle of it.
        probe = template.deep_copy()
        first = np.zeros(self.words, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        if probe.is_error():
            why = (probe.get_error() or "").replace("<non-verbose/>", "").strip()
            raise ValueError(
                f"grammar: the {_what(grammar)} cannot be used: it matches no output the "
                f"tokenizer can produce ({why or 'no reason given'}; a schema that only refers "
                "to itself does this)"
            )
        self.compiled += 1
        self._cache[grammar] = template
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return template

    def start(self, grammar: Grammar) -> GrammarState:
        """A new request's state: a copy of ``grammar``'s compiled matcher."""
        return GrammarState(self, self.compile(grammar).deep_copy())


class GrammarState:
    """One request's matcher: where its output is in the grammar."""

    __slots__ = ("compiler", "matcher", "unannounced")

    def __init__(self, compiler: Compiler, matcher: Any) -> None:
        self.compiler = compiler
        self.matcher = matcher
        #: Tokens the grammar forced before the first forward pass, appended to the output but
        #: not yet reported (the engine reports them with the first sampled token).
        self.unannounced = 0

    @property
    def complete(self) -> bool:
        """Whether nothing can follow: the output is a whole sentence of the grammar."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> str | None:
        """llguidance's error message once the matcher failed, else None."""
        if not self.matcher.is_error():
            return None
        return self.matcher.get_error() or "unknown error"

    def consume(self, token: int) -> None:
        """Advances over a sampled token; ``radixkv.Error`` if the grammar refuses it (a token
        the mask allowed is never refused)."""
        if not self.matcher.consume_token(int(token)):
            raise radixkv.Error(
                f"the grammar refused token {int(token)}: {self.matcher.get_error() or '?'}"
            )

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` (a speculative draft) the grammar accepts from here
        (none once it is complete); the matcher is left where it was."""
        m = self.matcher
        if not tokens or m.is_stopped() or m.is_error():
            return []
        done = m.try_consume_tokens([int(t) for t in tokens])  # never enters the error state
        if done:
            m.rollback(done)
        return [int(t) for t in tokens[:done]]

    def masks_along(self, tokens: list[int]) -> np.ndarray:
        """The token masks (as :func:`fill_masks` gives them) here and after each token of
        ``tokens`` (a draft :meth:`allowed_prefix` kept): ``[len(tokens) + 1, words]``, row
        ``j`` the mask after ``tokens[:j]``; the matcher is left where it was."""
        m = self.matcher
        masks = np.zeros((len(tokens) + 1, self.compiler.words), dtype=np.int32)
        done = 0
        try:
            for j in range(len(tokens) + 1):
                m.unsafe_compute_mask_ptr(masks[j].ctypes.data, masks[j].nbytes)
                if j < len(tokens):
                    if not m.consume_token(int(tokens[j])):
                        raise radixkv.Error(f"the grammar refused draft token {int(tokens[j])}")
                    done += 1
        finally:
            if done:
                m.rollback(done)
        return masks

    def jump(self, last: int | None, limit: int, vocab: int) -> tuple[list[int], bool]:
        """Jump-forward, after :meth:`consume` of ``last`` (None: before the first token):
        the tokens of the bytes the grammar forces now, consumed: at most ``limit`` of them,
        and none from the first one at or past ``vocab`` (the model's vocabulary) on.
        Returns ``(tokens, replaces_last)``: with ``replaces_last`` the tokens start with a
        retokenization of ``last`` merged with the forced bytes, to be appended in its place
        (``limit + 1`` tokens at most then)."""
        m = self.matcher
        if limit <= 0 or m.is_stopped():
            return [], False
        forced = m.compute_ff_bytes()
        if not forced:
            return [], False
        if last is not None:
            merged = self._merge(last, forced, _within(limit + 1, vocab))
            if merged:
                return merged, True
        tokens = _within(limit, vocab)(m.compute_ff_tokens())
        if not tokens:
            return [], False
        done = m.try_consume_tokens(tokens)
        if done < len(tokens):  # never seen: llguidance's own tokens refused; undo them
            m.rollback(done)
            return [], False
        return tokens, False

    def _merge(self, last: int, forced: bytes, cut: Callable[[list[int]], list[int]]) -> list[int]:
        """When the tokenizer merges ``last`` with the ``forced`` bytes that follow it, the
        merged tokens (``cut`` to what may be appended; consumed in place of ``last``), else
        ``[]`` (nothing changed)."""
        tok, m = self.compiler.tokenizer, self.matcher
        head = tok.decode_bytes([last])
        whole = tok.tokenize_bytes(head + forced)
        if not whole or whole[0] == last:
            return []
        # Only the tokens no later byte can change (tokenize_partial's guarantee), and they
        # must hold every byte of the sampled token: its bytes are never given back.
        safe, _ = tok.tokenize_partial(head + forced)
        safe = cut(list(safe))
        if not safe or safe[0] == last or len(tok.decode_bytes(safe)) <= len(head):
            return []
        if not m.rollback(1):
            return []
        done = m.try_consume_tokens(safe)
        if done == len(safe):
            return safe
        m.rollback(done)  # undo, and take the sampled token back as it was
        m.consume_token(last)
        return []


def _within(limit: int, vocab: int) -> Callable[[list[int]], list[int]]:
    """Cuts a token list to its first ``limit`` tokens, and before any id ``>= vocab``."""

    def cut(tokens: list[int]) -> list[int]:
        tokens = list(tokens[:limit])
        for i, t in enumerate(tokens):
            if t >= vocab:
                return tokens[:i]
        return tokens

    return cut


def _what(grammar: Grammar) -> str:
    return {
        "json_schema": "JSON schema",
        "json": "JSON grammar",
        "regex": "regex",
        "lark": "Lark grammar",
    }[grammar.kind]


#: Compilers by tokenizer (weakly: they go with it) and end-of-sequence ids.
_COMPILERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Compiler]] = (
    weakref.WeakKeyDictionary()
)


def compiler_for(tokenizer: Any, eos: tuple[int, ...] = ()) -> Compiler:
    """The :class:`Compiler` of ``tokenizer`` and ``eos``, made once and shared (so two engines
    over one tokenizer share one cache of compiled grammars)."""
    try:
        by_eos = _COMPILERS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: a compiler of its own each time
        return Compiler(tokenizer, eos)
    compiler = by_eos.get(eos)
    if compiler is None:
        compiler = by_eos[eos] = Compiler(tokenizer, eos)
    return compiler


def fill_masks(compiler: Compiler, states: list[GrammarState]) -> np.ndarray:
    """The token masks of ``states`` (int32 ``[len(states), words]``, bit ``t % 32`` of word
    ``t // 32`` set when token ``t`` is allowed), computed in parallel by llguidance's
    executor. A matcher in an error state gets an all-zero row."""
    mask = np.zeros((len(states), compiler.words), dtype=np.int32)
    if len(states) == 1:  # on this thread: no hand-off to the executor's pool
        states[0].matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    elif states:
        compiler.executor.unsafe_compute_mask_ptr(
            [(s.matcher, i) for i, s in enumerate(states)],
            mask.ctypes.data,
            compiler.words * 4,
            len(states),
        )
    return mask


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack(mask: np.ndarray, device: torch.device) -> torch.Tensor:
    """``mask`` (int32 ``[N, words]``, see :func:`fill_masks`) as bools ``[N, 32 * words]`` on
    ``device``: unpacked by numpy on the CPU, else sent packed (a 32nd of the bytes) and
    unpacked there."""
    if device.type == "cpu" and sys.byteorder == "little":
        bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        return torch.from_numpy(bits)
    return unpack_on(mask, device)


def unpack_on(mask: np.ndarray, device: torch.device) -> torch.Tensor:
    """:func:`unpack` by torch on ``device`` (one shift-and-mask over the packed words)."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    packed = torch.from_numpy(mask).to(device, non_blocking=True)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(len(mask), -1).bool()


def apply_masks(logits: torch.Tensor, rows: list[int], mask: np.ndarray) -> list[bool]:
    """Sets to ``-inf`` the logits of every token ``mask`` forbids, for the ``rows`` of
    ``logits [N, vocab]`` (row ``rows[i]`` takes ``mask[i]``), in one batched operation on
    the logits' device; tokens past the mask's vocabulary are forbidden. Returns, per row,
    whether any token is left."""
    device = logits.device
    bits = unpack(mask, device)
    vocab = logits.shape[1]
    if bits.shape[1] >= vocab:
        bits = bits[:, :vocab]
    else:
        pad = torch.zeros(len(rows), vocab - bits.shape[1], dtype=torch.bool, device=device)
        bits = torch.cat([bits, pad], dim=1)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(~bits, -torch.inf)
    else:
        index = torch.tensor(rows, device=device)
        logits[index] = logits[index].masked_fill(~bits, -torch.inf)
    return bits.any(dim=1).tolist()
