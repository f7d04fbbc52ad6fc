"""OpenAI-style chat messages to prompt token ids, through the tokenizer's own chat template
(``apply_chat_template``): the one rendering path of :meth:`Engine.chat`,
:meth:`Session.send` with messages and ``radixkv serve`` (its chat completions and
``/tokenize``), so a Python user writes no template loop of their own and gets the server's
prompt (and so its reply) for the same messages.

An agent's history holds assistant messages that carry ``tool_calls`` (often with ``content:
null``), each call's ``arguments`` the JSON string OpenAI's clients send. They reach the template
as transformers' ``apply_chat_template`` documents them, the arguments an object, since templates
that render calls (Qwen 2.5/3, Hermes 2 Pro, Llama 3.1) print ``arguments | tojson``: a string
there would be printed as a quoted string, a prompt no model was trained on. A template that
ignores ``tool_calls`` (SmolLM2's: :func:`template_renders_calls`) would drop them; for it alone
each call is written as the JSON ``{"name": ..., "arguments": ...}`` into the message's content
(after its text), the arguments as sent, byte for byte what a constrained call generated, and a
warning says so (:data:`CALLS_NOT_RENDERED`).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

#: The warning of a conversation whose history holds tool calls, on a chat template that ignores
#: them.
CALLS_NOT_RENDERED = (
    "messages: this model's chat template does not render tool_calls, so each call was rendered "
    'as {"name": ..., "arguments": ...} JSON in its assistant message\'s content'
)

#: The name of the call :func:`template_renders_calls` looks for in a rendering.
PROBE_CALL = "radixkv_probe_call"


class MessageError(ValueError):
    """A malformed message: ``param`` is its field's path (``messages.1.tool_calls.0``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.reason = message


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    renders_calls: bool | None = None,
) -> list[int]:
    """The prompt ids of ``messages``, as :func:`render_with_warnings` gives them; its warnings
    (a history of tool calls on a template that ignores them) are issued with
    :func:`warnings.warn`."""
    ids, notes = render_with_warnings(
        tokenizer,
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        renders_calls=renders_calls,
    )
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=3)  # at the caller of Engine.chat / send
    return ids


def render_with_warnings(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    renders_calls: bool | None = None,
) -> tuple[list[int], list[str]]:
    """``(prompt ids, warnings)`` of ``messages``: their tool calls as :func:`tool_call_history`
    gives them for a template that does or does not render them (``renders_calls``; None: ask
    the template, :func:`template_renders_calls`, when a message has calls), through the
    template's text (``tools``, the generation prompt, ``chat_template_kwargs`` passed to it),
    encoded without adding special tokens again (the template wrote them). ``ValueError`` for a
    tokenizer without ``apply_chat_template`` or messages that are not a list of ``{"role",
    "content"}`` objects; :class:`MessageError` (a ``ValueError``) naming the field of a
    malformed tool call."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise ValueError(
            "chat needs the model's tokenizer with its chat template: make the engine with "
            "radixkv.hf.engine(..., tokenizer=tokenizer) (a transformers tokenizer)"
        )
    check_messages(messages)
    if renders_calls is None:
        renders_calls = not has_calls(messages) or template_renders_calls(tokenizer, chat_template)
    shown, notes = tool_call_history(messages, renders_calls)
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    text = tokenizer.apply_chat_template(
        shown,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **kwargs,
    )
    return list(tokenizer.encode(text, add_special_tokens=False)), notes


def is_messages(value: Any) -> bool:
    """Whether ``value`` is chat messages (a non-empty list of dicts) rather than token ids."""
    return isinstance(value, (list, tuple)) and bool(value) and isinstance(value[0], dict)


def check_messages(messages: Any) -> None:
    """``ValueError`` unless ``messages`` is a non-empty list of objects with a string
    ``role``."""
    if not is_messages(messages) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise ValueError(
            'messages must be a non-empty list of {"role": ..., "content": ...} objects, got '
            f"{messages!r:.80}"
        )


def has_calls(messages: list[dict[str, Any]]) -> bool:
    """Whether any of ``messages`` carries a non-empty ``tool_calls``."""
    return any(isinstance(m, dict) and m.get("tool_calls") for m in messages)


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


def tool_call_history(
    messages: list[dict[str, Any]], renders_calls: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    """``(messages as the template gets them, warnings)``. Each assistant message's
    ``tool_calls`` (checked: a list of ``{"function": {"name", "arguments"}}``, the arguments a
    JSON object or its text) reach a template that ``renders_calls`` with their arguments as
    objects; for one that does not, they become the message's content as JSON (after its text)
    and the warnings say so. An empty or null ``tool_calls`` is dropped. ``messages`` is not
    changed; :class:`MessageError` names the first malformed call."""
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
                    raise MessageError(
                        f"messages.{i}.content", f"must be text or null, got {content!r}"
                    )
                m["content"] = "\n".join([content, *texts] if content else texts)
                rewritten = True
        out.append(m)
    return out, [CALLS_NOT_RENDERED] if rewritten else []


def _calls(calls: Any, where: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each call of an assistant message's ``tool_calls`` (at ``where``) with its arguments as
    an object; :class:`MessageError` naming the first malformed one."""
    if not isinstance(calls, list):
        raise MessageError(where, f"must be a list of tool calls, got {calls!r}")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MessageError(
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
            raise MessageError(
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
