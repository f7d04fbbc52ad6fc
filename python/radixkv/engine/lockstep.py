"""Tensor-parallel ranks in lockstep: what an :class:`~radixkv.Engine` with ``group=`` sends.

Rank 0 takes every request call (``submit``, ``branch``, ``cancel``, ``release``, session
turns); at each ``step`` it broadcasts what arrived since the last one over the CPU (gloo) group:
a count, then a pickled payload only when the count is non-zero (a count ``-1 - n`` carries the
``n`` last calls of :meth:`Engine.close`, which ends the other ranks' :meth:`Engine.follow`).
Every rank replays those calls in order and then makes the same scheduling and cache decisions
(see ``docs/DETERMINISM.md``), so that the batch, the pages and the sampled tokens agree and
each rank computes its own shard of heads in its own ``KVCache``.

Checks, all collective, so that a mismatch raises ``radixkv.Error`` on every rank rather than
leaving one rank waiting in a collective the others never enter:

- every step, before the forward pass: the step number and the batch shape (requests, tokens),
  plus the cache's :meth:`~radixkv.RadixCache.state_digest` every ``digest_every`` steps, in one
  all-gather of four int64;
- with ``check_tokens``: after sampling, a digest of the sampled token ids.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

import radixkv


class DivergedError(radixkv.Error):
    """Tensor-parallel ranks disagree (batch, cache state or sampled tokens): raised on every
    rank at once, and again by every later call of the engine."""


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group= needs torch.distributed initialized (torch.distributed.init_process_group)"
        )
    return dist


class Lockstep:
    """The collectives of one engine's group: the broadcast of rank 0's calls and the checks.

    ``group``: the process group of the ranks (``torch.distributed.group.WORLD`` for all). The
    broadcasts and checks run on it when its backend is gloo, else on a gloo group over the same
    ranks made here (``new_group``, which every process of the default group must call: build
    the engines of all ranks together)."""

    def __init__(self, group: Any, digest_every: int, check_tokens: bool) -> None:
        dist = _dist()
        self.group = group
        try:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            backend = str(dist.get_backend(group))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"group must be a torch.distributed process group: {e}") from None
        if self.rank < 0:
            raise ValueError("this process is not a member of group")
        if backend == "gloo":
            self.cpu_group = group
        else:
            ranks = dist.get_process_group_ranks(group)
            self.cpu_group = dist.new_group(ranks=ranks, backend="gloo")
        self.src = dist.get_global_rank(self.cpu_group, 0)
        self.digest_every = digest_every
        self.check_tokens = check_tokens
        self.steps = 0
        #: Seconds spent in the broadcast of calls and in the checks, and how many broadcasts
        #: carried calls (the rest sent a count of zero alone).
        self.send_s = 0.0
        self.check_s = 0.0
        self.payloads = 0

    # ---- rank 0's calls ----------------------------------------------------------------------

    def send(self, calls: list[tuple], close: bool = False) -> None:
        """Rank 0: broadcasts ``calls``, the last ones when ``close``."""
        dist = _dist()
        count = -1 - len(calls) if close else len(calls)
        dist.broadcast(torch.tensor([count], dtype=torch.int64), self.src, group=self.cpu_group)
        if calls:
            dist.broadcast_object_list([calls], self.src, group=self.cpu_group)
            self.payloads += 1

    def receive(self) -> tuple[list[tuple], bool]:
        """Other ranks: the calls rank 0 broadcast for the next step, and whether they are its
        last (it closed)."""
        dist = _dist()
        count = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(count, self.src, group=self.cpu_group)
        n = int(count[0])
        close = n < 0
        n = -1 - n if close else n
        if n == 0:
            return [], close
        box: list[Any] = [None]
        dist.broadcast_object_list(box, self.src, group=self.cpu_group)
        self.payloads += 1
        calls = box[0]
        if not isinstance(calls, list) or len(calls) != n:
            raise radixkv.Error(
                f"rank {self.rank}: rank 0 announced {n} calls and sent {type(calls).__name__}"
            )
        return calls, close

    # ---- checks ------------------------------------------------------------------------------

    def _gather(self, row: list[int]) -> np.ndarray:
        dist = _dist()
        mine = torch.tensor(row, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.cpu_group)
        return torch.stack(rows).numpy()

    def check_step(self, cache: Any, num_requests: int, num_tokens: int) -> None:
        """Before a forward pass: every rank's step number and batch shape, and every
        ``digest_every`` steps its cache's state digest, must agree; else ``radixkv.Error``
        (on every rank: each sees the whole table)."""
        self.steps += 1
        digest = 0
        if self.digest_every and self.steps % self.digest_every == 0:
            digest = _signed(cache.state_digest())
        table = self._gather([self.steps, num_requests, num_tokens, digest])
        if (table == table[0]).all():
            return
        what = ["step", "requests in the batch", "tokens in the batch", "cache state digest"]
        bad = [what[j] for j in range(4) if not (table[:, j] == table[0, j]).all()]
        per_rank = "; ".join(
            f"rank {r}: step {t[0]}, {t[1]} requests, {t[2]} tokens, digest {_unsigned(t[3]):#x}"
            for r, t in enumerate(table)
        )
        raise DivergedError(
            f"tensor-parallel ranks diverged at step {self.steps}: their {', '.join(bad)} "
            f"differ ({per_rank}); every rank must see the same calls, pool size, page size, "
            "policy and seeds (docs/DETERMINISM.md)"
        )

    def check_sampled(self, sampled: list[tuple[int, int]]) -> None:
        """After sampling (``check_tokens``): the ``(request id, token)`` pairs sampled this
        step must agree on every rank; else ``radixkv.Error``."""
        arr = np.asarray(sampled, dtype=np.int64).reshape(-1)
        digest = int.from_bytes(hashlib.blake2b(arr.tobytes(), digest_size=8).digest(), "little")
        table = self._gather([self.steps, _signed(digest)])
        if (table == table[0]).all():
            return
        raise DivergedError(
            f"tensor-parallel ranks sampled different tokens at step {self.steps} (digests "
            + ", ".join(f"rank {r}: {_unsigned(t[1]):#x}" for r, t in enumerate(table))
            + "); their logits differ: check that every rank loaded the same weights"
        )


def agree_num_pages(num_pages: int, group: Any = None) -> int:
    """The smallest ``num_pages`` over the ranks of ``group`` (collective: every rank calls it),
    for sizing every rank's pool alike when their free memory differs."""
    dist = _dist()
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
    device = "cpu"
    if str(dist.get_backend(group)) == "nccl":  # NCCL reduces CUDA tensors only
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([num_pages], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0])


def check_same_config(lock: Lockstep, config: dict[str, Any]) -> None:
    """Engine construction (collective): every rank's ``config`` must be equal; else
    ``ValueError`` on every rank naming the first setting that differs."""
    dist = _dist()
    items = sorted(config.items())
    got: list[Any] = [None] * lock.world_size
    dist.all_gather_object(got, items, group=lock.cpu_group)
    for r, other in enumerate(got):
        if other != items:
            mine, theirs = dict(items), dict(other)
            name = next(k for k in mine if mine[k] != theirs.get(k))
            raise ValueError(
                f"{name} must be the same on every rank of the group: rank {r} has "
                f"{theirs.get(name)!r}, rank {lock.rank} has {mine[name]!r}"
            )


def _signed(x: int) -> int:
    """A 64-bit unsigned int as int64."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _unsigned(x: Any) -> int:
    return int(x) & ((1 << 64) - 1)
