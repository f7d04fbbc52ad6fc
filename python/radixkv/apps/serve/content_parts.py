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


def text_of(
    content: Any, where: str, kinds: tuple[str, ...] = ("text",), name_fields: bool = False
) -> Any:
    """``content`` with a list of parts as one string; anything else as it is. ``where``: the
    field's path in the request (``messages.3.content``), for the error; ``kinds``: the part
    types that hold text (chat's ``text``; the Responses API's ``input_text`` and
    ``output_text`` too); ``name_fields``: the error names the part's field (``.type``,
    ``.text``), as the Responses API's errors do, rather than the part."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            accepted = ", ".join(repr(k) for k in kinds[:-1])
            accepted = f"{accepted} or {kinds[-1]!r}" if accepted else repr(kinds[-1])
            raise BadRequest(
                f"{at}.type" if name_fields else at,
                f"content parts of type {kind!r} are not supported: this server's models read "
                f"text, so only parts of type {accepted} are",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise BadRequest(
                f"{at}.text" if name_fields else at,
                f"a text part needs a string 'text', got {text!r}",
            )
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
