"""The stores a shared KV tier (:mod:`radixkv.kv.tiers.shared`) can sit on, behind one small
interface: :class:`SharedStore` (batched ``exists``, ``get``, ``put``, ``delete`` of byte values
under byte keys). The tier builds pages and checks them; a store only moves bytes.

Backends, chosen by the URL's scheme (:func:`open_store`):

- ``redis://[user:password@]host[:port][/db]``, ``rediss://...`` (TLS) and
  ``unix:///path/to/socket[?db=N]``: a RESP store (Redis, Valkey, or anything speaking RESP),
  through redis-py (extra ``radixkv[shared]``). Retries are off and the timeouts short, so a
  dead store costs milliseconds a call (redis-py's default retries cost seconds), and the
  tier's circuit breaker stops calling it at all until it comes back.

- ``mooncake://master_host:port[?local_hostname=H&protocol=tcp&metadata=P2PHANDSHAKE
  &local_buffer_mb=N&global_segment_mb=N]``: Mooncake Store (its master at ``host:port``),
  through its Python client (PyPI ``mooncake-transfer-engine-non-cuda`` on a CPU machine, or a
  CUDA build; Debian's ``libibverbs1``). The client connects on the first call (a master that
  is down is no error when the tier is made); ``global_segment_mb`` (default 0) is memory this
  process lends the store, which goes with it: run a ``mooncake_client`` holder beside the
  master so that the pages outlive any replica. Mooncake's transfer listeners bind every
  address of the machine. The client's own RPC timeout is 30 s (a master that stops answering
  held a call that long); each call here runs on a thread of the store's and is given up after
  ``timeout_s`` (its first, which sets the client up, after ``setup_timeout_s``): a
  :class:`SharedStoreError`, and until that call comes back every other one fails at once.

Store credentials (a Redis AUTH password or ACL user) live in the URL, or in the file a server
is given; they are never printed: :func:`redact` is what error messages, logs, metrics and
``repr`` show of a URL.
"""

from __future__ import annotations

import contextlib
import ipaddress
import queue
import threading
import urllib.parse
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

import radixkv

#: URL schemes of the RESP backend.
RESP_SCHEMES = ("redis", "rediss", "unix")
#: URL scheme of the Mooncake Store backend, and the query keys it takes.
MOONCAKE_SCHEME = "mooncake"
MOONCAKE_OPTIONS = (
    "local_hostname",
    "protocol",
    "metadata",
    "local_buffer_mb",
    "global_segment_mb",
)
#: Seconds a RESP call may wait for the store's answer, and for a connection, by default.
TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 0.25
#: Seconds a Mooncake call may take, and its first one (the client's setup: its transfer
#: engine, the master's handshake), by default.
MOONCAKE_TIMEOUT_S = 2.0
MOONCAKE_SETUP_TIMEOUT_S = 15.0


class SharedStoreError(radixkv.Error):
    """A call to the shared store failed (down, slow, full, refused): the tier counts it, its
    breaker opens, and the request computes what the store would have given."""


