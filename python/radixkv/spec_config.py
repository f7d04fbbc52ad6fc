"""`SpecConfig`: the checked configuration of speculative decoding, vLLM's ``speculative_config``
keys (``method``, ``num_speculative_tokens``, ``prompt_lookup_min``, ``prompt_lookup_max``).

Torch-free, so that ``radixkv serve --speculative-config`` checks its JSON before anything heavy
is imported; the drafters that use it are in :mod:`radixkv.engine.speculative`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

#: The drafters, by vLLM's ``method`` names.
METHODS = ("ngram", "suffix")
#: The keys of a speculative config (vLLM's ``speculative_config``), with their defaults.
DEFAULTS: dict[str, object] = {
    "method": None,
    "num_speculative_tokens": None,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 4,
}
#: The most draft tokens a step may carry per request.
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpecConfig:
    """A checked speculative config: the drafter ``method``, ``num_speculative_tokens`` (K, the
    most drafts a step verifies per request) and the n-gram lengths prompt lookup tries."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    @classmethod
    def of(cls, value: object) -> SpecConfig | None:
        """``value`` (None, a :class:`SpecConfig`, a mapping with vLLM's keys, or that mapping
        as a JSON string) checked; ``ValueError`` naming the bad key or value."""
        if value is None or isinstance(value, SpecConfig):
            return value
        if isinstance(value, (str, bytes)):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(
                "speculative must be None or a dict of vLLM's speculative_config keys "
                f"{sorted(DEFAULTS)}, got {value!r} ({type(value).__name__})"
            )
        unknown = sorted(str(k) for k in value if k not in DEFAULTS)
        if unknown:
            raise ValueError(
                f"speculative config has unknown keys {unknown}; it takes {sorted(DEFAULTS)}"
            )
        got = {**DEFAULTS, **value}
        method = got["method"]
        if method not in METHODS:
            raise ValueError(
                f"speculative method must be one of {list(METHODS)} (drafts without a draft "
                f"model), got {method!r}"
            )
        k = _int(got["num_speculative_tokens"], "num_speculative_tokens", 1)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got {k}"
            )
        lo = _int(got["prompt_lookup_min"], "prompt_lookup_min", 1)
        hi = _int(got["prompt_lookup_max"], "prompt_lookup_max", 1)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be at most prompt_lookup_max ({hi})")
        return cls(str(method), k, lo, hi)

    def as_dict(self) -> dict[str, object]:
        """vLLM's keys and this config's values."""
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
        }


def _int(value: object, name: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)
