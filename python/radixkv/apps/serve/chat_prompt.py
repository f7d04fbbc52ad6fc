"""A chat request's prompt: its ``messages`` (and ``tools``) through the chat template, the one
rendering path of ``/v1/chat/completions`` and ``/tokenize``, so that ``/tokenize`` counts what
chat serves.

The tool calls of an agent's history are converted as :mod:`radixkv.engine.chat` converts them
for :meth:`Engine.chat` and :meth:`Session.send` (their arguments as objects for a template that
renders calls, JSON in the content with :data:`CALLS_NOT_RENDERED` in the reply's ``warnings``
for one that ignores them), so the library and the server give the same conversation the same
prompt. What the server adds: content parts joined (:mod:`content_parts`), the keywords a request
may not set through ``chat_template_kwargs``, and malformed fields as a :class:`BadRequest`
naming them.
"""

from __future__ import annotations

from typing import Any

from radixkv.apps.serve import content_parts
from radixkv.apps.serve.structured import BadRequest
from radixkv.engine import chat
from radixkv.engine.chat import CALLS_NOT_RENDERED, PROBE_CALL, template_renders_calls

__all__ = [
    "CALLS_NOT_RENDERED",
    "PROBE_CALL",
    "TEMPLATE_ARGUMENTS",
    "history",
    "render",
    "render_body",
    "template_renders_calls",
]

#: Arguments of ``apply_chat_template`` the server sets itself (not through
#: ``chat_template_kwargs``).
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_tensors",
        "chat_template",
        "padding",
        "truncation",
        "max_length",
    }
)


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    renders_calls: bool,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[str]]:
    """``(prompt token ids, warnings)`` of a chat request: ``messages`` (content parts joined,
    tool calls as :func:`history` gives them for a template that does or does not render them,
    ``renders_calls``) and ``tools`` through ``tokenizer``'s chat template, with the template's
    own keywords ``template_kwargs`` (:func:`radixkv.engine.chat.render`, the library's chat).
    :class:`BadRequest` naming the field for a malformed message, a keyword the server sets
    itself, or messages the template refuses."""
    kwargs = dict(template_kwargs or {})
    clash = sorted(set(kwargs) & TEMPLATE_ARGUMENTS)
    if clash:
        raise BadRequest(
            "chat_template_kwargs",
            f"{clash[0]!r} is set by the server (or by its own request field), not through "
            "chat_template_kwargs",
        )
    if continue_final_message and add_generation_prompt:
        raise BadRequest(
            "continue_final_message",
            "needs add_generation_prompt set to false (the last message is continued, not "
            "answered)",
        )
    flat = content_parts.flatten(messages)
    try:
        return chat.render_with_warnings(
            tokenizer,
            flat,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=kwargs,
            renders_calls=renders_calls,
        )
    except chat.MessageError as e:
        raise BadRequest(e.param, e.reason) from None
    except Exception as e:  # a malformed message list, a template that refuses it
        param = "chat_template_kwargs" if kwargs else "messages"
        raise BadRequest(param, f"the chat template cannot render the messages: {e}") from None


def history(
    messages: list[dict[str, Any]], renders_calls: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """``(messages as the template gets them, warnings)``:
    :func:`radixkv.engine.chat.tool_call_history`, a malformed call a :class:`BadRequest`
    naming its field."""
    try:
        return chat.tool_call_history(messages, renders_calls)
    except chat.MessageError as e:
        raise BadRequest(e.param, e.reason) from None


def render_body(tokenizer: Any, body: Any, renders_calls: bool) -> tuple[list[int], list[str]]:
    """:func:`render` of a request ``body`` that holds chat's fields (``messages``, ``tools``,
    ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``: chat
    completions' and ``/tokenize``'s), so that both render a request alike."""
    return render(
        tokenizer,
        body.messages or [],
        body.tools,
        renders_calls=renders_calls,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs,
    )
