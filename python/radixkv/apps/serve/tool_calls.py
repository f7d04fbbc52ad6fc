"""Tool calls parsed out of a model's text, for ``tool_choice="auto"`` (``radixkv serve
--tool-call-parser``), in the formats vLLM's and SGLang's parsers of the same names read:

- ``hermes``: Hermes 2 Pro, Qwen 2.5/3 and the models trained on their template write each call
  as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the first call is
  the message's content.
- ``llama3_json``: Llama 3.1/3.2 write a call as bare JSON, ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``; several separated by ``;``); the whole reply
  must be calls, else it is text.

A call is one of the request's declared tools by name, with its arguments as an object
(``arguments`` or ``parameters``; checked against nothing more): JSON the model writes as its
answer (``{"name": "Bob", "age": 30}``) is no call. A reply that holds no call, a call that is not
one, or JSON that does not parse (cut short by ``max_tokens``) is returned as text, whole, as
vLLM's parsers do. Each call comes back in OpenAI's shape, its ``arguments`` a JSON string.

Whether a chat template renders ``tools`` at all is :func:`template_renders_tools`: a template
that ignores them leaves the model unaware of the tools it is offered.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

#: The parsers ``--tool-call-parser`` names.
PARSERS = ("hermes", "llama3_json")

#: A tool call in OpenAI's shape: ``{"id", "type": "function", "function": {"name",
#: "arguments"}}``.
ToolCall = dict[str, Any]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
HERMES_START = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _call(obj: Any, names: Collection[str]) -> ToolCall:
    """The call ``obj`` (parsed JSON) makes; ``ValueError`` unless it names one of ``names`` and
    holds its arguments as an object (``arguments``, or Llama's ``parameters``)."""
    if not isinstance(obj, dict):
        raise ValueError("a tool call is an object")
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        raise ValueError(f"a tool call names a declared tool, not {name!r}")
    key = "arguments" if "arguments" in obj else "parameters"
    if key not in obj:
        raise ValueError("a tool call holds its arguments")
    arguments = obj[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("a tool call's arguments are an object")
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def hermes(text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a Hermes/Qwen reply: each ``<tool_call>`` JSON block (the last
    one may lack its closing tag), a call of one of ``names``, the text before the first as the
    content (None when blank). ``(text, [])`` when there is no call or a block is none."""
    if HERMES_START not in text:
        return text, []
    try:
        calls = [
            _call(json.loads(closed or open_), names) for closed, open_ in _HERMES.findall(text)
        ]
    except (ValueError, RecursionError):
        return text, []
    if not calls:
        return text, []
    content = text[: text.index(HERMES_START)]
    return (content if content.strip() else None), calls


def llama3_json(text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """``(None, calls)`` of a Llama 3 reply that is one or more JSON calls of ``names``
    (``{"name": ..., "parameters": {...}}``, ``arguments`` accepted too), optionally after
    ``<|python_tag|>`` and separated by ``;``; ``(text, [])`` for anything else."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, at = [], 0
    try:
        while at < len(body):
            obj, end = decoder.raw_decode(body, at)
            calls.append(_call(obj, names))
            rest = body[end:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                raise ValueError("text after a tool call")
            at = len(body) - len(rest)
    except (ValueError, RecursionError):
        return text, []
    return None, calls


_PARSE: dict[str, Callable[[str, Collection[str]], tuple[str | None, list[ToolCall]]]] = {
    "hermes": hermes,
    "llama3_json": llama3_json,
}


def parse(parser: str, text: str, names: Collection[str]) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of ``text`` under ``parser`` (one of :data:`PARSERS`), each call
    one of the tools ``names``."""
    return _PARSE[parser](text, names)


def may_be_call(parser: str, text: str) -> bool:
    """Whether a reply that begins with ``text`` may hold a call (streaming holds it back until
    the end): under ``hermes`` once ``<tool_call>`` or a start of it appears, under
    ``llama3_json`` while it begins as JSON or ``<|python_tag|>`` does."""
    if parser == "hermes":
        if HERMES_START in text:
            return True
        return any(text.endswith(HERMES_START[:i]) for i in range(1, len(HERMES_START)))
    head = text.lstrip()
    return head.startswith("{") or PYTHON_TAG.startswith(head) or head.startswith(PYTHON_TAG)


@dataclass(frozen=True)
class Auto:
    """One request's ``tool_choice="auto"``: its server's ``parser``, the ``names`` of its
    ``tools`` (a call names one), and whether it allows several calls
    (``parallel_tool_calls``, true unless sent false: then the first call alone is
    returned)."""

    parser: str
    names: frozenset[str]
    parallel: bool = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = parse(self.parser, text, self.names)
        return content, calls if self.parallel else calls[:1]

    def splitter(self) -> StreamSplitter:
        return StreamSplitter(self.parser, self.names, self.parallel)


#: A tool that no chat template would print unless it renders ``tools``.
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "radixkv_probe_tool",
        "description": "radixkv checks whether the chat template renders tools",
        "parameters": {"type": "object", "properties": {}},
    },
}


def template_renders_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether ``tokenizer``'s chat template (or ``chat_template``) renders ``tools``: a
    conversation rendered with a tool and without differs. False when it refuses tools."""
    messages = [{"role": "user", "content": "Hi"}]
    kwargs: dict[str, Any] = dict(tokenize=False, add_generation_prompt=True)
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        bare = tokenizer.apply_chat_template(messages, **kwargs)
        with_tools = tokenizer.apply_chat_template(messages, tools=[PROBE_TOOL], **kwargs)
    except Exception:  # a template that refuses tools (or is broken) renders none
        return False
    return with_tools != bare


class StreamSplitter:
    """One streamed choice under ``parser`` offered the tools ``names``: :meth:`feed` takes
    each piece of text and returns what may be sent as content now, holding back what may be a
    tool call; :meth:`finish` parses what was held once the reply ends (a call is sent whole,
    as one delta; held text that is no call is sent as content)."""

    def __init__(self, parser: str, names: Collection[str], parallel: bool = True) -> None:
        self.parser, self.names, self.parallel = parser, names, parallel
        self.held = ""
        self.calling = False  # a call has begun: everything to the end is held
        self.free = False  # llama3_json: the reply is text, nothing more is held

    def feed(self, text: str) -> str:
        if self.calling:
            self.held += text
            return ""
        buf, self.held = self.held + text, ""
        if self.free:
            return buf
        if self.parser == "hermes":
            at = buf.find(HERMES_START)
            if at >= 0:
                self.calling, self.held = True, buf[at:]
                return buf[:at]
            keep = next(
                (i for i in range(len(HERMES_START) - 1, 0, -1) if buf.endswith(HERMES_START[:i])),
                0,
            )
            self.held = buf[len(buf) - keep :] if keep else ""
            return buf[: len(buf) - keep]
        if not may_be_call(self.parser, buf):
            self.free = True
            return buf
        head = buf.lstrip()
        self.calling = head.startswith("{") or head.startswith(PYTHON_TAG)
        self.held = buf
        return ""

    def finish(self) -> tuple[str | None, list[ToolCall]]:
        """``(content still to send, calls)`` of what was held."""
        text, self.held = self.held, ""
        if not self.calling:
            return text, []
        content, calls = parse(self.parser, text, self.names)
        return content, calls if self.parallel else calls[:1]
