"""OpenAI's Responses API on ``radixkv serve``: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, what the OpenAI Agents SDK speaks by default.

A request becomes the chat completion it means (:mod:`radixkv.apps.serve.chat_bridge`):
``input`` (a string, or items: messages, ``function_call``, ``function_call_output``) as chat
messages after ``instructions`` (a system message of this response only), function ``tools``
and ``tool_choice`` as chat's, ``max_output_tokens`` as ``max_tokens``, ``text.format`` as
``response_format``. The reply comes back as output items (a ``message``, ``function_call``
items), ``usage.input_tokens_details.cached_tokens`` the prefix cache's hit.

``previous_response_id`` continues a stored response: the server keeps each response's turn
and the id it continued (``store``, default true) in a :class:`Store` bounded in count and
bytes (the oldest dropped first, counted in ``radixkv_responses_dropped_total``) and per tenant (a
response id of another tenant is a 404, for ``GET``, ``DELETE`` and chaining alike). The chain
is rendered whole again, so the KV of every earlier turn is the cached prefix of the next;
it stays cached with the retention the request asks for (``keep_alive``,
``prompt_cache_retention``) and is evicted like any other.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from radixkv.apps.serve import chat_bridge, content_parts, prompt_cache
from radixkv.apps.serve.completion import Server
from radixkv.apps.serve.openai import Refusal, error
from radixkv.apps.serve.structured import BadRequest

#: Fields of a Responses request passed on to the chat request as they are.
PASSED = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "seed",
    "cache_salt",
    "keep_alive",
    "cache_priority",
    "prompt_cache_key",
    "prompt_cache_retention",
    "top_k",
    "stop",
)
#: Fields accepted and left unused (they change nothing here), beside those passed on.
ACCEPTED = frozenset(
    {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "store"}
    | {"stream", "previous_response_id", "metadata", "include", "truncation", "reasoning"}
    | {"service_tier", "stream_options", "safety_identifier", "top_logprobs", "max_tool_calls"}
)
#: Fields refused unless they hold their no-op value: field -> (no-op test, why).
REFUSED = {
    "background": (lambda v: not v, "background responses are not supported"),
    "conversation": (
        lambda v: v is None,
        "conversations are not supported: use previous_response_id",
    ),
    "prompt": (lambda v: v is None, "prompt templates are not supported"),
}


@dataclass
class Stored:
    """One stored response: its owner (tenant), the response it continued (None: none), its
    own turn's chat messages (its ``input`` and its output; never its ``instructions``), the
    response object ``GET`` answers, and its size in bytes of JSON."""

    tenant: str | None
    previous: str | None
    messages: list[dict[str, Any]]
    response: dict[str, Any]
    size: int


class Store:
    """Stored responses by id, bounded by count and bytes (the least recently stored dropped
    first); thread-safe. Each holds its own turn and the id of the response it continued, so
    that a chain of ``n`` turns is stored in ``O(n)`` bytes; a chain one of whose responses was
    dropped or deleted cannot be continued."""

    def __init__(self, max_count: int = 10_000, max_bytes: int = 256 * 2**20) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        #: Responses dropped to stay within the bounds (not those deleted).
        self.dropped = 0

    def put(
        self, rid: str, tenant: str | None, previous: str | None, messages: list, response: dict
    ) -> None:
        size = len(json.dumps(messages)) + len(json.dumps(response))
        with self._lock:
            self._items[rid] = Stored(tenant, previous, messages, response, size)
            self.bytes += size
            while self._items and (
                len(self._items) > self.max_count or self.bytes > self.max_bytes
            ):
                _, old = self._items.popitem(last=False)
                self.bytes -= old.size
                self.dropped += 1

    def get(self, rid: str, tenant: str | None) -> Stored | None:
        """The response ``rid`` of ``tenant`` (None: unknown, dropped, or another tenant's)."""
        with self._lock:
            item = self._items.get(rid)
        return item if item is not None and item.tenant == tenant else None

    def chain(self, rid: str, tenant: str | None) -> list[dict[str, Any]] | None:
        """The chat messages of the conversation that ends with response ``rid`` of
        ``tenant``, oldest first (None: it, or a response before it, is not stored)."""
        turns = []
        with self._lock:
            at: str | None = rid
            while at is not None:
                item = self._items.get(at)
                if item is None or item.tenant != tenant:
                    return None
                turns.append(item.messages)
                at = item.previous
        return [m for turn in reversed(turns) for m in turn]

    def delete(self, rid: str, tenant: str | None) -> bool:
        with self._lock:
            item = self._items.get(rid)
            if item is None or item.tenant != tenant:
                return False
            del self._items[rid]
            self.bytes -= item.size
            return True

    def __len__(self) -> int:
        return len(self._items)


class StoreCollector:
    """Prometheus metrics of a :class:`Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield GaugeMetricFamily(
            "radixkv_responses_stored", "Responses stored for previous_response_id", len(self.store)
        )
        yield GaugeMetricFamily(
            "radixkv_responses_stored_bytes", "Bytes of the stored responses", self.store.bytes
        )
        yield CounterMetricFamily(
            "radixkv_responses_dropped",
            "Stored responses dropped, oldest first, to stay within the store's bounds",
            self.store.dropped,
        )


# ---- request in -------------------------------------------------------------------------------


#: The part types of a message's ``content`` that hold text.
TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    """A message's ``content``: a string, or parts of text (``input_text``, ``output_text``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(where, f"must be a string or a list of parts, got {content!r}")
    return content_parts.text_of(content, where, TEXT_PARTS, name_fields=True)


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise BadRequest(f"{where}.{name}", f"must be a string, got {value!r}")
    return value


def input_messages(given: Any) -> list[dict[str, Any]]:
    """``input`` (a string or a list of items) as chat messages; a :class:`BadRequest` naming
    the first malformed item's field (``input.2.call_id``)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list):
        raise BadRequest("input", f"must be a string or a list of items, got {given!r}")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise BadRequest(where, f"must be an object, got {item!r}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(
                    f"{where}.role",
                    f"must be user, assistant, system or developer, got {role!r}",
                )
            text = _text(item.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            tool_id = _field(item, "call_id", where)
            out.append({"role": "tool", "tool_call_id": tool_id, "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing for a chat template to render
        else:
            raise BadRequest(
                f"{where}.type",
                f"items of type {kind!r} are not supported (message, "
                "function_call, function_call_output)",
            )
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' function ``tools`` as chat's."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools", f"must be a list, got {tools!r}")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(
                f"tools.{i}.type",
                f"only function tools are supported, got {kind!r}",
            )
        fn: dict[str, Any] = {"name": _field(tool, "name", f"tools.{i}")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' ``tool_choice`` (``"auto"``, ``"none"``, ``"required"``, ``{"type":
    "function", "name"}``) as chat's."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _field(choice, "name", "tool_choice")}}
    raise BadRequest("tool_choice", f"not supported: {choice!r}")


def response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is not None and not isinstance(fmt, dict):
        raise BadRequest("text.format", f"must be an object, got {fmt!r}")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise BadRequest("text.format.type", f"not supported: {fmt.get('type')!r}")


def chat_fields(body: dict[str, Any], conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body of a Responses request ``body`` whose conversation (the
    stored chain it continues and its ``input``, as chat messages) is ``conversation``."""
    for name, (no_op, why) in REFUSED.items():
        if name in body and not no_op(body[name]):
            raise BadRequest(name, f"{why}; got {body[name]!r}")
    unknown = sorted(set(body) - ACCEPTED - set(PASSED) - set(REFUSED))
    if unknown:
        raise BadRequest(unknown[0], "not a field of the Responses API")
    messages = conversation
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("instructions", "must be a string")
        messages = [{"role": "system", "content": instructions}, *messages]
    if not messages:
        raise BadRequest("input", "holds no message")
    fields: dict[str, Any] = {k: body[k] for k in PASSED if body.get(k) is not None}
    fields["messages"] = messages
    tools = chat_tools(body.get("tools"))
    if tools:
        fields["tools"] = tools
        if body.get("tool_choice") is not None:
            fields["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        fields["max_tokens"] = body["max_output_tokens"]
    fmt = response_format(body.get("text"))
    if fmt is not None:
        fields["response_format"] = fmt
    return fields


# ---- reply out --------------------------------------------------------------------------------


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [part] if text or status == "completed" else [],
    }


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat's ``usage`` in Responses' words."""
    if usage is None:
        return None
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _skeleton(rid: str, body: dict[str, Any], model: str, status: str) -> dict[str, Any]:
    """A response object without its output and usage."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": [],
        "usage": None,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "truncation": body.get("truncation", "disabled"),
        "metadata": body.get("metadata") or {},
        "store": body.get("store", True) is not False,
    }


