"""OpenAI request fields ``radixkv serve`` does not implement and will not ignore: a field that
changes the output, silently dropped, would hand a client a reply it did not ask for. Each is
a 400 naming the field, unless it holds its no-op value (``echo`` false, ``best_of`` 1, ...),
which clients often send.

``logit_bias`` is implemented (the engine's, see :mod:`radixkv.engine.sampling`), and
``parallel_tool_calls`` is (``false``: a ``tool_choice="auto"`` reply's first call
alone; ``"required"`` and a named tool return one call either way). Fields that change nothing
here are accepted: ``user``, ``store``, ``metadata``, ``service_tier``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: field -> (whether its value is a no-op, why it is refused); for both endpoints.
COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: v in (None, 1), "best_of is not supported (use n)"),
    "prediction": (lambda v: v is None, "predicted outputs are not supported"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only the text modality is supported"),
    "functions": (lambda v: not v, "the legacy functions field is not supported: use tools"),
    "function_call": (
        lambda v: v in (None, "none", "auto"),
        "the legacy function_call field is not supported: use tool_choice",
    ),
    "guided_json": (lambda v: v is None, "use response_format (json_schema)"),
    "guided_regex": (lambda v: v is None, "guided_regex is not supported"),
    "guided_grammar": (lambda v: v is None, "guided_grammar is not supported"),
    "guided_choice": (lambda v: v is None, "guided_choice is not supported"),
}
#: Chat only.
CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (lambda v: not v, "echo is not supported on /v1/chat/completions"),
}
#: /v1/completions only.
COMPLETIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (lambda v: not v, "echo is not supported"),
    "suffix": (lambda v: not v, "suffix (insertion) is not supported"),
}


def refused(fields: dict[str, Any], chat: bool) -> tuple[str, str] | None:
    """``(field, message)`` of the first field of ``fields`` (a request body's) that is refused,
    or None."""
    table = {**COMMON, **(CHAT if chat else COMPLETIONS)}
    for name, (no_op, why) in table.items():
        if name in fields and not no_op(fields[name]):
            return name, f"{name}: {why}; got {fields[name]!r}"
    return None
