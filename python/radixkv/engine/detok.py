"""Incremental detokenization: the text of a request's output, one token at a time, and its
stop strings.

The method is the one vLLM and TGI use (``prefix_offset`` / ``read_offset``): every new token,
decode a short window of the last tokens twice, without the new ones (``[prefix_offset,
read_offset)``) and with them (``[prefix_offset, end)``), and emit only the suffix the new
tokens added. A window whose text ends in U+FFFD may end inside a multi-byte UTF-8 character
(a byte-level token holding its first bytes): nothing is emitted and the offsets stay, so the
next token decodes those bytes again together with the rest of the character. Decoding a window
rather than the token alone keeps what depends on the neighbours (a SentencePiece word's leading
space, merges across tokens) exactly as a decode of the whole output has it; decoding a window
rather than everything keeps the cost per token constant.

```text
  tokens:  [ context | out_0 ... | ....... | ....... | new ]
                                 prefix_offset  read_offset
  decode(tokens[prefix_offset:read_offset]) = prefix
  decode(tokens[prefix_offset:])            = prefix + delta
```

Stop strings: the text is searched for them as it grows; at the first one the text is cut
before it (:attr:`Detokenizer.stopped`). Text that could still become a stop string (a suffix
that is a proper prefix of one) is held back from :meth:`Detokenizer.add`'s deltas until it
cannot; the final :meth:`Detokenizer.finish` gives whatever is left.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: Prompt tokens a request's detokenizer starts from (as vLLM's
#: ``INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET``): they decode the output's first tokens in
#: context (a SentencePiece tokenizer drops the leading space of a text's first word) and are
#: never part of the text.
CONTEXT_TOKENS = 5

_REPLACEMENT = "\ufffd"


class Detokenizer:
    """The text of one token stream. ``tokenizer``: anything with transformers'
    ``decode(ids, skip_special_tokens=...)`` (special tokens are skipped). ``context``: tokens
    before the stream (the end of the prompt) that the text does not include.

    :attr:`text` is the text so far: every token's text that is final (not the bytes of an
    unfinished UTF-8 character), cut before the first stop string. :meth:`add` returns the part
    of it that became safe to show; the deltas and :meth:`finish` together give :attr:`text`.
    """

    __slots__ = (
        "_max_stop",
        "_prefix_text",
        "finished",
        "prefix_offset",
        "read_offset",
        "sent",
        "stop_strings",
        "stopped",
        "text",
        "tokenizer",
        "tokens",
    )

    def __init__(
        self, tokenizer: Any, stop_strings: Iterable[str] = (), context: Iterable[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = [int(t) for t in context]
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self._prefix_text: str | None = None  # decode of [prefix_offset, read_offset)
        self.stop_strings = tuple(stop_strings)
        self._max_stop = max((len(s) for s in self.stop_strings), default=0)
        #: The text so far (see the class docstring).
        self.text = ""
        #: Characters of :attr:`text` handed out by :meth:`add` and :meth:`finish`.
        self.sent = 0
        #: Whether the text met a stop string (it is cut before it; later tokens are ignored).
        self.stopped = False
        #: Whether :meth:`finish` was called.
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Appends one token; returns the text that became safe to show with it ('' while the
        window ends inside a character, or while the text's end could still become a stop
        string). Once :attr:`stopped`, tokens are ignored."""
        if self.stopped or self.finished:
            return ""
        self.tokens.append(int(token))
        if self._prefix_text is None:
            self._prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        prefix = self._prefix_text
        new = self._decode(self.tokens[self.prefix_offset :])
        if len(new) > len(prefix) and not new.endswith(_REPLACEMENT):
            self._append(new[len(prefix) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self._prefix_text = None
        return self._release()

    def finish(self) -> str:
        """Ends the stream; returns the rest of the text not handed out yet: what was held back
        as a possible stop string, and the window's text (but the U+FFFD of bytes that never
        became a character). Idempotent: ``''`` after the first call."""
        if self.finished:
            return ""
        if not self.stopped and self.read_offset < len(self.tokens):
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            new = self._decode(self.tokens[self.prefix_offset :])
            if len(new) > len(prefix):
                self._append(new[len(prefix) :].rstrip(_REPLACEMENT))
        self.finished = True
        return self._release()

    def _append(self, delta: str) -> None:
        """Adds final text and looks for a stop string where one could have appeared."""
        if not delta:
            return
        start = max(len(self.text) - self._max_stop + 1, 0)
        self.text += delta
        if not self.stop_strings:
            return
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _held(self) -> int:
        """Characters at the end of :attr:`text` that could still become a stop string: the
        longest suffix that is a proper prefix of one."""
        text, held = self.text, 0
        room = len(text) - self.sent
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, room), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    def _release(self) -> str:
        end = len(self.text)
        if not (self.stopped or self.finished):
            end -= self._held()
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta
