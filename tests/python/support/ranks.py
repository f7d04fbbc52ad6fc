"""Ranks of a multi-process test: started on a free local port, each writing a JSON report that
the test reads (shared by ``test_tp.py`` and ``test_hf_tp.py``).

Ranks are forked from a fork server that imported torch and radixkv once (``forkserver``: a
fresh process that has started no threads, so forking it is safe), rather than each a new
interpreter importing them again (``spawn``): a few seconds of two cores saved on every test.

A worker is ``worker(rank, port, *args)``; it fills a report dict (``"crash"``: the traceback of
whatever it raised) and ends with :func:`end_rank`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch

#: Seconds the ranks may take before the test fails (and the process group times out).
WATCHDOG_S = 120

#: What the fork server imports before it forks any rank.
PRELOAD = ["torch", "torch.distributed", "radixkv", "radixkv.engine.lockstep", "radixkv.models"]


def run_ranks(
    worker: Callable[..., None],
    args: tuple[Any, ...],
    out_dir: Path,
    nprocs: int,
    what: str,
    watchdog_s: float = WATCHDOG_S,
) -> list[dict]:
    """Starts ``nprocs`` ranks of ``worker(rank, port, *args)`` and returns their reports (from
    ``out_dir``); fails the test if they hang past ``watchdog_s`` or one crashed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    multiprocessing.set_forkserver_preload(PRELOAD)
    ctx = torch.multiprocessing.start_processes(
        worker, args=(port, *args), nprocs=nprocs, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + watchdog_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} hung for {watchdog_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nprocs)]
    for r, rep in enumerate(reports):
        assert "crash" not in rep, f"rank {r} crashed:\n{rep['crash']}"
    return reports


def join_gloo(rank: int, port: int, world: int, timeout_s: float = WATCHDOG_S):
    """This process (one torch thread) as rank ``rank`` of ``world`` over gloo, meeting the
    others on the loopback ``port``, collectives timing out after ``timeout_s``; returns the
    group of them all."""
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return torch.distributed.group.WORLD


def end_rank(rank: int, out_dir: str, report: dict, barrier: bool = True) -> NoReturn:
    """Writes ``report`` to ``out_dir/rank<rank>.json``, waits for the other ranks' (unless this
    one crashed, or ``barrier=False``: a rank whose group is out of step, after a peer died or
    a rank left the lockstep mid-forward, would wait in the barrier for the group's timeout)
    and exits the process."""
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    if barrier and "crash" not in report and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every report is written
    # No teardown: gloo's process group, destroyed while another rank exits, sometimes aborts
    # the process from a background thread (about 1 run in 20 here). The test reads the reports;
    # the operating system closes the sockets.
    os._exit(0)