def _finished(response: dict[str, Any], finish: str | None) -> None:
    """Sets ``status`` and ``incomplete_details`` from chat's ``finish_reason``."""
    if finish == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a chain continues."""
    return input_messages([{k: v for k, v in item.items() if k != "id"} for item in output])


# ---- the endpoints ----------------------------------------------------------------------------


def register(app: FastAPI, server: Server, registry: Any = None) -> Store:
    """Adds the Responses endpoints to ``app`` (their completions run on ``server``) and
    their store's metrics to ``registry``; returns the store."""
    config = server.config
    store = Store(config.max_stored_responses, config.max_stored_response_bytes)
    app.state.responses = store
    if registry is not None:
        registry.register(StoreCollector(store))

    @app.post("/v1/responses")
    async def create(body: dict[str, Any], request: Request):
        tenant = prompt_cache.tenant_of(request, config)
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            chain = store.chain(previous, tenant) if isinstance(previous, str) else None
            if chain is None:
                return error(
                    404,
                    f"previous_response_id: no stored response {previous!r} (or one before it "
                    "in its chain was deleted or dropped)",
                    "previous_response_id",
                )
            history = chain
        try:
            if "input" not in body:
                raise BadRequest("input", "is required")
            turn = input_messages(body["input"])
            fields = chat_fields(body, history + turn)
            stream = body.get("stream") is True
            if stream:
                fields["stream"] = True
                fields["stream_options"] = {"include_usage": True}
            outcome = await chat_bridge.run(server, request, fields)
        except BadRequest as e:
            return error(400, str(e), e.param)
        except Refusal as e:
            return error(e.status, e.message, _param(e.param), e.kind)
        if isinstance(outcome, Response):
            return outcome
        rid = f"resp_{uuid.uuid4().hex}"
        model = config.model_name
        keep = body.get("store", True) is not False

        def save(response: dict[str, Any]) -> None:
            if keep:
                messages = turn + output_messages(response["output"])
                store.put(rid, tenant, previous, messages, response)

        if isinstance(outcome, dict):
            response = _skeleton(rid, body, model, "completed")
            choice = outcome["choices"][0]
            message = choice["message"]
            if message.get("content"):
                response["output"].append(_message_item(message["content"]))
            for call in message.get("tool_calls") or []:
                response["output"].append(_call_item(call))
            if not response["output"]:
                response["output"].append(_message_item(""))
            response["usage"] = usage_of(outcome.get("usage"))
            _finished(response, choice.get("finish_reason"))
            save(response)
            return response
        events = _events(outcome, _skeleton(rid, body, model, "in_progress"), save)
        return StreamingResponse(events, media_type="text/event-stream")

    @app.get("/v1/responses/{rid}")
    async def read(rid: str, request: Request):
        stored = store.get(rid, prompt_cache.tenant_of(request, config))
        if stored is None:
            return error(404, f"no stored response {rid!r}", "response_id")
        return stored.response

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str, request: Request):
        if not store.delete(rid, prompt_cache.tenant_of(request, config)):
            return error(404, f"no stored response {rid!r}", "response_id")
        return {"id": rid, "object": "response.deleted", "deleted": True}

    return store


