"""The chat-completions request the agent APIs (:mod:`radixkv.apps.serve.responses`,
:mod:`radixkv.apps.serve.messages`) turn theirs into, run in-process through the server's own
``/v1/chat/completions`` handler: one request validation, one chat rendering, one tool-call
parser and one engine submission for the three APIs. Each API translates the request in and
the chat reply (or its stream of chunks) out.

```text
  POST /v1/responses ─┐                                        ┌─> Responses' JSON / events
                      ├─> chat body ─> chat handler ─> reply ──┤
  POST /v1/messages ──┘                  (engine)              └─> Anthropic's JSON / events
```
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from radixkv.apps.serve.structured import BadRequest


@dataclass
class ChatRefused(Exception):
    """The chat handler's refusal: its status and OpenAI's error fields (``param`` in chat
    completions' words; each API names its own field)."""

    status: int
    message: str
    param: str | None = None
    kind: str | None = None

    def __str__(self) -> str:
        return self.message


#: What :func:`run` returns: a whole chat completion, the chunks of a streamed one, or a
#: response to hand back as it is (499: the client went away).
Outcome = dict[str, Any] | AsyncIterator[dict[str, Any]] | Response


def body_of(app: FastAPI, fields: dict[str, Any]) -> Any:
    """``fields`` (a chat-completions request body) as the chat handler's body model; a
    :class:`BadRequest` naming the first bad field (in chat completions' words)."""
    model = app.state.chat_body
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or "body"
        raise BadRequest(param, f"{err.get('msg', 'invalid')}") from None


async def run(app: FastAPI, request: Request, fields: dict[str, Any]) -> Outcome:
    """Runs ``fields`` (a chat-completions body) through the chat handler with ``request``'s
    headers (its tenant) and connection (a client that goes away cancels it). Raises
    :class:`ChatRefused` for a refusal, :class:`BadRequest` for a body the handler's model
    refuses."""
    body = body_of(app, fields)
    reply = await app.state.chat(body, request)
    if isinstance(reply, JSONResponse):
        error = json.loads(bytes(reply.body)).get("error") or {}
        raise ChatRefused(
            reply.status_code,
            str(error.get("message", "refused")),
            error.get("param"),
            error.get("type"),
        )
    if isinstance(reply, StreamingResponse):
        return _chunks(reply)
    return reply


async def _chunks(reply: StreamingResponse) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed chat completion, parsed; an error object as one chunk with an
    ``error`` key. Closing this generator closes the stream (and cancels the request)."""
    source = reply.body_iterator
    async with contextlib.aclosing(source):  # type: ignore[type-var]
        async for raw in source:
            text = raw if isinstance(raw, str) else bytes(raw).decode()
            for line in text.split("\n"):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                yield json.loads(line[len("data: ") :])


def sse(event: str, data: dict[str, Any]) -> str:
    """One server-sent event named ``event`` (the event types both APIs stream)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"
