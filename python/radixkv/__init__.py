"""radixkv: a prefix cache for LLM key/value tensors that any PyTorch inference loop can drop in.

The index (which pages hold the KV of which prefix, refcounts, LRU eviction) lives in a Rust
core; this package owns the tensors. Two indexes behind one interface:

- :class:`RadixCache`: a radix tree over token ids (token-exact reuse at ``page_size=1``).
- :class:`BlockCache`: chained block hashes over full pages (``page_size=16`` by default).
"""

from radixkv._radixkv import (
    BlockCache,
    CacheStats,
    CorruptionError,
    Error,
    InvalidRequest,
    OutOfPages,
    RadixCache,
    Request,
    Scheduler,
    block_hashes,
    plan_step,
)

__version__ = "0.1.0"

__all__ = [
    "BlockCache",
    "CacheStats",
    "CorruptionError",
    "Error",
    "InvalidRequest",
    "OutOfPages",
    "RadixCache",
    "Request",
    "Scheduler",
    "block_hashes",
    "plan_step",
]