class SharedStore(Protocol):
    """What the shared tier needs of a store: batched calls, one round trip each where the
    backend allows. Every method raises :class:`SharedStoreError` when the store fails."""

    #: The store's address with any credential masked (what may be printed).
    address: str
    #: Whether the store is on this machine only (a loopback address or a unix socket).
    local: bool

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each key."""

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value (None where the store holds none)."""

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Stores each ``(key, value)``."""

    def delete(self, keys: Sequence[bytes]) -> None:
        """Drops each key (a missing one is no error)."""

    def close(self) -> None:
        """Closes the connections."""


def redact(url: str) -> str:
    """``url`` with its user and password masked (``redis://***@host:6379/0``); the host, port,
    path and query stay, so the message still says which store."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<an unparsable URL>"
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"***@{host}" + (f":{parts.port}" if _port(parts) is not None else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _port(parts: urllib.parse.SplitResult) -> int | None:
    try:
        return parts.port
    except ValueError:
        return None


def is_local(url: str) -> bool:
    """Whether ``url`` names a store reachable from this machine only: a unix socket, or a
    host that is ``localhost`` or a loopback address (``127.0.0.0/8``, ``::1``). A Mooncake
    Store never is: its transfer listeners bind every address of the machine, so other
    machines can write into the segments (it needs a key)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        return True
    if parts.scheme == MOONCAKE_SCHEME:
        return False
    return _loopback(parts.hostname or "")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url: Any) -> str:
    """``url`` checked: a str with a known scheme, and for ``redis``/``rediss`` a host, for
    ``unix`` a socket path; ``ValueError`` naming the (redacted) URL and what is wrong."""
    if not isinstance(url, str):
        raise ValueError(f"shared_store must be a URL str (redis://host:port), got {url!r}")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"shared store URL {redact(url)!r} is not a valid URL: {e}") from None
    if parts.scheme not in (*RESP_SCHEMES, MOONCAKE_SCHEME):
        raise ValueError(
            f"shared store URL {redact(url)!r} has scheme {parts.scheme!r}: use redis://host:port "
            "(Redis or Valkey), rediss:// (TLS), unix:///path/to/socket or "
            "mooncake://master:port (Mooncake Store)"
        )
    if parts.scheme == MOONCAKE_SCHEME:
        mooncake_options(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(
                f"shared store URL {redact(url)!r} names no socket: use unix:///path/to/socket"
            )
    elif not parts.hostname:
        raise ValueError(f"shared store URL {redact(url)!r} names no host: use redis://host:port")
    del port
    return url


def open_store(
    url: str, timeout_s: float = TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S
) -> SharedStore:
    """The store ``url`` names (see the module docstring for the schemes); ``ValueError`` for a
    bad URL, ``ImportError`` naming the extra when its client library is missing. Nothing is
    sent to the store yet (a store that is down is no error here)."""
    check_url(url)
    if urllib.parse.urlsplit(url).scheme == MOONCAKE_SCHEME:
        return MooncakeStore(url)
    return RespStore(url, timeout_s, connect_timeout_s)


def mooncake_options(url: str) -> dict[str, Any]:
    """The Mooncake client's setup of ``url`` (``mooncake://master:port?...``): the master's
    address and the query's options with their defaults; ``ValueError`` naming the URL and the
    option that is unknown or bad."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname or _port(parts) is None:
        raise ValueError(
            f"shared store URL {redact(url)!r} names no master: use mooncake://host:port"
        )
    query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - set(MOONCAKE_OPTIONS))
    if unknown:
        raise ValueError(
            f"shared store URL {redact(url)!r}: unknown option {unknown[0]!r} (known: "
            f"{', '.join(MOONCAKE_OPTIONS)})"
        )
    out: dict[str, Any] = {
        "master": f"{parts.hostname}:{parts.port}",
        "local_hostname": query.get("local_hostname", "127.0.0.1"),
        "protocol": query.get("protocol", "tcp"),
        "metadata": query.get("metadata", "P2PHANDSHAKE"),
    }
    for name, default in (("local_buffer_mb", 64), ("global_segment_mb", 0)):
        text = query.get(name, str(default))
        if not text.isdigit():
            raise ValueError(
                f"shared store URL {redact(url)!r}: {name} must be a whole number of MiB, got "
                f"{text!r}"
            )
        out[name] = int(text)
    return out


class RespStore:
    """A RESP store (Redis, Valkey) through redis-py: one pipelined round trip a batch, no
    retries, ``timeout_s`` for an answer and ``connect_timeout_s`` for a connection."""

    def __init__(
        self, url: str, timeout_s: float = TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(
                f"a redis:// or unix:// shared store needs redis-py (pip install "
                f"'radixkv[shared]'): {e}"
            ) from None
        check_url(url)
        self.address = redact(url)
        self.local = is_local(url)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=connect_timeout_s,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
                health_check_interval=0,
            )
        except (ValueError, TypeError) as e:
            raise ValueError(f"shared store URL {self.address!r}: {e}") from None

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except self._errors as e:
            # The message names the call and the redacted address; redis-py's own text holds
            # no credential (it names host and port).
            raise SharedStoreError(
                f"shared store {self.address}: {what} failed: {type(e).__name__}: {e}"
            ) from None

    def _pipeline(self, what: str, op: str, args: Sequence[Any]) -> list[Any]:
        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for a in args:
                getattr(pipe, op)(*a) if isinstance(a, tuple) else getattr(pipe, op)(a)
            out: list[Any] = pipe.execute()
            return out

        return list(self._call(what, run)) if args else []

    def ping(self) -> None:
        """Raises :class:`SharedStoreError` unless the store answers."""
        self._call("PING", self._client.ping)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(n) for n in self._pipeline("EXISTS", "exists", list(keys))]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        out: list[bytes | None] = self._call("MGET", lambda: self._client.mget(list(keys)))
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        self._pipeline("SET", "set", [(k, v) for k, v in items])

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call("DEL", lambda: self._client.delete(*keys))

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RespStore({self.address!r})"


