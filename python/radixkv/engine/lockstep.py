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
  plus the cache's :meth:`~radixkv.RadixCache.state_digest` every ``digest_every`` steps, and
  whether this rank's last forward pass raised, in one all-gather of five int64;
- in a step with speculative drafts, after sampling: how many tokens each drafting request kept
  on rank 0 (a stop string, which only rank 0 sees, may end one before its verified tokens
  do), which every rank keeps too, in one all-gather of ``2 + drafting requests`` int64;
- with ``check_tokens``: after sampling, a digest of the sampled token ids (and whether this
  step's forward pass raised), in one all-gather of three int64;
- at :meth:`Engine.close`, once: the step count (and a forward pass that raised at the last
  step), in one all-gather of two int64.

Failures. Every rank keeps track of the next collective of the lockstep the others will enter
(:attr:`Lockstep.phase`). A rank whose step raises (:meth:`Lockstep.abandon`) enters that
collective with a mark saying so, and its reason follows in one more all-gather (on this path
only), so that every rank raises the same :class:`DivergedError`, naming that rank and what it
raised, and the group stays usable (:attr:`Lockstep.in_sync`). A forward pass that raises once
all of its collectives ran (as many as a successful one runs on ``group``; counted with the
group's sequence number) fails its batch's requests, as without a group, and the next check
reports it: every rank raises unless the forward pass raised on every rank. A forward pass that
raises before its collectives are done leaves the other ranks inside the model's collectives,
where nothing but this process's exit (or the group's timeout) reaches them: that rank raises
:class:`DivergedError` at once, enters no more collectives, and the others raise
:class:`PeerLostError` once it exits. Any collective that fails (a peer died, or left, or did
not answer within the group's timeout) raises :class:`PeerLostError`, never the backend's
``RuntimeError``; it names the peer when there is one, else the ranks it may be (a collective
does not say which peer it waited for: ``radixkv serve`` tells by the ranks' processes).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

import radixkv

#: The count rank 0 broadcasts instead of its calls when its step raised; its reason follows.
_FAILED = -(1 << 63)
#: Status column of the checks: this rank's forward pass raised (reported by the check after
#: it), or this rank left the lockstep (its step raised).
_OK, _FORWARD_FAILED, _LEFT = 0, 1, 2
#: What the next collective of each phase is, for messages.
_PHASES = {
    "broadcast": "the broadcast of rank 0's calls",
    "payload": "the broadcast of rank 0's calls",
    "check_step": "the step check",
    "forward": "the forward pass",
    "check_kept": "the exchange of kept draft counts",
    "check_sampled": "the token check",
    "close_check": "the close check",
    "closed": "nothing (closed)",
}


class DivergedError(radixkv.Error):
    """Tensor-parallel ranks are out of lockstep: they disagree (batch, cache state, sampled
    tokens, a forward pass that raised on some ranks only), or a rank's step raised, or a peer
    was lost (:class:`PeerLostError`). Raised on every rank, and again by every later call of
    the engine."""


class PeerLostError(DivergedError):
    """A collective of the lockstep (or of the model's forward pass) failed on this rank:
    another rank died, or left the lockstep with the group's collectives out of step."""


class LeaderClosedError(radixkv.Error):
    """:meth:`Engine.follow` once rank 0 closed the engine (:meth:`Engine.close`)."""


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
        #: The next collective of the lockstep this rank enters (a key of ``_PHASES``).
        self.phase = "broadcast"
        #: Whether rank 0 closed (sent, or this rank received, its last calls).
        self.closed = False
        #: The error that ended the lockstep (every later collective raises it), and whether
        #: the group's collectives are still in step on this rank (False once a rank left in
        #: the middle of a forward pass, or a peer was lost: a collective on the group, a
        #: barrier say, would wait for the group's timeout).
        self.ended: DivergedError | None = None
        self.in_sync = True
        self._reason: str | None = None  # what this rank reports in the next check
        self._failure: BaseException | None = None  # and the exception it was
        self._forward_failed = False  # this rank's last forward pass raised, unreported
        self._seq0: int | None = None  # the group's sequence number as the forward began
        #: Collectives the last successful forward pass ran on ``group`` (None: none so far).
        self.model_collectives: int | None = None
        #: Drafting requests in this step's batch: the width of :meth:`check_kept`'s row.
        self.drafting = 0

    # ---- rank 0's calls ----------------------------------------------------------------------

    def send(self, calls: list[tuple], close: bool = False) -> None:
        """Rank 0: broadcasts ``calls``, the last ones when ``close`` (then call
        :meth:`check_close`)."""
        dist = _dist()
        self._live()
        count = -1 - len(calls) if close else len(calls)
        what = "the broadcast of rank 0's calls"
        self._collective(
            what,
            dist.broadcast,
            torch.tensor([count], dtype=torch.int64),
            self.src,
            group=self.cpu_group,
        )
        if calls:
            self.phase = "payload"
            self._collective(
                what, dist.broadcast_object_list, [calls], self.src, group=self.cpu_group
            )
            self.payloads += 1
        if close:
            self.closed = True
        self.phase = "close_check" if close else "check_step"

    def receive(self) -> tuple[list[tuple], bool]:
        """Other ranks: the calls rank 0 broadcast for the next step, and whether they are its
        last (it closed)."""
        dist = _dist()
        if self.closed:
            raise LeaderClosedError(
                f"rank {self.rank}: rank 0 closed this engine (Engine.close()): it sends no "
                "more steps to follow"
            )
        self._live()
        what = "the broadcast of rank 0's calls"
        count = torch.zeros(1, dtype=torch.int64)
        self._collective(what, dist.broadcast, count, self.src, group=self.cpu_group)
        n = int(count[0])
        if n == _FAILED:
            box: list[Any] = [None]
            self._collective(what, dist.broadcast_object_list, box, self.src, group=self.cpu_group)
            raise self._end(DivergedError(_left_message({0: str(box[0])}, self.steps)))
        close = n < 0
        n = -1 - n if close else n
        # What comes next (a payload's collective done, its unpickling may still raise).
        self.phase = "close_check" if close else "check_step"
        self.closed = close
        if n == 0:
            return [], close
        box = [None]
        self._collective(what, dist.broadcast_object_list, box, self.src, group=self.cpu_group)
        self.payloads += 1
        calls = box[0]
        if isinstance(calls, str):  # rank 0's step raised while it sent the calls
            raise self._end(DivergedError(_left_message({0: calls}, self.steps)))
        if not isinstance(calls, list) or len(calls) != n:
            raise radixkv.Error(
                f"rank {self.rank}: rank 0 announced {n} calls and sent {type(calls).__name__}"
            )
        return calls, close

    # ---- checks ------------------------------------------------------------------------------

    def _gather(self, row: list[int], what: str = "a check") -> np.ndarray:
        dist = _dist()
        mine = torch.tensor(row, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._collective(what, dist.all_gather, rows, mine, group=self.cpu_group)
        return torch.stack(rows).numpy()

    def _status(self) -> int:
        return _FORWARD_FAILED if self._forward_failed else _OK

    def check_step(
        self, cache: Any, num_requests: int, num_tokens: int, states: Any = None
    ) -> None:
        """Before a forward pass: every rank's step number and batch shape, and every
        ``digest_every`` steps its cache's state digest (with ``states``, a hybrid model's
        :class:`radixkv.engine.states.EngineStates`: mixed with its ``digest()``, the working
        slots and the snapshots restored and taken), must agree (and no rank's last forward
        pass may have raised unless every rank's did); else ``radixkv.Error`` (on every rank:
        each sees the whole table)."""
        self._live()
        self.steps += 1
        digest = 0
        if self.digest_every and self.steps % self.digest_every == 0:
            full = cache.state_digest()
            if states is not None:
                full ^= states.digest()
            digest = _signed(full)
        row = [self.steps, num_requests, num_tokens, digest, self._status()]
        table = self._gather(row, "the step check")
        if num_requests:
            self.phase = "forward"
        else:
            self.phase = "check_sampled" if self.check_tokens else "broadcast"
        self._verdict(table, 4, forward_lag=1)  # the forward pass reported is the last step's
        table = table[:, :4]
        if (table == table[0]).all():
            return
        what = ["step", "requests in the batch", "tokens in the batch", "cache state digest"]
        bad = [what[j] for j in range(4) if not (table[:, j] == table[0, j]).all()]
        per_rank = "; ".join(
            f"rank {r}: step {t[0]}, {t[1]} requests, {t[2]} tokens, digest {_unsigned(t[3]):#x}"
            for r, t in enumerate(table)
        )
        raise self._end(
            DivergedError(
                f"tensor-parallel ranks diverged at step {self.steps}: their {', '.join(bad)} "
                f"differ ({per_rank}); every rank must see the same calls, pool size, page size, "
                "policy and seeds (docs/DETERMINISM.md)"
            )
        )

    def check_sampled(self, sampled: list[tuple[int, int]]) -> None:
        """After sampling (``check_tokens``): the ``(request id, token)`` pairs sampled this
        step must agree on every rank (and the forward pass must have raised on every rank or
        on none); else ``radixkv.Error``."""
        self._live()
        arr = np.asarray(sampled, dtype=np.int64).reshape(-1)
        digest = int.from_bytes(hashlib.blake2b(arr.tobytes(), digest_size=8).digest(), "little")
        table = self._gather([self.steps, _signed(digest), self._status()], "the token check")
        self.phase = "broadcast"
        self._verdict(table, 2)
        if (table[:, :2] == table[0, :2]).all():
            return
        raise self._end(
            DivergedError(
                f"tensor-parallel ranks sampled different tokens at step {self.steps} (digests "
                + ", ".join(f"rank {r}: {_unsigned(t[1]):#x}" for r, t in enumerate(table))
                + "); their logits differ: check that every rank loaded the same weights"
            )
        )

    def check_kept(self, counts: list[int]) -> list[int]:
        """After a forward pass with drafts (every rank: the batch's drafting requests are the
        same, rank 0's drafts being replayed): ``counts`` is how many tokens each recorded on
        this rank; returns rank 0's, which every rank keeps (and the forward pass must have
        raised on every rank or on none); else ``radixkv.Error``."""
        self._live()
        if len(counts) != self.drafting:
            raise radixkv.Error(
                f"rank {self.rank}: {len(counts)} kept counts for {self.drafting} drafting requests"
            )
        table = self._gather([self.steps, self._status(), *counts], _PHASES["check_kept"])
        self.phase = "check_sampled" if self.check_tokens else "broadcast"
        self._verdict(table, 1)
        return [int(n) for n in table[0, 2:]]

    def check_close(self) -> None:
        """Once rank 0 closed (every rank, after the close's calls): every rank took as many
        steps, and no rank's last forward pass raised alone; else ``radixkv.Error``."""
        self._live()
        table = self._gather([self.steps, self._status()], "the close check")
        self.phase = "closed"
        self._verdict(table, 1)
        if (table[:, 0] == table[0, 0]).all():
            return
        raise self._end(
            DivergedError(
                "tensor-parallel ranks took different numbers of steps before rank 0 closed ("
                + ", ".join(f"rank {r}: {t[0]}" for r, t in enumerate(table))
                + ")"
            )
        )

    def _verdict(self, table: np.ndarray, col: int, forward_lag: int = 0) -> None:
        """The status column ``col`` of a check's ``table`` (its column 0 the step number; a
        forward pass reported is that of ``forward_lag`` steps before): every rank OK, or
        every rank's forward pass raised (their batches failed alike), passes; else every rank
        gathers the reasons (collective: every rank sees the same column) and raises the same
        :class:`DivergedError`."""
        status = table[:, col]
        if (status == _OK).all() or (status == _FORWARD_FAILED).all():
            self._forward_failed, self._reason, self._failure = False, None, None
            return
        reasons: list[Any] = [None] * self.world_size
        dist = _dist()
        self._collective(
            "the exchange of failures",
            dist.all_gather_object,
            reasons,
            self._reason,
            group=self.cpu_group,
        )
        failure = self._failure
        self._forward_failed, self._reason, self._failure = False, None, None
        left = {r: str(reasons[r]) for r in range(self.world_size) if status[r] == _LEFT}
        raised = {
            r: str(reasons[r]) for r in range(self.world_size) if status[r] == _FORWARD_FAILED
        }
        step = int(table[:, 0].max())  # a rank that left before the step check lags by one
        if left:
            msg = _left_message(left, step)
        else:
            others = [r for r in range(self.world_size) if status[r] == _OK]
            msg = (
                "tensor-parallel ranks diverged: the forward pass of step "
                f"{step - forward_lag} raised on "
                + "; ".join(f"rank {r} ({why})" for r, why in raised.items())
                + f" and not on {_ranks(others)}, so its batch's requests failed on some ranks "
                "only"
            )
        err = DivergedError(msg)
        err.__cause__ = failure
        raise self._end(err)

    # ---- the forward pass --------------------------------------------------------------------

    def _seq(self) -> int | None:
        """The sequence number of ``group``: collectives issued on it so far."""
        try:
            return int(self.group._get_sequence_number_for_group())
        except Exception:  # a backend without one: the forward pass's collectives are unknown
            return None

    def forward_begins(self) -> None:
        """The engine: the batch's plan and forward pass begin."""
        self._seq0 = self._seq()

    def forward_ends(self, drafting: int = 0) -> None:
        """The engine: the forward pass (and commit) succeeded; ``drafting``: the batch's
        requests with drafts (then :meth:`check_kept` comes next)."""
        seq = self._seq()
        if seq is not None and self._seq0 is not None:
            self.model_collectives = seq - self._seq0
        self._after_forward(drafting)

    def _after_forward(self, drafting: int) -> None:
        self.drafting = drafting
        if drafting:
            self.phase = "check_kept"
        else:
            self.phase = "check_sampled" if self.check_tokens else "broadcast"

    def forward_failed(self, error: Exception, drafting: int = 0) -> None:
        """The engine: the plan, forward pass or commit raised ``error`` (the batch's requests
        failed with it). If the forward pass ran as many collectives as a successful one does,
        the other ranks are past them: the next check reports it (:class:`DivergedError` on
        every rank there, unless every rank's forward pass raised; ``drafting``: as
        :meth:`forward_ends`). Else they wait inside the
        model's collectives: raises :class:`DivergedError` (a :class:`PeerLostError` if
        ``error`` is a failed collective) at once, and this rank enters no more collectives."""
        seq, n = self._seq(), self.model_collectives
        done = None if seq is None or self._seq0 is None else seq - self._seq0
        if n and done == n and not _is_comm_error(error):
            self._forward_failed = True
            self._reason, self._failure = f"{type(error).__name__}: {error}", error
            self._after_forward(drafting)
            return
        raise self._break(error) from error

    # ---- failures ----------------------------------------------------------------------------

    def abandon(self, error: BaseException) -> radixkv.Error:
        """``error`` left this rank's step (or ``follow``, or ``close``): ends the lockstep on
        every rank and returns the error this rank raises. In the middle of a forward pass
        (:attr:`phase` ``"forward"``) it enters no collective (see :meth:`forward_failed`);
        else it enters the collective the other ranks wait in (taking rank 0's broadcast first
        on the other ranks) with a mark that it left, and the reason: every rank raises the
        same :class:`DivergedError` there."""
        if isinstance(error, DivergedError):  # a check's verdict or a lost peer
            if self.ended is None:
                self.ended = error
            return error
        if isinstance(error, LeaderClosedError):  # no collective entered
            return error
        if self.ended is not None:
            return self.ended
        self._reason, self._failure = f"{type(error).__name__}: {error}", error
        try:
            if self.phase == "forward":
                raise self._break(error)
            if self.phase == "closed":  # the lockstep is over: nobody to tell
                raise self._end(DivergedError(_left_message({self.rank: self._reason}, self.steps)))
            dist = _dist()
            what = "the broadcast of rank 0's calls"
            if self.phase in ("broadcast", "payload") and self.rank == 0:
                if self.phase == "broadcast":
                    failed = torch.tensor([_FAILED], dtype=torch.int64)
                    self._collective(what, dist.broadcast, failed, self.src, group=self.cpu_group)
                box = [self._reason]
                self._collective(
                    what, dist.broadcast_object_list, box, self.src, group=self.cpu_group
                )
                raise self._end(DivergedError(_left_message({0: self._reason}, self.steps)))
            if self.phase == "broadcast":  # the others go on to rank 0's next broadcast
                self.receive()  # its calls are not replayed: this rank reports it left
            status = {"check_step": 4, "check_kept": 1, "check_sampled": 2, "close_check": 1}[
                self.phase
            ]
            row = [self.steps] + [0] * status
            if self.phase == "check_kept":
                row += [0] * self.drafting
            row[status] = _LEFT
            phase = self.phase
            table = self._gather(row, _PHASES[phase])
            self.phase = "closed" if phase == "close_check" else "broadcast"
            self._verdict(table, status)
            raise AssertionError("unreachable: the check saw this rank leave")  # pragma: no cover
        except DivergedError as e:
            if self.ended is None:
                self.ended = e
            return e

    def _break(self, error: BaseException) -> DivergedError:
        """This rank leaves in the middle of a forward pass: no more collectives."""
        self.in_sync = False
        if _is_comm_error(error):
            return self._lost(_PHASES["forward"], error)
        return self._end(
            DivergedError(
                f"tensor-parallel rank {self.rank} left the lockstep in the forward pass of step "
                f"{self.steps}: it raised {type(error).__name__}: {error}; the other ranks wait "
                "in the model's collectives until this process exits (or the group times out), "
                "then raise too"
            )
        )

    def _lost(self, what: str, error: BaseException) -> PeerLostError:
        self.in_sync = False
        others = [r for r in range(self.world_size) if r != self.rank]
        peer = f"rank {others[0]}" if len(others) == 1 else f"one of {_ranks(others)}"
        text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        if "Timed out" in text or "timed out" in text:
            how = "it did not answer within the group's timeout: it is stopped, hangs, or died"
        else:
            how = "it died, or left the lockstep while this rank waited for it"
        return self._end(
            PeerLostError(
                f"rank {self.rank}: lost {peer} in {what} at step {self.steps} ({how}): "
                f"{type(error).__name__}: {text}"
            )
        )

    def _end(self, error: DivergedError) -> Any:
        if self.ended is None:
            self.ended = error
        return error

    def _live(self) -> None:
        if self.ended is not None:
            raise self.ended

    def _collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a collective: a backend error (a peer died or left) raises
        :class:`PeerLostError` instead."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            raise self._lost(what, e) from e


def _left_message(reasons: dict[int, str], step: int) -> str:
    """What every rank raises when the ranks ``reasons`` names left the lockstep."""
    if len(reasons) == 1:
        ((r, why),) = reasons.items()
        what = f"tensor-parallel rank {r} left the lockstep at step {step}: its step raised {why}"
    else:
        what = f"tensor-parallel {_ranks(list(reasons))} left the lockstep at step {step}: " + (
            "; ".join(f"rank {r}'s step raised {why}" for r, why in reasons.items())
        )
    return what + "; every rank of the group raises this error"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _is_comm_error(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure (gloo and NCCL raise ``RuntimeError``)."""
    try:
        import torch.distributed as dist

        if isinstance(error, dist.DistError):
            return True
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text
        for s in ("gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timeout")
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
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    except RuntimeError as e:
        raise PeerLostError(
            f"rank {dist.get_rank(group)}: agree_num_pages lost a peer (it died, or did not "
            f"call agree_num_pages): {type(e).__name__}: {str(e).strip()[:300]}"
        ) from e
    return int(t[0])


def check_same_config(lock: Lockstep, config: dict[str, Any]) -> None:
    """Engine construction (collective): every rank's ``config`` must be equal; else
    ``ValueError`` on every rank naming each setting that differs and every rank's value."""
    dist = _dist()
    items = list(config.items())
    got: list[Any] = [None] * lock.world_size
    lock._collective(
        "the check of the engines' settings",
        dist.all_gather_object,
        got,
        items,
        group=lock.cpu_group,
    )
    tables = [dict(other) for other in got]
    names = list(config) + [k for t in tables for k in t if k not in config]
    missing = object()
    bad = []
    for name in dict.fromkeys(names):
        values = [t.get(name, missing) for t in tables]
        if all(v == values[0] for v in values):
            continue
        shown = ", ".join(
            f"rank {r} has {_show(name, v) if v is not missing else 'no such setting'}"
            for r, v in enumerate(values)
        )
        bad.append(f"{name} must be the same on every rank of the group: {shown}")
    if bad:
        raise ValueError("; ".join(bad))


def _show(name: str, value: Any) -> str:
    if "digest" in name and isinstance(value, int) and not isinstance(value, bool):
        return f"{value:#x}"
    return repr(value)


def _signed(x: int) -> int:
    """A 64-bit unsigned int as int64."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _unsigned(x: Any) -> int:
    return int(x) & ((1 << 64) - 1)
