"""``radixkv serve --tensor-parallel-size N``: the model sharded over N processes of this machine.

The command is rank 0: it serves HTTP and steps the engine. It starts ranks 1 to N-1 as
processes of their own (``python -m radixkv.apps.serve.ranks``, the parsed arguments on their
stdin); every rank loads its shard of the model (:func:`radixkv.hf.load` with
``tensor_parallel=True``: transformers' plan, one CUDA device per rank, or the CPU without one,
``torch.distributed`` initialised from the environment made here: loopback, a free port) and
its own pool of its heads' KV; ranks 1 to N-1 then follow rank 0's steps
(:meth:`radixkv.Engine.follow`) until rank 0 closes the engine as the server stops.

Failures. A rank that exits before rank 0 closes it (a crash, an out-of-memory kill) stops the
server: while loading, rank 0 exits at once with status 1, naming the rank; once serving, the
requests in flight fail, the server stops taking requests and exits 1. A rank that stops
answering (stopped by SIGSTOP, hung) is found by the collectives' timeout: once the engines are
made, every collective of every rank is given up after ``--rank-timeout`` seconds
(:func:`bound_collectives`), and the server stops the same way; :meth:`Ranks.blame` names the
rank that was lost (the ranks that gave up waiting for it exit with :data:`LOST_PEER`, which
blames another). An idle rank 0 steps an empty step at least every
:data:`radixkv.apps.serve.engine_loop.HEARTBEAT_S` seconds (more often under a shorter timeout:
:func:`heartbeat_for`), so a lost rank is found without a request and an idle one never times
out. Ranks 1 to N-1 ignore SIGINT and SIGTERM (a Ctrl-C, or a service manager's SIGTERM,
reaches the whole process group: rank 0 drains and then closes them) and die with rank 0
(``PR_SET_PDEATHSIG`` on Linux), so none outlives it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from radixkv.apps.common.args import UsageError

#: Seconds rank 0 gives the other ranks to exit once it closed the engine, before killing them.
EXIT_WAIT_S = 30.0
#: ``--rank-timeout``'s default: seconds a collective of the ranks may wait for the others once
#: serving (the model loads under torch's own timeout).
RANK_TIMEOUT_S = 30.0
#: The exit status of a rank 1..N-1 that gave up on another (a collective failed or timed
#: out): it was not the rank lost, so :meth:`Ranks.blame` looks further.
LOST_PEER = 3
#: Seconds :meth:`Ranks.blame` waits for the lost rank to show (its process to exit or be seen
#: stopped, the others to give up on it).
BLAME_WAIT_S = 2.0


def free_port() -> int:
    """A TCP port free on the loopback address now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """What ``torch.distributed`` (initialised by transformers) reads to find rank ``rank``."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def splits_attention(config: Any) -> bool:
    """Whether transformers' tensor-parallel plan for ``config``'s model splits its attention
    heads among the ranks: its ``base_model_tp_plan`` names a ``k_proj`` (LFM2's and
    Falcon-H1's plans name the embeddings only, and keep every head on every rank). True for a
    config with no plan."""
    plan = getattr(config, "base_model_tp_plan", None)
    return not plan or any(key.endswith("k_proj") for key in plan)


def check_model(args: argparse.Namespace) -> None:
    """Rank 0, before any other rank starts: the checkpoint is there (a ``.gguf`` file is
    converted now, once, rather than by every rank at once) and its heads divide among the
    ranks (where the plan splits them); a :class:`UsageError` naming the counts and the sizes
    that would divide them."""
    import transformers

    from radixkv.hf._load import checkpoint_of
    from radixkv.hf._support import undivided_heads

    world = args.tensor_parallel_size
    try:
        config = transformers.AutoConfig.from_pretrained(checkpoint_of(args.model))
        if not splits_attention(config) or not undivided_heads(config, world):
            return  # (radixkv.hf.check_model says what else is wrong with the model, if aught)
    except ValueError as e:
        raise UsageError(str(e)) from None
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    sizes = [n for n in range(1, kv_heads + 1) if not undivided_heads(config, n)]
    raise UsageError(
        f"--tensor-parallel-size {world}: {args.model} has {heads} attention heads and "
        f"{kv_heads} KV heads, which do not divide among {world} ranks (sizes that do: "
        f"{', '.join(map(str, sizes))})"
    )


def heartbeat_for(timeout: float) -> float:
    """Seconds between an idle rank 0's empty steps under a collectives' ``timeout``: the
    server's heartbeat, or a third of the timeout when that is shorter, so that the other
    ranks, waiting for rank 0's next step, always get one in time."""
    from radixkv.apps.serve.engine_loop import HEARTBEAT_S

    return min(HEARTBEAT_S, timeout / 3)


def bound_collectives(engine: Any, seconds: float) -> None:
    """Every collective ``engine``'s rank runs from now on (the lockstep's, the model's, on every
    group they use) is given up after ``seconds``: the collective raises, and the engine a
    :class:`radixkv.engine.lockstep.PeerLostError`. Called by every rank once its engine is
    made: loading, where ranks may lag each other by minutes, keeps torch's timeout."""
    import torch.distributed as dist

    lock = engine.lockstep
    groups = {id(g): g for g in (dist.group.WORLD, lock.group, lock.cpu_group) if g is not None}
    set_timeout = getattr(dist, "set_timeout", None)  # older torch: a private name
    if set_timeout is None:
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # pragma: no cover - an older torch still
        print(
            f"radixkv serve: torch {torch_version()} cannot change a process group's timeout: "
            f"--rank-timeout {seconds:g} is not applied (a newer torch applies it)",
            file=sys.stderr,
            flush=True,
        )
        return
    for group in groups.values():
        set_timeout(timedelta(seconds=seconds), group)


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger): its state in ``/proc`` (Linux;
    False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # pid (comm) state ...: comm may hold spaces and parentheses
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class Ranks:
    """Ranks 1 to N-1 of ``radixkv serve --tensor-parallel-size N``, as processes; this
    process is made rank 0 (its environment)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.world = args.tensor_parallel_size
        port = free_port()
        os.environ.update(rank_environment(0, self.world, port))
        # The options' values (not the parser and the callables the CLI keeps beside them).
        payload = pickle.dumps({k: v for k, v in vars(args).items() if not k.startswith("_")})
        self.procs: list[subprocess.Popen] = []
        #: Set once rank 0 let them go (closed the engine, or is stopping them): an exit is
        #: expected from then on.
        self.closing = threading.Event()
        try:
            for rank in range(1, self.world):
                env = dict(os.environ, **rank_environment(rank, self.world, port))
                env["RADIXKV_PARENT_PID"] = str(os.getpid())
                proc = subprocess.Popen(
                    [sys.executable, "-m", "radixkv.apps.serve.ranks"],
                    stdin=subprocess.PIPE,
                    env=env,
                )
                assert proc.stdin is not None
                proc.stdin.write(payload)
                proc.stdin.close()
                self.procs.append(proc)
        except BaseException:
            self.kill()
            raise

    def watch(self, on_lost: Callable[[str, int], None]) -> None:
        """Calls ``on_lost(why, status)`` (on a thread of its own) when a rank exits before
        :attr:`closing` is set: ``why`` names the rank lost (:meth:`blame`), ``status`` is the
        exit status of the rank that exited."""

        def run() -> None:
            while not self.closing.is_set():
                for rank, proc in enumerate(self.procs, start=1):
                    status = proc.poll()
                    if status is not None and not self.closing.is_set():
                        why = self.blame() if status == LOST_PEER else None
                        on_lost(why or f"rank {rank} exited (status {status})", status)
                        return
                self.closing.wait(0.2)

        threading.Thread(target=run, name="radixkv-ranks", daemon=True).start()

    def blame(self, wait: float = BLAME_WAIT_S) -> str | None:
        """Which rank was lost, once the ranks parted (a collective failed or timed out), in
        words; None if it cannot be told within ``wait`` seconds. The first found of: a rank
        that exited by itself (any status but :data:`LOST_PEER`); a rank whose process is
        stopped; the one rank still running once every other gave up waiting
        (:data:`LOST_PEER`); rank 0 when all of them gave up."""
        deadline = time.monotonic() + wait
        while True:
            statuses = [proc.poll() for proc in self.procs]
            for rank, status in enumerate(statuses, start=1):
                if status is not None and status != LOST_PEER:
                    return f"rank {rank} exited (status {status})"
            for rank, (proc, status) in enumerate(zip(self.procs, statuses), start=1):
                if status is None and _stopped(proc.pid):
                    return (
                        f"rank {rank} stopped answering: its process (pid {proc.pid}) is stopped "
                        "(SIGSTOP, or a debugger)"
                    )
            running = [r for r, status in enumerate(statuses, start=1) if status is None]
            if time.monotonic() >= deadline or not running:
                break
            time.sleep(0.05)
        if not running:
            return "rank 0 was lost: every other rank gave up waiting for it"
        if len(running) == 1 and len(self.procs) > 1:
            return f"rank {running[0]} stopped answering (every other rank gave up waiting for it)"
        return None

    def wait(self, timeout: float = EXIT_WAIT_S) -> bool:
        """Waits up to ``timeout`` seconds for every rank to exit, kills those left; returns
        whether all exited with status 0 by themselves."""
        self.closing.set()
        deadline = time.monotonic() + timeout
        clean = True
        for proc in self.procs:
            try:
                status = proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                clean = False
            else:
                clean = clean and status == 0
        return clean

    def kill(self) -> None:
        """Kills every rank now (rank 0 failed before serving: they would wait for it)."""
        self.closing.set()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


def _die_with_parent() -> None:
    """This process is killed when its parent (rank 0) exits, however it exits (Linux)."""
    parent = int(os.environ.get("RADIXKV_PARENT_PID", "0"))
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent and os.getppid() != parent:  # it exited before the call above
        os._exit(1)


def main() -> int:
    """Rank 1 to N-1: the arguments from stdin, the model's shard and the engine, then
    :meth:`radixkv.Engine.follow` until rank 0 closes it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    rank = os.environ.get("RANK", "?")
    args = argparse.Namespace(**pickle.loads(sys.stdin.buffer.read()))
    from radixkv.apps.serve.loading import make_engine

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with contextlib.suppress(ImportError):  # rank 0's progress bar is enough
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        engine, _, _ = make_engine(args)
    except UsageError as e:
        print(f"radixkv serve (rank {rank}): {e}", file=sys.stderr, flush=True)
        return 2
    import radixkv
    from radixkv.engine.lockstep import PeerLostError

    bound_collectives(engine, getattr(args, "rank_timeout", RANK_TIMEOUT_S))
    try:
        engine.follow()
    except PeerLostError as e:  # another rank was lost (rank 0 names it)
        _say(f"radixkv serve (rank {rank}): {e}")
        return LOST_PEER
    except radixkv.Error as e:  # the ranks parted (rank 0 says so too)
        _say(f"radixkv serve (rank {rank}): {e}")
        return 1
    return 0


def _say(line: str) -> None:
    """``line`` on stderr, if it is still there (its reader may have exited with rank 0): the
    exit status says the rest."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    status = main()
    with contextlib.suppress(OSError):
        sys.stdout.flush()
        sys.stderr.flush()
    # No teardown of the process group: gloo's, destroyed while the other ranks exit, can
    # abort the process from a background thread.
    os._exit(status)