class MooncakeStore:
    """Mooncake Store through its Python client (``mooncake.store``): batched ``EXISTS``,
    ``GET`` and ``PUT``, one call each; the client is set up on the first call (and again after
    a failed setup). Calls are serialized by a lock (the tier's reader and writer threads
    share the client) and run on a thread of the store's, waited for ``timeout_s`` seconds
    (the first ``setup_timeout_s``): past that a :class:`SharedStoreError`, and every call
    until the late one comes back fails at once (the client cannot be interrupted). A negative
    status from the client is a :class:`SharedStoreError` naming the call and the status.
    Deleting is best effort: Mooncake keeps an object for its lease (10 s by default) after a
    read."""

    def __init__(
        self,
        url: str,
        timeout_s: float = MOONCAKE_TIMEOUT_S,
        setup_timeout_s: float = MOONCAKE_SETUP_TIMEOUT_S,
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(
                "a mooncake:// shared store needs Mooncake's Python client (pip install "
                f"mooncake-transfer-engine-non-cuda, and Debian's libibverbs1): {e}"
            ) from None
        self._options = mooncake_options(url)
        self.address = redact(url)
        self.local = is_local(url)
        self._make = MooncakeDistributedStore
        self._client: Any = None
        self._lock = threading.Lock()
        self.timeout_s, self.setup_timeout_s = timeout_s, setup_timeout_s
        #: The client's calls, run by one daemon thread (started on the first call). Not a
        #: ThreadPoolExecutor: its threads are joined at exit, and a call stuck in the
        #: client would then hold the process.
        self._calls: queue.Queue[tuple[Future, Any] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        #: A call given up on that the client still holds, and what it was.
        self._late: tuple[Future, str] | None = None

    def _store(self) -> Any:
        if self._client is None:
            o = self._options
            client = self._make()
            rc = client.setup(
                o["local_hostname"],
                o["metadata"],
                o["global_segment_mb"] * 2**20,
                o["local_buffer_mb"] * 2**20,
                o["protocol"],
                "",
                o["master"],
            )
            if rc != 0:
                raise SharedStoreError(
                    f"shared store {self.address}: connecting to the master {o['master']} failed "
                    f"(status {rc})"
                )
            self._client = client
        return self._client

    def _run(self) -> None:
        """The worker thread: runs each call on the client (set up first when it is not)."""
        while True:
            item = self._calls.get()
            if item is None:
                return
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self._store()))
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def _submit(self, fn: Any) -> Future:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="radixkv-mooncake", daemon=True)
            self._worker.start()
        fut: Future = Future()
        self._calls.put((fut, fn))
        return fut

    def _call(self, what: str, fn: Any) -> Any:
        with self._lock:
            if self._late is not None:
                late, which = self._late
                if not late.done():
                    raise SharedStoreError(
                        f"shared store {self.address}: {what} not sent: the client still waits "
                        f"for the store's answer to an earlier {which}"
                    )
                self._late = None
            limit = self.timeout_s if self._client is not None else self.setup_timeout_s
            fut = self._submit(fn)
            try:
                return fut.result(limit)
            except FutureTimeout:
                self._late = (fut, what)
                raise SharedStoreError(
                    f"shared store {self.address}: {what}: no answer in {limit:g} s"
                ) from None
            except SharedStoreError:
                raise
            except (RuntimeError, OSError, ValueError) as e:
                raise SharedStoreError(
                    f"shared store {self.address}: {what} failed: {type(e).__name__}: {e}"
                ) from None

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        got = self._call("EXISTS", lambda c: c.batch_is_exist([k.decode() for k in keys]))
        bad = [int(n) for n in got if int(n) < 0]
        if bad:
            raise SharedStoreError(f"shared store {self.address}: EXISTS failed (status {bad[0]})")
        return [int(n) == 1 for n in got]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        got = self._call("GET", lambda c: c.get_batch([k.decode() for k in keys]))
        return [bytes(v) if v else None for v in got]

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not items:
            return
        keys = [k.decode() for k, _ in items]
        values = [v for _, v in items]
        rc = self._call("PUT", lambda c: c.put_batch(keys, values))
        if rc != 0:
            raise SharedStoreError(f"shared store {self.address}: PUT failed (status {rc})")

    def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call("DEL", lambda c: c.batch_remove([k.decode() for k in keys]))

    def close(self) -> None:
        """Closes the client on the worker thread (given up after ``timeout_s`` when the store
        does not answer) and ends that thread."""
        with self._lock:
            if self._worker is None:
                return

            def shut(client: Any) -> None:
                self._client = None
                client.close()

            if self._client is not None and self._late is None:
                with contextlib.suppress(Exception):
                    self._submit(shut).result(self.timeout_s)
            self._calls.put(None)
            self._worker = None

    def __repr__(self) -> str:
        return f"MooncakeStore({self.address!r})"
