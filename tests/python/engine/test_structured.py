"""Structured output on the real model (SmolLM2-135M-Instruct): 22 JSON schemas (nested objects,
enums, bounded arrays, integer ranges, string patterns, ``anyOf``, ``$ref``, optional keys), a
regex and a Lark grammar, greedy and sampled, every output checked by an independent validator
(``jsonschema``, Python's ``re`` and ``eval``); jump-forward on and off; a constrained turn after
an unconstrained one on the prefix cache.

Every schema's language is finite (strings have a ``maxLength``, numbers a range), so each
output is complete well within ``max_new_tokens`` whatever the model samples. The requests of a
test run in one engine batch: the model decodes about 10 tokens/s on two CPU cores, and a batch
of 44 rows steps about as fast as one.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import radixkv  # noqa: E402
import radixkv.hf  # noqa: E402
from radixkv.engine import Grammar  # noqa: E402
from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path  # noqa: E402

if smollm2_path() is None:  # pragma: no cover - make test installs it
    pytestmark = pytest.mark.skip(reason=f"the real model is not installed: {SMOLLM2_INSTALL}")


def obj(props: dict, required=None) -> dict:
    """A JSON schema of an object with exactly ``props`` (all required unless said)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 12}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
WEATHER = obj({"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}})
SCHEMAS = {
    "person": obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "color": obj({"color": {"enum": ["red", "green", "blue"]}}),
    "address": obj(
        {
            "user": obj(
                {
                    "name": NAME,
                    "address": obj(
                        {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
                    ),
                }
            )
        }
    ),
    "tags": obj(
        {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            }
        }
    ),
    "temperature": obj({"celsius": {"type": "integer", "minimum": -10, "maximum": 40}}),
    "any_of_scalar": obj(
        {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 999},
                    {"type": "string", "maxLength": 5},
                ]
            }
        }
    ),
    "flag": obj({"done": {"type": "boolean"}, "reason": NAME}),
    "date": obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    "const": obj({"version": {"const": 2}, "name": NAME}),
    "array_of_objects": obj(
        {
            "items": {
                "type": "array",
                "items": obj(
                    {
                        "id": {"type": "integer", "minimum": 0, "maximum": 99},
                        "ok": {"type": "boolean"},
                    }
                ),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    "top_level_array": {"type": "array", "items": DIGIT, "minItems": 2, "maxItems": 4},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "nullable": obj({"note": {"type": ["string", "null"], "maxLength": 10}}),
    "weather": WEATHER,
    "email": obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    "any_of_objects": obj(
        {
            "shape": {
                "anyOf": [
                    obj(
                        {
                            "kind": {"const": "circle"},
                            "r": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                    obj(
                        {
                            "kind": {"const": "square"},
                            "side": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                ]
            }
        }
    ),
    "code": obj(
        {"code": {"type": "string", "minLength": 3, "maxLength": 3, "pattern": "^[A-Z]+$"}}
    ),
    "matrix": obj(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": DIGIT, "minItems": 1, "maxItems": 2},
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    "ref": {
        "$defs": {
            "pt": obj(
                {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                }
            )
        },
        **obj({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}}),
    },
    "optional_key": obj(
        {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}, ["title"]
    ),
    "int_enum": obj({"task": NAME, "priority": {"enum": [1, 2, 3]}}),
    "tool_call": obj({"name": {"const": "get_weather"}, "arguments": WEATHER}),
}


@pytest.fixture(scope="module")
def real():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(2)
    return radixkv.hf.load("smollm2")


def chat(tok, text: str) -> list[int]:
    msgs = [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok.encode(rendered, add_special_tokens=False)


def engine(real, **kw) -> radixkv.Engine:
    model, tok = real
    return radixkv.hf.engine(model, radixkv.RadixCache(32768), tokenizer=tok, **kw)


def test_twenty_two_json_schemas_greedy_and_sampled_all_parse_and_validate(real):
    _, tok = real
    eng = engine(real)
    ids = {}
    for name, schema in SCHEMAS.items():
        prompt = chat(tok, f"Reply with a JSON value for '{name.replace('_', ' ')}'.")
        ids[name, 0.0] = eng.submit(prompt, 96, grammar=schema)
        ids[name, 0.8] = eng.submit(prompt, 96, 0.8, grammar=schema, seed=7, top_p=0.95)
    results = dict(zip(ids, eng.run(list(ids.values()))))
    assert len(SCHEMAS) >= 22
    for (name, temperature), r in results.items():
        assert r.finish_reason == "stop", (name, temperature, r.text, r.error)
        jsonschema.validate(json.loads(r.text), SCHEMAS[name])
    # Jump-forward took every key and bracket: far fewer passes than tokens.
    assert eng.stats.forced_tokens > sum(len(r.output) for r in results.values()) // 3
    eng.cache.check()


def test_a_regex_and_a_lark_grammar_greedy_and_sampled(real):
    _, tok = real
    eng = engine(real)
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    lark = (
        'start: expr\nexpr: term ((" + " | " - " | " * ") term){0,3}\n'
        'term: NUMBER | "(" NUMBER (" + " | " * ") NUMBER ")"\nNUMBER: /[1-9][0-9]?/\n'
    )
    cases = {
        (phone, t): (chat(tok, "Give me a US phone number."), Grammar.regex(phone), t)
        for t in (0.0, 1.0)
    }
    cases |= {
        (lark, t): (chat(tok, "Write an arithmetic expression."), Grammar.lark(lark), t)
        for t in (0.0, 1.0)
    }
    ids = {k: eng.submit(p, 40, t, grammar=g, seed=5) for k, (p, g, t) in cases.items()}
    for (source, _), r in zip(ids, eng.run(list(ids.values()))):
        assert r.finish_reason == "stop", (source, r.text, r.error)
        if source == phone:
            assert re.fullmatch(phone, r.text)
        else:  # an expression of the grammar's integers: Python parses and evaluates it
            assert re.fullmatch(r"[0-9 +*()-]+", r.text) and isinstance(eval(r.text), int)


def test_jump_forward_on_and_off_give_the_same_text_and_save_one_pass_per_forced_token(real):
    _, tok = real
    prompt = chat(tok, "What is the weather in Paris? Call get_weather.")
    schema = SCHEMAS["tool_call"]
    runs = {}
    for jump in (True, False):
        eng = engine(real)
        eng.jump_forward = jump
        (r,) = eng.generate([prompt], max_new_tokens=48, grammar=schema)
        runs[jump] = (r, eng.stats)
    (on, st_on), (off, st_off) = runs[True], runs[False]
    assert on.finish_reason == off.finish_reason == "stop"
    assert on.text == off.text and on.output == off.output
    jsonschema.validate(json.loads(on.text), schema)
    # Each chunk of forced tokens is computed in the pass that computes the token sampled
    # before it (the first one with the prompt): forced tokens + the chunks' sampled tokens,
    # less one pass per chunk, is what jump-forward saves, exactly.
    assert st_off.steps == len(off.output) and st_off.forced_tokens == 0
    assert st_off.steps - st_on.steps == st_on.forced_tokens == on.forced_tokens
    assert st_on.steps * 4 <= st_off.steps  # keys, name and punctuation: most of a tool call


def test_a_constrained_turn_after_an_unconstrained_one_hits_the_cache(real):
    _, tok = real
    eng = engine(real)
    system = chat(tok, "You are a weather assistant. You answer with tool calls. " * 3)
    session = radixkv.Session(eng, system=system)
    free = session.send(tok.encode("Hello!", add_special_tokens=False), max_new_tokens=4)
    hit = eng.cache.stats.hit_tokens
    turn = session.send(
        tok.encode(" Weather in Rome?", add_special_tokens=False),
        max_new_tokens=48,
        grammar=SCHEMAS["tool_call"],
    )
    assert turn.finish_reason == "stop"
    jsonschema.validate(json.loads(turn.text), SCHEMAS["tool_call"])
    # The whole previous turn, prompt and reply, came from the cache (but its last token).
    assert turn.cached_tokens >= free.prompt_tokens + len(free.output) - 1
    assert eng.cache.stats.hit_tokens - hit == turn.cached_tokens
    eng.cache.check()
