"""The UTF-8 bytes of one token, as OpenAI's logprob ``bytes`` field means them: the token's
own bytes, so that joining the ``bytes`` of a reply's tokens gives the bytes of its text, a
character split across tokens included (decoding such a token alone gives U+FFFD, whose bytes
are not the token's).

Three kinds of vocabulary hold a token's bytes differently:

- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): a piece is a string over a 256-character
  alphabet standing for the bytes (GPT-2's ``bytes_to_unicode`` table: printable Latin-1
  characters stand for themselves, the other bytes for code points from 256 on);
- SentencePiece with byte fallback (Llama 2, Mistral): a byte is a piece ``<0xE2>``, a space is
  ``▁``;
- anything else: the token's decoded text.

Added (special) tokens are their text in every kind.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's table read backwards: the character standing for each byte -> the byte."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)}
    kept |= set(range(ord("®"), ord("ÿ") + 1))
    chars = {chr(b): b for b in kept}
    moved = [b for b in range(256) if b not in kept]  # in byte order, from code point 256
    chars.update({chr(256 + i): b for i, b in enumerate(moved)})
    return chars


def _decoder_kind(tokenizer: Any) -> str:
    """``"byte_level"``, ``"sentencepiece"`` or ``"text"`` for ``tokenizer``'s vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "text"
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return "text"
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds:
        return "sentencepiece"
    return "text"


class TokenBytes:
    """``TokenBytes(tokenizer)(token_id) -> bytes``: the token's own UTF-8 bytes (see the
    module docstring); the vocabulary's kind is read once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {int(i): str(t) for i, t in added.items()}

    def __call__(self, token: int) -> bytes:
        if token in self._added:
            return self._added[token].encode()
        if self.kind == "text":
            return self.tokenizer.decode([token]).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if self.kind == "sentencepiece":
            m = _BYTE_PIECE.fullmatch(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        alphabet = _byte_level_alphabet()
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        return self.tokenizer.decode([token]).encode()  # not a byte-level piece after all


_OF: dict[int, TokenBytes] = {}


def token_bytes(tokenizer: Any, token: int) -> bytes:
    """``TokenBytes(tokenizer)(token)``, with one :class:`TokenBytes` kept per tokenizer."""
    tb = _OF.get(id(tokenizer))
    if tb is None or tb.tokenizer is not tokenizer:
        tb = _OF[id(tokenizer)] = TokenBytes(tokenizer)
    return tb(token)
