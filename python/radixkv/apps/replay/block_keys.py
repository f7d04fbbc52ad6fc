"""Prefix block keys of a request sequence, for the offline simulations (:mod:`.belady`).

A request's full pages are numbered by their *prefix*: two pages get the same key exactly when
they hold the same ``page_size`` tokens after the same earlier tokens, in the same namespace,
which is when a prefix cache may share them. Keys are dense ints ``0 .. num_blocks - 1``.

Each page is hashed to 64 bits (splitmix64 of every token tagged with its place in the page,
then chained with a polynomial hash over the pages before it, all in numpy's wrapping uint64
arithmetic), then the hashes are numbered. Two different prefixes share a key only if their
64-bit hashes collide: about ``n**2 / 2**65`` for ``n`` distinct pages, below 1e-5 for ten
million. A collision would count a miss as a hit (the bound would come out a little high).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixkv.apps.common.trace import TraceRequest

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: Multiplier of the chain (odd, so invertible modulo 2**64).
_CHAIN = 0xD6E8FEB86659FD93
_CHAIN_INV = pow(_CHAIN, -1, 2**64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (numpy's uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _namespace_seed(namespace: str | None) -> int:
    """A 64-bit value per namespace; None differs from every string (the empty one too)."""
    if namespace is None:
        return 0x243F6A8885A308D3
    return int.from_bytes(hashlib.blake2b(namespace.encode(), digest_size=8).digest(), "little")


class _Powers:
    """``_CHAIN ** i`` and ``_CHAIN_INV ** i`` modulo 2**64, grown on demand."""

    def __init__(self) -> None:
        self.up = np.ones(1, dtype=np.uint64)
        self.down = np.ones(1, dtype=np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``n`` powers of each."""
        if len(self.up) < n:
            m = max(n, 2 * len(self.up))
            self.up = np.concatenate([np.ones(1, dtype=np.uint64), _pow_seq(_CHAIN, m - 1)])
            self.down = np.concatenate([np.ones(1, dtype=np.uint64), _pow_seq(_CHAIN_INV, m - 1)])
        return self.up[:n], self.down[:n]


def _pow_seq(base: int, n: int) -> np.ndarray:
    """``base ** 1 .. base ** n`` modulo 2**64."""
    with np.errstate(over="ignore"):
        return np.cumprod(np.full(n, base, dtype=np.uint64))


def page_hashes(
    tokens: np.ndarray, page_size: int, namespace: str | None, powers: _Powers | None = None
) -> np.ndarray:
    """The 64-bit prefix hash of each full page of ``tokens`` (uint64, ``len // page_size``)."""
    full = len(tokens) // page_size
    if full == 0:
        return np.zeros(0, dtype=np.uint64)
    powers = powers or _Powers()
    t = np.asarray(tokens[: full * page_size], dtype=np.uint64).reshape(full, page_size)
    place = np.arange(page_size, dtype=np.uint64) << np.uint64(32)
    with np.errstate(over="ignore"):
        rows = _mix64(_mix64(t ^ place).sum(axis=1, dtype=np.uint64))
        up, down = powers.get(full + 1)
        # h_i = C * h_{i-1} + row_i with h_{-1} = seed, i.e.
        # h_i = C**(i+1) * seed + sum_{j <= i} row_j * C**(i-j)
        #     = C**i * (C * seed + sum_{j <= i} row_j * C**-j)
        seed = np.uint64(_namespace_seed(namespace)) * np.uint64(_CHAIN)
        acc = np.cumsum(rows * down[:full], dtype=np.uint64) + seed
        chained = up[:full] * acc
        return _mix64(chained ^ _mix64(np.arange(full, dtype=np.uint64)))


@dataclass(frozen=True)
class BlockKeys:
    """The full pages of a request sequence as dense prefix keys.

    ``keys[starts[i]:starts[i + 1]]``: the keys of request ``i``'s full pages, root first;
    ``parent[k]``: the key of the page before ``k`` in its prefix (-1 for a first page);
    ``depth[k]``: its place in the prefix (0 for a first page)."""

    page_size: int
    keys: np.ndarray
    starts: np.ndarray
    parent: np.ndarray
    depth: np.ndarray

    @property
    def num_blocks(self) -> int:
        """Distinct prefixes (pages an unbounded cache would hold)."""
        return len(self.parent)

    def of(self, i: int) -> np.ndarray:
        """The keys of request ``i``'s full pages, root first."""
        return self.keys[self.starts[i] : self.starts[i + 1]]


def block_keys(requests: Sequence[TraceRequest], page_size: int) -> BlockKeys:
    """The prefix keys of every full page of ``requests`` (in the order given)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    powers = _Powers()
    hashes = [page_hashes(r.tokens, page_size, r.namespace, powers) for r in requests]
    counts = np.fromiter((len(h) for h in hashes), dtype=np.int64, count=len(hashes))
    starts = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    flat = np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)
    uniq, keys = np.unique(flat, return_inverse=True)
    keys = keys.astype(np.int64).reshape(-1)
    # Within a request, a page's parent is the page before it.
    prev = np.empty_like(keys)
    prev[1:] = keys[:-1]
    first = starts[:-1][counts > 0]
    prev[first] = -1
    pos = np.arange(len(keys), dtype=np.int64) - np.repeat(starts[:-1], counts)
    parent = np.full(len(uniq), -1, dtype=np.int64)
    depth = np.zeros(len(uniq), dtype=np.int64)
    parent[keys] = prev
    depth[keys] = pos
    return BlockKeys(page_size, keys, starts, parent, depth)
