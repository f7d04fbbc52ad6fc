"""Request bodies generated from ``radixkv serve``'s own OpenAPI schema (the JSON schema of the
pydantic models the server publishes, read by :func:`from_schema` below), valid ones and ones
with a field replaced by any JSON value, sent to the real command on the real model: never a
5xx, and every refusal is OpenAI's error object. Bounded (replies of at most 2 tokens; in
``make test`` a fixed, derandomized set of 8 examples per endpoint, in ``make test-long`` 100
random ones); any other number: ``RADIXKV_FUZZ_EXAMPLES``.

The generator is ours: hypothesis-jsonschema 0.23.1, the library for it, fails on current
hypothesis (6.170: ``AttributeError: 'many' object has no attribute 'more'``), and pydantic's
schemas use a small part of JSON schema."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import budget  # noqa: E402
import serve_process  # noqa: E402

serve_process.needs_real_server()

MODEL = "smollm2"
EXAMPLES = int(os.environ.get("RADIXKV_FUZZ_EXAMPLES", budget.examples(100, 8)))
ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def server(served):
    url = served("--num-pages", "1024", "--max-model-len", "1024").url
    schema = httpx.get(url + "/openapi.json", timeout=30).json()
    return url, schema


EDGES = (0.0, 5e-324, 1e-300, 1e-9, 0.5, 1.0 - 1e-16, 1.0, 2.0, -2.0, 1e300, -1e300)


def within(value: float, node: dict[str, Any]) -> bool:
    """Whether ``value`` meets the bounds of the number schema ``node``."""
    return not (
        ("minimum" in node and value < node["minimum"])
        or ("exclusiveMinimum" in node and value <= node["exclusiveMinimum"])
        or ("maximum" in node and value > node["maximum"])
        or ("exclusiveMaximum" in node and value >= node["exclusiveMaximum"])
    )


def from_schema(node: dict[str, Any]) -> st.SearchStrategy:
    """Values valid under ``node``: the keywords pydantic emits (``type``, ``anyOf``,
    ``enum``/``const``, ``properties``/``required``/``additionalProperties``, ``items``, the
    bounds of numbers, lengths of strings and arrays); anything else: any JSON value."""
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if "anyOf" in node or "oneOf" in node:
        return st.one_of([from_schema(n) for n in node.get("anyOf", node.get("oneOf"))])
    kind = node.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**node, "type": k}) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo, hi = node.get("minimum"), node.get("maximum")
        lo = int(lo) if lo is not None else None
        lo = int(node["exclusiveMinimum"]) + 1 if "exclusiveMinimum" in node else lo
        hi = int(hi) if hi is not None else None
        hi = int(node["exclusiveMaximum"]) - 1 if "exclusiveMaximum" in node else hi
        return st.integers(lo, hi)
    if kind == "number":
        floats = st.floats(
            node.get("minimum", node.get("exclusiveMinimum")),
            node.get("maximum", node.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in node,
            exclude_max="exclusiveMaximum" in node,
            allow_nan=False,
            allow_infinity=False,
        )
        # The values where arithmetic breaks (an overflow at 1e-300, the smallest subnormal),
        # as often as the rest: a fixed budget of examples rarely draws them otherwise.
        edges = [v for v in EDGES if within(v, node)]
        return st.sampled_from(edges) | floats if edges else floats
    if kind == "string":
        return st.text(min_size=node.get("minLength", 0), max_size=node.get("maxLength", 30))
    if kind == "array":
        items = from_schema(node["items"]) if "items" in node else json_values
        lo = node.get("minItems", 0)
        return st.lists(items, min_size=lo, max_size=max(lo, node.get("maxItems", 3)))
    if kind == "object":
        props = node.get("properties", {})
        required = set(node.get("required", ()))
        extra = node.get("additionalProperties", True)
        values = json_values if extra in (True, None) or extra == {} else from_schema(extra)
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        ) | (
            st.dictionaries(st.text(max_size=8), values, max_size=3) if not props else st.nothing()
        )
    return json_values


def inline(node: Any, components: dict[str, Any]) -> Any:
    """``node`` with every ``{"$ref": "#/components/schemas/X"}`` replaced by X's schema."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            return inline(components[ref.rsplit("/", 1)[1]], components)
        return {k: inline(v, components) for k, v in node.items()}
    if isinstance(node, list):
        return [inline(v, components) for v in node]
    return node


