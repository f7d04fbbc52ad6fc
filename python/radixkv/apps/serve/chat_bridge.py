"""The chat-completions request the agent APIs (:mod:`radixkv.apps.serve.responses`,
:mod:`radixkv.apps.serve.messages`) turn theirs into, run in-process as the server's own
``/v1/chat/completions`` runs it (:class:`radixkv.apps.serve.completion.Completion`): one
request validation, one chat rendering, one tool-call parser and one engine submission for
the three APIs. Each API translates the request in and the chat reply (or its chunks) out.

```text
  POST /v1/responses ─┐                                      ┌─> Responses' JSON / events
                      ├─> chat body ─> Completion ─> reply ──┤
  POST /v1/messages ──┘                (engine)              └─> Anthropic's JSON / events
```
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from radixkv.apps.serve.completion import Completion, Server
from radixkv.apps.serve.openai import ChatBody
from radixkv.apps.serve.structured import BadRequest

#: What :func:`run` returns: a whole chat completion, the chunks of a streamed one, or a
#: response to hand back as it is (499: the client went away).
Outcome = dict[str, Any] | AsyncIterator[dict[str, Any]] | Response


def body_of(fields: dict[str, Any]) -> ChatBody:
    """``fields`` (a chat-completions request body) as chat's body model; a
    :class:`BadRequest` naming the first bad field (in chat completions' words)."""
    try:
        return ChatBody.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or "body"
        raise BadRequest(param, f"{err.get('msg', 'invalid')}") from None


async def run(server: Server, request: Request, fields: dict[str, Any]) -> Outcome:
    """Runs ``fields`` (a chat-completions body) as a chat completion with ``request``'s
    headers (its tenant) and connection (a client that goes away cancels it). Raises
    :class:`~radixkv.apps.serve.openai.Refusal` for a refusal (``param`` in chat completions'
    words: each API names its own field), :class:`BadRequest` for a body chat's model
    refuses. A streamed completion's chunks end with an error object (a chunk with an
    ``error`` key) when it fails; closing them early cancels the request."""
    body = body_of(fields)
    completion = Completion.chat(server, body, request)
    await completion.submit()
    if body.stream:
        return completion.chunks()
    return await completion.collect()


def sse(event: str, data: dict[str, Any]) -> str:
    """One server-sent event named ``event`` (the event types both APIs stream)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"
