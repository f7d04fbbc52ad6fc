"""A real ``redis-server`` for the shared tier's tests: started on a free loopback port (or a
unix socket) in a temporary directory, with persistence off, and stopped by its PID.

The tests skip, saying why, where ``redis-server`` or redis-py is missing (``make deps`` and
``.ci/run`` install both)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def require() -> str:
    """The ``redis-server`` executable; skips the test without it or without redis-py."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; make deps)")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install redis)")
    return exe


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process in ``directory``: on ``port`` of 127.0.0.1, or on a unix
    socket ``directory/redis.sock`` with ``unix=True``. :meth:`stop` kills it (SIGKILL: the
    store dies as a crash would), :meth:`start` starts it again on the same address (empty)."""

    def __init__(self, directory: Path, unix: bool = False, password: str | None = None) -> None:
        self.exe = require()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.unix = unix
        self.password = password
        self.port = 0 if unix else free_port()
        self.socket = str(self.directory / "redis.sock")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.unix:
            return f"unix://{auth}{self.socket}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
        ]
        if self.unix:
            args += ["--unixsocket", self.socket, "--unixsocketperm", "700"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.directory
        )
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start (exit {self.proc.poll()})"
                    ) from None
                time.sleep(0.02)
        client.close()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        if self.unix and os.path.exists(self.socket):
            os.remove(self.socket)