def _param(param: str | None) -> str | None:
    """A chat field's name in the Responses API's words."""
    names = {"max_tokens": "max_output_tokens", "response_format": "text.format"}
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "messages":
        return "input"
    return names.get(head, head) + (f".{rest}" if rest and head not in names else "")


async def _events(
    chunks: AsyncIterator[dict[str, Any]], response: dict[str, Any], save: Any
) -> AsyncIterator[str]:
    """The Responses event stream of a streamed chat completion: ``response.created``, the
    output items with their deltas, ``response.completed`` (or ``response.incomplete``,
    ``response.failed``)."""
    seq = iter(range(1 << 62))

    def event(kind: str, **data: Any) -> str:
        return chat_bridge.sse(kind, {"type": kind, "sequence_number": next(seq), **data})

    yield event("response.created", response=dict(response))
    yield event("response.in_progress", response=dict(response))
    output: list[dict[str, Any]] = response["output"]
    text_item: dict[str, Any] | None = None
    text = ""
    finish = None
    usage = None
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            if "error" in chunk:
                response["status"] = "failed"
                response["error"] = {"code": "server_error", "message": chunk["error"]["message"]}
                yield event("response.failed", response=response)
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                if delta.get("content"):
                    if text_item is None:
                        text_item = _message_item("", "in_progress")
                        index = len(output)
                        output.append(text_item)
                        yield event(
                            "response.output_item.added", output_index=index, item=text_item
                        )
                        part = {"type": "output_text", "text": "", "annotations": []}
                        yield event(
                            "response.content_part.added",
                            item_id=text_item["id"],
                            output_index=index,
                            content_index=0,
                            part=part,
                        )
                    text += delta["content"]
                    yield event(
                        "response.output_text.delta",
                        item_id=text_item["id"],
                        output_index=output.index(text_item),
                        content_index=0,
                        delta=delta["content"],
                        logprobs=[],
                    )
                for call in delta.get("tool_calls") or []:
                    if text_item is not None and text_item["status"] == "in_progress":
                        for done in _text_done(text_item, text, output.index(text_item), event):
                            yield done
                    item = _call_item(call)
                    args = item["arguments"]
                    index = len(output)
                    output.append(item)
                    yield event(
                        "response.output_item.added",
                        output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"},
                    )
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=args,
                    )
                    yield event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=args,
                    )
                    yield event("response.output_item.done", output_index=index, item=item)
    if text_item is not None and text_item["status"] == "in_progress":
        for done in _text_done(text_item, text, output.index(text_item), event):
            yield done
    if not output:
        item = _message_item("")
        output.append(item)
        yield event("response.output_item.added", output_index=0, item=item)
        yield event("response.output_item.done", output_index=0, item=item)
    response["usage"] = usage_of(usage)
    _finished(response, finish)
    save(response)
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield event(kind, response=response)


def _text_done(item: dict[str, Any], text: str, index: int, event: Any) -> list[str]:
    """The events that close a streamed message item holding ``text``."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    item["content"] = [part]
    item["status"] = "completed"
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [
        event("response.output_text.done", **where, text=text, logprobs=[]),
        event("response.content_part.done", **where, part=part),
        event("response.output_item.done", output_index=index, item=item),
    ]
