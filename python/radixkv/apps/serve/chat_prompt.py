"""A chat request's prompt: its ``messages`` (and ``tools``) through the chat template, the one
rendering path of ``/v1/chat/completions`` and ``/tokenize``, so that ``/tokenize`` counts what
chat serves.

An agent sends its history back: assistant messages that carry ``tool_calls`` (often with
``content: null``) and ``tool`` messages with their ``tool_call_id``. They reach the template as
transformers' ``apply_chat_template`` documents them, each call's ``arguments`` an object (the
JSON string OpenAI's clients send, parsed), since templates that render calls (Qwen 2.5/3,
Hermes 2 Pro, Llama 3.1) print ``arguments | tojson``. A template that ignores ``tool_calls``
(SmolLM2's: :func:`template_renders_calls`) would drop them; for it alone the server renders
each call as the JSON ``{"name": ..., "arguments": ...}`` in the message's content (after its
text), the arguments as sent, byte for byte what a constrained call generated, and says so in
the reply's ``warnings`` (:data:`CALLS_NOT_RENDERED`).
"""

from __future__ import annotations

import json
from typing import Any

from radixkv.apps.serve import content_parts
from radixkv.apps.serve.structured import BadRequest
from radixkv.engine.chat import render as render_chat

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

#: The warning of a request whose history holds tool calls, on a chat template that ignores
#: them.
CALLS_NOT_RENDERED = (
    "messages: this model's chat template does not render tool_calls, so the server rendered "
    'each call as {"name": ..., "arguments": ...} JSON in its assistant message\'s content'
)

#: The name of the call :func:`template_renders_calls` looks for in a rendering.
PROBE_CALL = "radixkv_probe_call"


def template_renders_calls(tokenizer: Any, chat_template: str | None = None) -> bool:
    """Whether ``tokenizer``'s chat template (or ``chat_template``) renders an assistant
    message's ``tool_calls``: a conversation whose assistant message (``content`` None, as
    clients send it) calls a probe function shows the function's name. False when the template
    refuses that message."""
    call = {"name": PROBE_CALL, "arguments": {"radixkv_probe_argument": 1}}
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_probe", "type": "function", "function": call}],
        },
        {"role": "user", "content": "Thanks"},
    ]
    kwargs: dict[str, Any] = dict(tokenize=False, add_generation_prompt=True)
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        text = tokenizer.apply_chat_template(messages, **kwargs)
    except Exception:  # a template that refuses the message renders no call
        return False
    return PROBE_CALL in text


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
    shown, warnings = history(flat, renders_calls)
    try:
        ids = render_chat(
            tokenizer,
            shown,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=kwargs,
        )
    except Exception as e:  # a malformed message list, a template that refuses it
        param = "chat_template_kwargs" if kwargs else "messages"
        raise BadRequest(param, f"the chat template cannot render the messages: {e}") from None
    return ids, warnings


def history(
    messages: list[dict[str, Any]], renders_calls: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """``(messages as the template gets them, warnings)``. Each assistant message's
    ``tool_calls`` (checked: a list of ``{"function": {"name", "arguments"}}``, the arguments a
    JSON object or its text) reach a template that ``renders_calls`` with their arguments as
    objects; for one that does not, they become the message's content as JSON (after its text)
    and the warnings say so. An empty or null ``tool_calls`` is dropped."""
    out, rewritten = [], False
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "tool_calls" not in m:
            out.append(m)
            continue
        calls = m["tool_calls"]
        m = {k: v for k, v in m.items() if k != "tool_calls"}
        if calls:
            checked = _calls(calls, f"messages.{i}.tool_calls")
            if renders_calls:
                m["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": args}} for c, args in checked
                ]
            else:
                texts = [_call_text(c["function"]) for c, _ in checked]
                content = m.get("content")
                if content is not None and not isinstance(content, str):
                    raise BadRequest(
                        f"messages.{i}.content", f"must be text or null, got {content!r}"
                    )
                m["content"] = "\n".join([content, *texts] if content else texts)
                rewritten = True
        out.append(m)
    return out, [CALLS_NOT_RENDERED] if rewritten else []


def _calls(calls: Any, where: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each call of an assistant message's ``tool_calls`` (at ``where``) with its arguments as
    an object; :class:`BadRequest` naming the first malformed one."""
    if not isinstance(calls, list):
        raise BadRequest(where, f"must be a list of tool calls, got {calls!r}")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(
                f"{where}.{j}",
                'must be {"type": "function", "function": {"name": ..., "arguments": ...}}, '
                f"got {c!r}",
            )
        given = fn.get("arguments", "{}")
        args = given
        if isinstance(given, str):
            try:
                args = json.loads(given)
            except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
                args = None
        if not isinstance(args, dict):
            raise BadRequest(
                f"{where}.{j}.function.arguments",
                f"must be a JSON object (as a string, as OpenAI sends it), got {given!r}",
            )
        out.append((c, args))
    return out


def _call_text(fn: dict[str, Any]) -> str:
    """A call's ``function`` as the JSON a constrained call generates, its arguments as
    sent."""
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return f'{{"name": {json.dumps(fn["name"], ensure_ascii=False)}, "arguments": {args}}}'


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