def body_schema(schema: dict[str, Any], path: str) -> dict[str, Any]:
    content = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return inline(content["schema"], schema.get("components", {}).get("schemas", {}))


#: A request each endpoint serves, that :func:`bodies` adds fields to.
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi."}]},
    "/v1/completions": {"prompt": "The sky is"},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
SCALARS = ("number", "integer", "boolean", "string")


def scalar(node: dict[str, Any]) -> bool:
    """Whether ``node`` is a number, integer, boolean or string schema (or one of them or
    null): a field whose valid values the schema itself tells."""
    kinds = [n.get("type") for n in node.get("anyOf", [node])]
    return bool(kinds) and all(k in SCALARS or k == "null" for k in kinds)


@st.composite
def bodies(draw, schema: dict[str, Any], path: str) -> Any:
    """Either a body of the schema's own shape (nested objects and all), or a request the
    endpoint serves with a few scalar fields set to values the schema allows (edges often),
    and maybe one field replaced by any JSON value; the model named the served one most of
    the time (so bodies get past the 404), and replies kept to 2 tokens."""
    props = schema.get("properties", {})
    # (hypothesis draws small values first: the common case is the one that draws 0)
    if draw(st.integers(0, 3)) == 3:
        body = draw(from_schema(schema))
    else:
        body = json.loads(json.dumps(BASES[path]))
        scalars = sorted(k for k, v in props.items() if scalar(v) and k not in body)
        chosen = st.lists(st.sampled_from(scalars), min_size=1, max_size=5, unique=True)
        for k in draw(chosen) if scalars else ():
            body[k] = draw(from_schema(props[k]))
        body.setdefault("model", MODEL)
    if not isinstance(body, dict):
        return body
    if props and draw(st.integers(0, 2)) == 2:
        body[draw(st.sampled_from(sorted(props)))] = draw(json_values)
    for count in ("max_tokens", "max_completion_tokens"):
        value = body.get(count)
        if isinstance(value, int) and not isinstance(value, bool) and value > 2:
            body[count] = 2
    if path.startswith("/v1/") and "max_tokens" not in body:
        body["max_tokens"] = 2
    return body


def check(response: httpx.Response, body: Any) -> None:
    sent = json.dumps(body)[:600]
    assert response.status_code < 500, f"{response.status_code} for {sent}: {response.text[:600]}"
    if response.status_code >= 400:
        err = response.json().get("error")
        assert isinstance(err, dict) and err.get("message"), f"{sent}: {response.text[:600]}"
    elif "text/event-stream" in response.headers.get("content-type", ""):
        assert '"server_error"' not in response.text, f"{sent}: {response.text[-600:]}"


@pytest.mark.parametrize("path", ENDPOINTS)
def test_generated_bodies_are_never_a_5xx(server, path):
    url, schema = server
    body_of = body_schema(schema, path)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=budget.derandomize(),
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(bodies(body_of, path))
    def probe(body):
        check(httpx.post(url + path, json=body, timeout=120), body)

    probe()


def edge_bodies(schema: dict[str, Any], path: str) -> list[dict[str, Any]]:
    """For every number field of the schema, a served request with that field (alone) at each
    edge value its bounds allow, with a temperature of 1 beside it where it is a sampling
    knob (greedy would skip the knob's arithmetic)."""
    out = []
    for name, node in sorted(schema.get("properties", {}).items()):
        for branch in node.get("anyOf", [node]):
            if branch.get("type") != "number":
                continue
            for value in EDGES:
                if within(value, branch):
                    body = {**BASES[path], "model": MODEL, "max_tokens": 2, name: value}
                    if name != "temperature":
                        body.setdefault("temperature", 1.0)
                    out.append(body)
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_number_field_at_its_edges_is_never_a_5xx(server, path):
    url, schema = server
    bodies_ = edge_bodies(body_schema(schema, path), path)
    assert len(bodies_) > 20
    for body in bodies_:
        check(httpx.post(url + path, json=body, timeout=120), body)
