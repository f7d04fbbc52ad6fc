"""Anthropic's Messages API on ``radixkv serve``: ``POST /v1/messages``, what the Anthropic SDK
and the agents built on it speak, with its cache breakpoints held by the prefix cache.

A request becomes the chat completion it means (:mod:`radixkv.apps.serve.chat_bridge`):
``system`` (a string or text blocks) as a system message, each message's ``text`` blocks as
its content, ``tool_use`` blocks as an assistant's ``tool_calls`` and ``tool_result`` blocks as
tool messages, ``tools`` (``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool``,
``none``) as chat's, ``stop_sequences`` as ``stop``. Errors are Anthropic's (``{"type":
"error", "error": {"type", "message"}}``), the message naming the field.

``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on a system, tool or message
block (at most 4, as Anthropic's) is a breakpoint: once the reply is computed, the prompt's
prefix up to the exact token where the block ends is retained in the prefix cache for the TTL
(:meth:`radixkv.Engine.retain_prefix`), through pressure that evicts everything else. A
``ttl`` given is honoured up to ``--max-keep-alive`` and a 400 naming the bound past it, as
chat's ``prompt_cache_retention`` (:func:`radixkv.apps.serve.prompt_cache.past_bound`); a
``cache_control`` without one gets Anthropic's default of 5 minutes, or the bound where that
is lower (the client named no TTL for the server to fall short of). Where a block ends is
found by rendering the prompt with a marker at the end of each marked block (the marker
removed, the prompt is the one a chat completion renders; a block the chat template does not
render, such as tools on a template without tools, marks nothing).
``usage.cache_read_input_tokens`` is the prefix cache's hit, ``cache_creation_input_tokens``
the tokens under the last breakpoint computed by this request, ``input_tokens`` the rest: the
three add up to the prompt.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.apps.serve import chat_bridge, chat_prompt, content_parts, prompt_cache
from radixkv.apps.serve.completion import Server
from radixkv.apps.serve.openai import Refusal
from radixkv.apps.serve.structured import BadRequest

#: Anthropic's most ``cache_control`` breakpoints in one request.
MAX_BREAKPOINTS = 4
#: A breakpoint's ``ttl`` values, in seconds.
TTLS = {"5m": 300.0, "1h": 3600.0}
#: The ``ttl`` of a breakpoint that gives none (Anthropic's default).
DEFAULT_TTL = "5m"
#: Fields passed on to the chat request under their own name (radixkv's own among them).
PASSED = ("temperature", "top_p", "top_k", "seed", "cache_salt", "keep_alive", "cache_priority")
#: Fields accepted and unused here.
ACCEPTED = frozenset({"metadata", "service_tier", "thinking", "container", "context_management"})
#: Anthropic's error type of each status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def marker(k: int) -> str:
    """The text that marks the end of breakpoint ``k`` in a rendering (ASCII letters: no
    template escapes them, no tokenizer merges across a removed one)."""
    return f"RADIXKVBREAKPOINT{k}X"


@dataclass
class Breakpoint:
    """A ``cache_control`` block: its field path, its TTL in seconds, and the ``ttl`` it
    gave (None: none given, the default's)."""

    where: str
    ttl: float
    asked: str | None = None


class Converter:
    """Turns a Messages request body into chat messages and tools, twice over: as sent, and
    with :func:`marker` at the end of each ``cache_control`` block."""

    def __init__(self) -> None:
        self.breakpoints: list[Breakpoint] = []

    def mark(self, block: dict[str, Any], where: str) -> str:
        """The marker to append to ``block``'s text ("" when it holds no ``cache_control``)."""
        control = block.get("cache_control")
        if control is None:
            return ""
        if not isinstance(control, dict) or control.get("type") != "ephemeral":
            raise BadRequest(
                f"{where}.cache_control.type",
                f"must be 'ephemeral', got {control!r}",
            )
        ttl = control.get("ttl")
        if ttl is not None and ttl not in TTLS:
            raise BadRequest(
                f"{where}.cache_control.ttl",
                f"must be '5m' or '1h', got {ttl!r}",
            )
        self.breakpoints.append(Breakpoint(where, TTLS[ttl or DEFAULT_TTL], ttl))
        if len(self.breakpoints) > MAX_BREAKPOINTS:
            raise BadRequest(
                f"{where}.cache_control",
                f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                f"Found {len(self.breakpoints)}.",
            )
        return marker(len(self.breakpoints) - 1)

    def text(self, content: Any, where: str) -> tuple[str, str]:
        """A string or text blocks, as sent and marked."""
        if isinstance(content, str):
            return content, content
        if not isinstance(content, list):
            raise BadRequest(where, "must be a string or a list of blocks")
        plain, marked = [], []
        for j, block in enumerate(content):
            w = f"{where}.{j}"
            if not isinstance(block, dict) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, dict) else block
                raise BadRequest(f"{w}.type", f"expected a text block, got {kind!r}")
            text = _string(block, "text", w)
            plain.append(text)
            marked.append(text + self.mark(block, w))
        return content_parts.SEPARATOR.join(plain), content_parts.SEPARATOR.join(marked)

    def messages(self, body: dict[str, Any]) -> tuple[list[dict], list[dict]]:
        """``system`` and ``messages`` as chat messages: as sent, and marked."""
        plain: list[dict[str, Any]] = []
        marked: list[dict[str, Any]] = []
        if body.get("system") is not None:
            a, b = self.text(body["system"], "system")
            plain.append({"role": "system", "content": a})
            marked.append({"role": "system", "content": b})
        given = body.get("messages")
        if not isinstance(given, list) or not given:
            raise BadRequest("messages", "must be a non-empty list of messages")
        for i, m in enumerate(given):
            where = f"messages.{i}"
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                role = m.get("role") if isinstance(m, dict) else m
                raise BadRequest(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
            a_msgs, b_msgs = self.message(m, where)
            plain += a_msgs
            marked += b_msgs
        return plain, marked

    def message(self, m: dict[str, Any], where: str) -> tuple[list[dict], list[dict]]:
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            return [{"role": role, "content": content}], [{"role": role, "content": content}]
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content", "must be a string or blocks")
        texts: list[tuple[str, str]] = []
        calls: list[tuple[dict, dict]] = []
        tools: list[tuple[dict, dict]] = []
        for j, block in enumerate(content):
            w = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text = _string(block, "text", w)
                texts.append((text, text + self.mark(block, w)))
            elif kind == "tool_use" and role == "assistant":
                args = block.get("input", {})
                if not isinstance(args, dict):
                    raise BadRequest(f"{w}.input", "must be an object")
                name, cid = _string(block, "name", w), _string(block, "id", w)
                arguments = json.dumps(args, ensure_ascii=False)
                call = {"id": cid, "type": "function", "function": {"name": name}}
                a = {**call, "function": {"name": name, "arguments": arguments}}
                b = {
                    **call,
                    "function": {"name": name, "arguments": arguments + self.mark(block, w)},
                }
                calls.append((a, b))
            elif kind == "tool_result" and role == "user":
                cid = _string(block, "tool_use_id", w)
                result = block.get("content", "")
                a_text, b_text = self.text(result, f"{w}.content")
                b_text += self.mark(block, w)
                tools.append(
                    (
                        {"role": "tool", "tool_call_id": cid, "content": a_text},
                        {"role": "tool", "tool_call_id": cid, "content": b_text},
                    )
                )
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # a thinking model's own; nothing here renders it
            else:
                raise BadRequest(
                    f"{w}.type",
                    f"blocks of type {kind!r} are not supported in a {role} message "
                    "(text; tool_use from the assistant, tool_result from the user)",
                )
        a_out: list[dict[str, Any]] = [a for a, _ in tools]
        b_out: list[dict[str, Any]] = [b for _, b in tools]
        if texts or calls or not tools:
            sep = content_parts.SEPARATOR
            a_msg: dict[str, Any] = {"role": role, "content": sep.join(a for a, _ in texts)}
            b_msg: dict[str, Any] = {"role": role, "content": sep.join(b for _, b in texts)}
            if calls:
                a_msg["content"] = a_msg["content"] or None
                b_msg["content"] = b_msg["content"] or None
                a_msg["tool_calls"] = [a for a, _ in calls]
                b_msg["tool_calls"] = [b for _, b in calls]
            a_out.append(a_msg)
            b_out.append(b_msg)
        return a_out, b_out

    def tools(self, given: Any) -> tuple[list[dict] | None, list[dict] | None]:
        """Anthropic's ``tools`` as chat's: as sent, and marked (in the description)."""
        if given is None:
            return None, None
        if not isinstance(given, list):
            raise BadRequest("tools", "must be a list")
        plain, marked = [], []
        for i, tool in enumerate(given):
            w = f"tools.{i}"
            if not isinstance(tool, dict):
                raise BadRequest(w, "must be an object")
            if tool.get("type") not in (None, "custom"):
                raise BadRequest(
                    f"{w}.type", f"only custom tools are supported, got {tool['type']!r}"
                )
            name = _string(tool, "name", w)
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise BadRequest(f"{w}.input_schema", "must be a JSON schema")
            about = tool.get("description") or ""
            if not isinstance(about, str):
                raise BadRequest(f"{w}.description", f"must be a string, got {about!r}")
            fn = {"name": name, "description": about, "parameters": schema}
            plain.append({"type": "function", "function": fn})
            marked_fn = {**fn, "description": about + self.mark(tool, w)}
            marked.append({"type": "function", "function": marked_fn})
        return plain, marked


def _string(block: dict[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{name}", f"must be a string, got {value!r}")
    return value


def tool_choice(given: Any) -> tuple[Any, bool | None]:
    """Anthropic's ``tool_choice`` as chat's, and its ``disable_parallel_tool_use`` as
    ``parallel_tool_calls``."""
    if given is None:
        return None, None
    if not isinstance(given, dict):
        raise BadRequest("tool_choice", f"must be an object, got {given!r}")
    kind = given.get("type")
    parallel = False if given.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        name = _string(given, "name", "tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    raise BadRequest("tool_choice.type", "must be auto, any, tool or none")


def chat_fields(body: dict[str, Any], conv: Converter) -> tuple[dict, list, list | None]:
    """The chat body of a Messages request, and its marked messages and tools."""
    unknown = sorted(
        set(body)
        - ACCEPTED
        - set(PASSED)
        - {"model", "max_tokens", "messages", "system", "tools", "tool_choice"}
        - {"stop_sequences", "stream"}
    )
    if unknown:
        raise BadRequest(unknown[0], "Extra inputs are not permitted")
    if not isinstance(body.get("model"), str):
        raise BadRequest("model", "Field required (a string)")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise BadRequest("thinking", "extended thinking is not supported")
    temperature = body.get("temperature")
    if temperature is not None and not (
        isinstance(temperature, (int, float)) and 0 <= temperature <= 1
    ):
        raise BadRequest("temperature", f"must be in [0, 1], got {temperature!r}")
    tools, marked_tools = conv.tools(body.get("tools"))
    plain, marked = conv.messages(body)
    fields: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
    fields.update(model=body["model"], max_tokens=max_tokens, messages=plain)
    if tools:
        fields["tools"] = tools
        choice, parallel = tool_choice(body.get("tool_choice"))
        if choice is not None:
            fields["tool_choice"] = choice
        if parallel is not None:
            fields["parallel_tool_calls"] = parallel
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise BadRequest("stop_sequences", "must be non-empty strings")
        fields["stop"] = stops
    return fields, marked, marked_tools


def breakpoint_tokens(
    tokenizer: Any, marked: list, tools: list | None, n: int, renders_calls: bool
) -> tuple[list[int], list[int]]:
    """Where each of the ``n`` breakpoints ends in the prompt, in tokens (0: its block is not
    rendered), and the prompt's tokens; rendered as a chat completion renders
    (:func:`radixkv.apps.serve.chat_prompt.history` for the tool calls, a template that
    ``renders_calls`` or not)."""
    shown, _ = chat_prompt.history(content_parts.flatten(marked), renders_calls)
    text = tokenizer.apply_chat_template(
        shown, tools=tools, tokenize=False, add_generation_prompt=True
    )
    at: list[int | None] = [None] * n
    plain, pos = [], 0
    while True:  # each marker's offset in the text without markers
        nxt = [(text.find(marker(k), pos), k) for k in range(n)]
        nxt = [(i, k) for i, k in nxt if i >= 0]
        if not nxt:
            plain.append(text[pos:])
            break
        i, k = min(nxt)
        plain.append(text[pos:i])
        at[k] = sum(len(p) for p in plain)
        pos = i + len(marker(k))
    full = "".join(plain)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ends = [e for _, e in enc["offset_mapping"]]
    return [0 if a is None else sum(1 for e in ends if e <= a) for a in at], enc["input_ids"]


def error(status: int, message: str) -> JSONResponse:
    """Anthropic's error object."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status)


def usage(chat_usage: dict[str, Any] | None, written: int) -> dict[str, Any]:
    """Anthropic's ``usage``: the cache's hit read, the breakpointed prefix past it
    (``written``: the last breakpoint's token) created, the rest plain input."""
    chat_usage = chat_usage or {}
    prompt = int(chat_usage.get("prompt_tokens", 0))
    read = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    created = max(0, written - read)
    return {
        "input_tokens": prompt - read - created,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": created,
        "output_tokens": int(chat_usage.get("completion_tokens", 0)),
    }


def stop_reason(finish: str | None) -> str:
    return {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish or "", "end_turn")


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def register(app: FastAPI, server: Server) -> None:
    """Adds ``POST /v1/messages`` to ``app`` (its completions run on ``server``)."""
    loop, tokenizer, config = server.loop, server.tokenizer, server.config
    renders_calls = server.renders_calls

    @app.post("/v1/messages")
    async def create(body: dict[str, Any], request: Request):
        conv = Converter()
        tenant = prompt_cache.tenant_of(request, config)
        try:
            fields, marked, marked_tools = chat_fields(body, conv)
            for point in conv.breakpoints:  # a TTL asked for past the bound: said, not cut
                if point.asked is not None:
                    refused = prompt_cache.past_bound(point.asked, point.ttl, tenant, config)
                    if refused is not None:
                        raise BadRequest(f"{point.where}.cache_control.ttl", refused)
            stream = body.get("stream") is True
            if stream:
                fields["stream"] = True
                fields["stream_options"] = {"include_usage": True}
            # the prompt's tokens and where its breakpoints end, before it is submitted
            points = (
                breakpoint_tokens(
                    tokenizer, marked, marked_tools, len(conv.breakpoints), renders_calls
                )
                if conv.breakpoints
                else None
            )
            outcome = await chat_bridge.run(server, request, fields)
        except BadRequest as e:
            return error(400, _words(str(e)))
        except Refusal as e:
            return error(e.status, _words(e.message))
        if isinstance(outcome, Response):
            return outcome

        async def retain(chat_usage: dict[str, Any] | None) -> int:
            """Retains each breakpoint's prefix; returns the last breakpoint's token."""
            if points is None or chat_usage is None:
                return 0
            ends, prompt = points
            if len(prompt) != chat_usage.get("prompt_tokens"):
                return 0  # not the prompt the chat completion rendered: no breakpoint is placed
            ns = prompt_cache.namespace_of(config.tenant_header, tenant, body.get("cache_salt"))
            bound = prompt_cache.keep_alive_bound(tenant, config)
            eng = loop.engine
            for end, point in zip(ends, conv.breakpoints):
                # a ttl given is within the bound (checked above); the default is cut to it
                ttl = point.ttl if point.asked is not None else min(point.ttl, bound)
                if end > 0 and ttl > 0:
                    await loop.call(lambda e=end, t=ttl: eng.retain_prefix(prompt[:e], t, ns))
            return max(ends, default=0)

        mid = f"msg_{uuid.uuid4().hex}"
        if isinstance(outcome, dict):
            choice = outcome["choices"][0]
            message = choice["message"]
            content: list[dict[str, Any]] = []
            if message.get("content"):
                content.append({"type": "text", "text": message["content"]})
            for call in message.get("tool_calls") or []:
                fn = call["function"]
                content.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": fn["name"],
                        "input": _input(fn["arguments"]),
                    }
                )
            written = await retain(outcome.get("usage"))
            return {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": body["model"],
                "content": content,
                "stop_reason": stop_reason(choice.get("finish_reason")),
                "stop_sequence": None,
                "usage": usage(outcome.get("usage"), written),
            }
        events = _events(outcome, mid, body["model"], retain)
        return StreamingResponse(events, media_type="text/event-stream")


def _words(message: str) -> str:
    """A chat refusal's message with chat's field names in the Messages API's."""
    for chat, ours in (("max_completion_tokens", "max_tokens"), ("stop:", "stop_sequences:")):
        message = message.replace(chat, ours)
    return message


async def _events(
    chunks: AsyncIterator[dict[str, Any]], mid: str, model: str, retain: Any
) -> AsyncIterator[str]:
    """Anthropic's event stream of a streamed chat completion: ``message_start``, each content
    block's ``content_block_start``, deltas and ``content_block_stop``, ``message_delta`` (the
    stop reason and usage), ``message_stop``."""
    sse = chat_bridge.sse
    start_usage = {"input_tokens": 0, "output_tokens": 0}
    message: dict[str, Any] = {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": start_usage,
    }
    yield sse("message_start", {"type": "message_start", "message": message})
    index = -1
    text_open = False
    finish = None
    chat_usage = None
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            if "error" in chunk:
                err = {"type": "api_error", "message": chunk["error"]["message"]}
                yield sse("error", {"type": "error", "error": err})
                return
            if chunk.get("usage"):
                chat_usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                if delta.get("content"):
                    if not text_open:
                        index += 1
                        text_open = True
                        block: dict[str, Any] = {"type": "text", "text": ""}
                        yield sse(
                            "content_block_start",
                            {"type": "content_block_start", "index": index, "content_block": block},
                        )
                    d = {"type": "text_delta", "text": delta["content"]}
                    yield sse(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": d},
                    )
                for call in delta.get("tool_calls") or []:
                    if text_open:
                        yield sse(
                            "content_block_stop", {"type": "content_block_stop", "index": index}
                        )
                        text_open = False
                    index += 1
                    fn = call["function"]
                    block = {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": fn["name"],
                        "input": {},
                    }
                    yield sse(
                        "content_block_start",
                        {"type": "content_block_start", "index": index, "content_block": block},
                    )
                    d = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                    yield sse(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": d},
                    )
                    yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
    if text_open:
        yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
    written = await retain(chat_usage)
    delta = {"stop_reason": stop_reason(finish), "stop_sequence": None}
    yield sse(
        "message_delta",
        {"type": "message_delta", "delta": delta, "usage": usage(chat_usage, written)},
    )
    yield sse("message_stop", {"type": "message_stop"})
