"""OpenAI-style chat messages to prompt token ids, through the tokenizer's own chat template
(``apply_chat_template``), as ``radixkv serve`` renders them: :meth:`Engine.chat` and
:meth:`Session.send` with messages use it, so a Python user writes no template loop of their
own and gets the server's prompt (and so its reply) for the same messages."""

from __future__ import annotations

from typing import Any


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt ids of ``messages``: the template's text (``tools``, the generation prompt,
    ``chat_template_kwargs`` passed to it), encoded without adding special tokens again (the
    template wrote them). ``ValueError`` for a tokenizer without ``apply_chat_template`` or
    messages that are not a list of ``{"role", "content"}`` objects."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise ValueError(
            "chat needs the model's tokenizer with its chat template: make the engine with "
            "radixkv.hf.engine(..., tokenizer=tokenizer) (a transformers tokenizer)"
        )
    check_messages(messages)
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **kwargs,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


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
