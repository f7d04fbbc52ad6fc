"""Chat message ``content`` given as a list of parts (OpenAI's ``[{"type": "text", "text":
...}]``, what many agent SDKs send): the text parts joined into the one string a chat template
renders, as vLLM does (with newlines between parts); any other part type (``image_url``,
``input_audio``, ``file``) is a :class:`~radixkv.apps.serve.structured.BadRequest` naming the part
and its type, since the server's models read text only."""

from __future__ import annotations

from typing import Any

from radixkv.apps.serve.structured import BadRequest

#: What joins a message's text parts.
SEPARATOR = "\n"


def text_of(content: Any, where: str) -> Any:
    """``content`` with a list of parts as one string; anything else as it is. ``where``: the
    field's path in the request (``messages.3.content``), for the error."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise BadRequest(
                f"{where}.{j}",
                f"content parts of type {kind!r} are not supported: this server's models read "
                "text, so only parts of type 'text' are",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise BadRequest(f"{where}.{j}", f"a text part needs a string 'text', got {text!r}")
        texts.append(text)
    return SEPARATOR.join(texts)


def flatten(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each ``content`` given as parts turned into its text."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": text_of(m["content"], f"messages.{i}.content")}
        out.append(m)
    return out
