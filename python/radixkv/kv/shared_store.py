"""The stores a shared KV tier (:mod:`radixkv.kv.shared_tier`) can sit on, behind one small
interface: :class:`SharedStore` (batched ``exists``, ``get``, ``put``, ``delete`` of byte values
under byte keys). The tier builds pages and checks them; a store only moves bytes.

Backends, chosen by the URL's scheme (:func:`open_store`):

- ``redis://[user:password@]host[:port][/db]``, ``rediss://...`` (TLS) and
  ``unix:///path/to/socket[?db=N]``: a RESP store (Redis, Valkey, or anything speaking RESP),
  through redis-py (extra ``radixkv[shared]``). Retries are off and the timeouts short, so a
  dead store costs milliseconds a call (redis-py's default retries cost seconds), and the
  tier's circuit breaker stops calling it at all until it comes back.

Store credentials (a Redis AUTH password or ACL user) live in the URL, or in the file a server
is given; they are never printed: :func:`redact` is what error messages, logs, metrics and
``repr`` show of a URL.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Sequence
from typing import Any, Protocol

import radixkv

#: URL schemes of the RESP backend.
RESP_SCHEMES = ("redis", "rediss", "unix")
#: Seconds a RESP call may wait for the store's answer, and for a connection, by default.
TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 0.25


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
    host that is ``localhost`` or a loopback address (``127.0.0.0/8``, ``::1``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "unix":
        return True
    host = parts.hostname or ""
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
    if parts.scheme not in RESP_SCHEMES:
        raise ValueError(
            f"shared store URL {redact(url)!r} has scheme {parts.scheme!r}: use redis://host:port "
            "(Redis or Valkey), rediss:// (TLS) or unix:///path/to/socket"
        )
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
    return RespStore(url, timeout_s, connect_timeout_s)


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
