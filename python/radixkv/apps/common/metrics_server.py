"""``--metrics-port``: the Prometheus endpoint of ``radixkv demo`` and ``radixkv replay``, and
``--keep-serving``, which keeps it up after the run (until interrupted) for a scraper or a
dashboard to read the final figures.

Every user error (a port out of range or in use, an address that does not resolve or is not
this machine's, prometheus_client not installed) is a :class:`~radixkv.apps.common.args.UsageError`:
one line, exit status 2.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from typing import Any

from radixkv.apps.common.args import UsageError


def port_number(text: str) -> int:
    """An argparse ``type``: a TCP port, an int in ``[0, 65535]`` (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a port number in [0, 65535], got {text!r}"
        ) from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--metrics-port N`` and ``--metrics-addr``."""
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="N",
        help="serve Prometheus metrics on http://ADDR:N/metrics while running "
        "(needs prometheus_client: pip install 'radixkv[metrics]'; 0 picks a free port; "
        "default: no endpoint)",
    )
    p.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for all)",
    )
    p.add_argument(
        "--keep-serving",
        action="store_true",
        help="with --metrics-port: after the run, keep serving its final metrics until "
        "interrupted (Ctrl-C, SIGINT) instead of exiting (default: stop with the run)",
    )


#: Endpoints started and not closed (they live as long as the process unless closed).
RUNNING: list[MetricsServer] = []


class MetricsServer:
    """One endpoint whose collector follows the run in progress (a cache, its scheduler and
    engine, and constant labels such as the replay policy). Raises :class:`UsageError` naming
    the port or address when the endpoint cannot be started."""

    def __init__(self, command: str, port: int, addr: str) -> None:
        try:
            from radixkv import metrics
        except ImportError as e:
            raise UsageError(f"{command}: --metrics-port: {e}") from None
        self._metrics = metrics
        self._collector: Any = None
        try:
            self.server = metrics.serve(None, port, addr)
        except OverflowError as e:  # a port the socket layer refuses
            raise UsageError(f"{command}: --metrics-port {port}: {e}") from None
        except OSError as e:  # in use, not permitted, or an address that is not usable
            raise UsageError(
                f"{command}: cannot serve metrics on --metrics-addr {addr!r} --metrics-port "
                f"{port}: {e.strerror or e}"
            ) from None
        except ValueError as e:
            raise UsageError(f"{command}: --metrics-port {port}: {e}") from None
        self._registry = self.server.registry
        #: Where it serves: ``http://ADDR:PORT/metrics``.
        self.url = f"http://{addr}:{self.server.server_port}/metrics"
        RUNNING.append(self)
        print(f"metrics: {self.url}", flush=True)

    def close(self) -> None:
        """Stops the endpoint."""
        self.server.shutdown()
        self.server.server_close()
        if self in RUNNING:
            RUNNING.remove(self)

    def follow(self, cache: Any, scheduler: Any = None, engine: Any = None, **labels: str) -> None:
        """Serves the metrics of this cache (scheduler, engine) from now on."""
        new = self._metrics.CacheCollector(
            cache, scheduler=scheduler, engine=engine, labels=labels or None
        )
        if self._collector is not None:
            self._registry.unregister(self._collector)
        self._registry.register(new)
        self._collector = new


def start(command: str, args: argparse.Namespace) -> MetricsServer | None:
    """The endpoint if ``--metrics-port`` was given; a :class:`UsageError` for
    ``--keep-serving`` without it."""
    check(command, args)
    if args.metrics_port is None:
        return None
    return MetricsServer(command, args.metrics_port, args.metrics_addr)


def check(command: str, args: argparse.Namespace) -> None:
    """The checks of :func:`start` without starting anything (before the work starts)."""
    if args.metrics_port is None and args.keep_serving:
        raise UsageError(f"{command}: --keep-serving needs --metrics-port")


def keep_serving(args: argparse.Namespace, wait: Callable[[], object] | None = None) -> None:
    """With ``--keep-serving``: serves the running endpoints until interrupted (``wait``: what
    blocks, by default forever; a KeyboardInterrupt ends it), then closes them."""
    if not args.keep_serving or not RUNNING:
        return
    urls = ", ".join(ep.url for ep in RUNNING)
    print(f"metrics: still serving {urls} until interrupted (Ctrl-C)", flush=True)
    try:
        (wait or threading.Event().wait)()
    except KeyboardInterrupt:
        pass
    finally:
        for ep in list(RUNNING):
            ep.close()
