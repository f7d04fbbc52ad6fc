"""OpenAI's structured output for ``radixkv serve``: ``response_format`` and ``tools`` as an
engine :class:`~radixkv.engine.grammar.Grammar`, and a generated tool call as OpenAI's
``tool_calls``.

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``.
- ``tools`` with ``tool_choice="required"`` (one of the tools) or ``{"type": "function",
  "function": {"name": ...}}`` (that one): the reply is constrained to the JSON object
  ``{"name": NAME, "arguments": ARGS}``, ``ARGS`` valid under that tool's ``parameters``
  schema, and returned as one entry of ``message.tool_calls`` (``finish_reason="tool_calls"``).
  ``tool_choice`` ``"none"``: the reply is free text; ``"auto"`` (or left out with tools): free
  text whose tool calls :mod:`radixkv.apps.serve.tool_calls` parses out.

The name comes first, so the model writes the arguments knowing the tool, and jump-forward
appends the name (a constant for a named tool) and every key at once. How an agent's history of
calls reaches the chat template is :mod:`radixkv.apps.serve.chat_prompt`'s.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from radixkv.engine.grammar import Grammar


class BadRequest(ValueError):
    """A malformed structured-output field: a 400 naming ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


#: The arguments of a tool that declares no ``parameters``: an empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def response_grammar(response_format: Any) -> Grammar | None:
    """The grammar of a request's ``response_format`` (None: free text)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise BadRequest("response_format", f"must be an object, got {response_format!r}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest(
                "response_format",
                'json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
            )
        return _schema(schema, "response_format")
    raise BadRequest(
        "response_format",
        f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
    )


def tool_grammar(tools: list[dict] | None, tool_choice: Any) -> Grammar | None:
    """The grammar of a tool call that ``tool_choice`` demands (None: the model may answer in
    text): ``"required"`` any of ``tools``, a named function that one."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    schemas = _tool_parameters(tools)
    if tool_choice == "required":
        names = list(schemas)
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise BadRequest(
                "tool_choice",
                'a function choice must be {"type": "function", "function": {"name": ...}} '
                f"with the tool's name as a string, got {tool_choice!r}",
            )
        if name not in schemas:
            raise BadRequest("tool_choice", f"names no tool of tools: {name!r}")
        names = [name]
    else:
        raise BadRequest(
            "tool_choice",
            "must be 'none', 'auto', 'required' or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}',
        )
    calls = [_call_schema(n, schemas[n]) for n in names]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return _schema(schema, "tools")


def check_tools(tools: list[dict] | None) -> frozenset[str]:
    """The names of ``tools``; ``BadRequest`` naming the first that is not a function tool."""
    return frozenset(_tool_parameters(tools))


def _tool_parameters(tools: list[dict] | None) -> dict[str, dict]:
    """Each function tool's name and parameter schema, in order."""
    if not tools:
        raise BadRequest("tool_choice", "needs tools to choose from")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(
                f"tools.{i}", 'must be {"type": "function", "function": {"name": ..., ...}}'
            )
        params = fn.get("parameters", NO_PARAMETERS)
        if not isinstance(params, dict):
            raise BadRequest(f"tools.{i}", f"parameters must be a JSON schema, got {params!r}")
        out[fn["name"]] = params
    return out


def _call_schema(name: str, parameters: dict) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _schema(schema: dict, param: str) -> Grammar:
    try:
        return Grammar.json_schema(schema)
    except ValueError as e:
        raise BadRequest(param, str(e)) from None


_ARGUMENTS = '"arguments": '


def tool_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` of a generated call (``{"name": ..., "arguments": {...}}``), the
    arguments as the exact text generated; None when ``text`` is not a whole call (cut by
    ``max_tokens``)."""
    try:
        name = json.loads(text)["name"]
        # The first '"arguments": ' is the call's key: it follows the name (a string, in which
        # a quote is escaped), and keys inside the arguments come after it.
        at = text.index(_ARGUMENTS) + len(_ARGUMENTS)
    except (ValueError, KeyError, TypeError):
        return None
    arguments = text[at:].rstrip()[:-1]  # the object's closing brace is the call's
    function = {"name": name, "arguments": arguments}
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}]
