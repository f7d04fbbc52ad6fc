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
requests in flight fail, the server stops taking requests and exits 1. An idle rank 0 steps
an empty step every :data:`radixkv.apps.serve.app.HEARTBEAT_S` seconds, so a lost rank is found
without a request. Ranks 1 to N-1 ignore SIGINT and SIGTERM (a Ctrl-C, or a service manager's
SIGTERM, reaches the whole process group: rank 0 drains and then closes them) and die with
rank 0 (``PR_SET_PDEATHSIG`` on Linux), so none outlives it.
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

from radixkv.apps.common.args import UsageError

#: Seconds rank 0 gives the other ranks to exit once it closed the engine, before killing them.
EXIT_WAIT_S = 30.0


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


def check_model(args: argparse.Namespace) -> None:
    """Rank 0, before any other rank starts: the checkpoint is there (a ``.gguf`` file is
    converted now, once, rather than by every rank at once) and its heads divide among the
    ranks; a :class:`UsageError` naming the counts and the sizes that would divide them."""
    import transformers

    from radixkv.hf._load import checkpoint_of
    from radixkv.hf._support import undivided_heads

    world = args.tensor_parallel_size
    try:
        config = transformers.AutoConfig.from_pretrained(checkpoint_of(args.model))
        if not undivided_heads(config, world):
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

    def watch(self, on_lost: Callable[[int, int], None]) -> None:
        """Calls ``on_lost(rank, status)`` (on a thread of its own) when a rank exits before
        :attr:`closing` is set."""

        def run() -> None:
            while not self.closing.is_set():
                for rank, proc in enumerate(self.procs, start=1):
                    status = proc.poll()
                    if status is not None and not self.closing.is_set():
                        on_lost(rank, status)
                        return
                self.closing.wait(0.2)

        threading.Thread(target=run, name="radixkv-ranks", daemon=True).start()

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

    try:
        engine.follow()
    except radixkv.Error as e:  # the ranks parted (rank 0 says so too)
        print(f"radixkv serve (rank {rank}): {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # No teardown of the process group: gloo's, destroyed while the other ranks exit, can
    # abort the process from a background thread.
    os._exit(status)
