"""`radixkv serve` as a real process, for the tests and benches that start one: spawn it, wait
until it answers ``/health``, stop it with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from types import ModuleType


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs_real_server() -> ModuleType:
    """At the top of a test module that runs ``radixkv serve`` on the real model: skips the
    module unless that can run here (radixkv[serve], torch, the ``openai`` client that drives
    it, the packaged model); returns the ``openai`` module."""
    import pytest

    pytest.importorskip("fastapi", reason="radixkv serve needs radixkv[serve]")
    pytest.importorskip("torch", reason="radixkv serve needs torch")
    openai = pytest.importorskip("openai", reason="the tests drive the server with openai")
    from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path

    if smollm2_path() is None:
        pytest.skip(f"the real model is not installed: {SMOLLM2_INSTALL}", allow_module_level=True)
    return openai


def spawn(port: int, *args: str, threads: int = 2, new_session: bool = False) -> subprocess.Popen:
    """``radixkv serve --port PORT ARGS...`` started, not waited for (``threads`` CPU threads;
    ``new_session``: in a process group of its own, as a service manager starts it)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return subprocess.Popen(
        [sys.executable, "-m", "radixkv", "serve", "--port", str(port), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=new_session,
    )


def exit_of(
    port: int, *args: str, threads: int = 2, timeout: float = 120.0, new_session: bool = False
) -> tuple[int, str]:
    """``radixkv serve --port PORT ARGS...`` run to its exit (one that refuses its options):
    ``(exit status, stderr)``. Past ``timeout`` seconds it is killed (its process group with
    ``new_session``) and ``subprocess.TimeoutExpired`` raised."""
    proc = spawn(port, *args, threads=threads, new_session=new_session)
    try:
        rc = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            if new_session:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
    return rc, proc.stderr.read()


def start(
    port: int, *args: str, threads: int = 2, timeout: float = 180.0, new_session: bool = False
) -> subprocess.Popen:
    """:func:`spawn`, then wait until it answers ``GET /health``. ``RuntimeError`` with its
    stderr if it exits first, or (killed) if it does not answer within ``timeout`` seconds."""
    proc = spawn(port, *args, threads=threads, new_session=new_session)
    wait_healthy(proc, port, timeout)
    return proc


def wait_healthy(
    proc: subprocess.Popen, port: int, timeout: float, tail: Callable[[], str] | None = None
) -> None:
    """Returns once the server ``proc`` answers ``GET /health`` on ``port``. ``RuntimeError``
    with ``tail()`` (default: its stderr) if it exits first, or (killed) if it does not answer
    within ``timeout`` seconds."""
    import httpx

    def why() -> str:
        return (tail() if tail is not None else proc.stderr.read())[-3000:]

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"radixkv serve exited {proc.returncode}:\n{why()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"radixkv serve did not answer /health within {timeout:g} s:\n{why()}")


def stop(proc: subprocess.Popen, timeout: float = 120.0) -> tuple[int, str]:
    """SIGTERM, then ``(exit status, stderr)`` once it exited (within ``timeout`` seconds)."""
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout)
    return rc, proc.stderr.read()


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux: read from ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found
