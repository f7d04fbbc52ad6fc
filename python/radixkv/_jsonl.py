"""Reading JSON lines for the command line's readers (traces, chat logs): one value a line, and
bad values shown in error messages on one printable line."""

from __future__ import annotations

import json
from typing import Any


def show(value: Any, width: int = 60) -> str:
    """``value`` as it reads in JSON (``null``, ``true``, ``"x"``, ``[1, 2]``), clipped to
    ``width`` characters, on one printable line, for error messages."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):  # a huge int, an odd object, deep nesting
        text = type(value).__name__
    if len(text) > width:
        text = text[: width - 3] + "..."
    # One line, whatever the value holds: "\x85", "\u2028" and lone surrogates escaped.
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def load(raw: str, where: str, error: type[ValueError], reader: str) -> Any:
    """The JSON value on a line; ``error`` naming ``where`` when it is not JSON, nests too
    deeply for the parser, or holds an integer of more digits than Python converts (``reader``
    names who cannot take it)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise error(f"{where}: JSON {reader} cannot take ({e})") from None
