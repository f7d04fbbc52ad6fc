"""`SharedTier`: a ``KVCache``'s side of a KV pool shared by many replicas, on a store they all
reach (Redis or Valkey; :mod:`radixkv.kv.tiers.store`), so that a session routed to another
replica, a restarted replica or a new one finds the pages some replica already computed.

Why it looks like this. The disk tier already has what a shared pool needs, and this tier
reuses it rather than inventing a second one:

- **The same pages.** A value is the disk pool's slot: the 128-byte header (magic, the page's
  key, a checksum, the payload length, the setup digest; :mod:`.page`) then the payload in the
  disk tier's layout (``K[0] V[0] ... K[L-1] V[L-1]``,
  :data:`radixkv.kv.tiers.payload.PAGE_LAYOUT`), made and scattered by the same functions.
- **The same validity.** The setup digest is the disk directory's fingerprint (the model's
  config and weights digest, the pool's layout: :func:`.fingerprint.layout_fingerprint`) plus
  the MAC kind, and every page read back is checked against the key it is read for, the
  setup and its checksum before anything is written into a pool. A page that fails is dropped
  from the store and recomputed, never served.
- **The same keys.** The index's block keys are a content hash of the prefix (chained blake3 of
  the pages' tokens, salted with the tenant's namespace: :func:`radixkv.block_hashes`), the
  same in every process; a store key is that hash with the setup digest and a digest of the
  namespace in front (``radixkv:<setup>:<namespace>:<block hash>``), so a replica of another
  model, dtype or page size, or another tenant, never even asks for a page it does not own.
- **The same read-before-admission, off the engine's thread.** :meth:`SharedTier.poll` runs
  where the disk tier's prefetch does (``KVCache.fetch``, called by the engine for each waiting
  request before it is ranked). It never calls the store: it hands the pages the local tiers
  lack to the tier's reader thread, which walks them as a prefix (one batched ``EXISTS``, one
  batched ``GET`` of the leading run the store holds, stopping at the first miss and at the
  first page that fails its check; the checks run there too), and a later call installs what
  came back. Installing is cheap and on the engine's thread: the prefix is admitted, the
  fetched pages are written into its pages and committed, and the request is finished
  (published), so the pages enter the index the way computed KV does (the index's only other
  way in, the disk tier's ``disk_prefetch``, reads slots of its own disk only; going through
  admission needs no change to the index, publishes the pages (KV events included) like any
  computed prefix, and lets them move down to the host tier as any device page does). While
  its fetch is out (up to :attr:`SharedTier.hold_s`) the engine keeps the request out of the
  scheduler, so its admission finds the pages as hits; other requests run meanwhile. A page
  the store lacked is remembered for :data:`MISS_TTL_S`, so a request that waits does not ask
  the store again at every step.

Writes are behind the request: ``KVCache.commit`` hands the pages a step completed to
:meth:`SharedTier.publish`, which copies those the store is not known to hold out of the pool
at once (the pool may reuse them) in one gather and one device-to-host copy for the whole
step, and a background thread makes their values (header, checksum or MAC) and sends them in
batches (``EXISTS`` first, ``SET`` only of the pages the store lacks). A full queue drops pages
(counted), it never waits.

Trust: a store anyone can write to could plant KV that a replica then serves. With a secret
(``key``: the operator's, 16 bytes or more) each page's checksum is an HMAC-SHA256 of the page's
key, the setup and the payload under it, so a page that was not written by a holder of the
secret fails its check. Without a secret the checksum is the disk tier's (blake3, integrity
only), and the tier is refused on any store but a loopback address or a unix socket.

A failing store (down, slow, full, evicting) costs a bounded time and never a wrong page or a
failed request: every call has a short timeout and no retries and runs on the tier's own
threads (never in an engine step), a :class:`Breaker` stops calling a store that failed until
its cooldown passes, and every error is counted and taken as a miss (reads) or a dropped page
(writes).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import queue
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import radixkv
from radixkv._radixkv import _page_checksum
from radixkv.kv.tiers.breaker import Breaker
from radixkv.kv.tiers.fingerprint import layout_fingerprint
from radixkv.kv.tiers.page import HEADER, pack_header, unpack_header
from radixkv.kv.tiers.payload import page_payloads, scatter_payload
from radixkv.kv.tiers.store import SharedStore, SharedStoreError, open_store, redact

#: First bytes of a shared page's header (the disk pool's layout; another magic, since its
#: checksum may be a MAC).
SHARED_MAGIC = b"RKVSHRD1"
#: Fewest bytes a secret may have.
MIN_KEY_BYTES = 16
#: Pages one batch of the writer sends at most.
PUT_BATCH = 32
#: Bytes of pages queued for the writer at most (past it, pages are dropped).
MAX_QUEUED_BYTES = 256 * 2**20
#: Bytes one ``GET`` batch asks for at most.
MAX_GET_BYTES = 64 * 2**20
#: Store keys remembered as held by the store (not copied out again).
KNOWN_KEYS = 1 << 16
#: Seconds a page the store lacked is taken as missing without asking again.
MISS_TTL_S = 1.0
#: Seconds a request is held out of admission, at most, while its pages are being fetched.
HOLD_S = 1.0
#: Fetches kept at most (out, or back and not installed yet); past it the oldest are dropped.
MAX_LOOKUPS = 256
#: Namespaces of requests that asked for no prefix caching (the engine's private ones): never
#: shared.
PRIVATE_NAMESPACE = "radixkv.no-cache"


def check_secret(key: Any, where: str = "shared_store_key") -> bytes | None:
    """``key`` as bytes (a str is UTF-8 encoded; surrounding whitespace is dropped), or None;
    ``ValueError`` naming ``where`` (never the value) for one that is too short."""
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)):
        raise ValueError(f"{where} must be bytes or a str, got {type(key).__name__}")
    key = bytes(key).strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"{where} holds {len(key)} bytes: a shared store's key must have at least "
            f"{MIN_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | base64`)"
        )
    return key


#: The environment variable a server reads the secret from, without a key file.
KEY_ENV = "RADIXKV_SHARED_STORE_KEY"


def load_secret(path: str | None = None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The operator's secret: the contents of the file ``path`` (surrounding whitespace
    dropped), else the environment variable :data:`KEY_ENV`, else None. ``ValueError`` naming
    the file (never its contents) when it cannot be read or is too short."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(
                f"shared store key file {path!r} cannot be read: {e.strerror or e}"
            ) from None
        return check_secret(data, f"shared store key file {path!r}")
    value = (os.environ if environ is None else environ).get(KEY_ENV)
    if value:
        return check_secret(value, KEY_ENV)
    return None


def _namespace_bytes(namespace: Any) -> bytes:
    if namespace is None:
        return b"n"
    if isinstance(namespace, str):
        return b"s" + namespace.encode()
    return b"b" + bytes(namespace)


def _event_namespace(namespace: Any) -> bytes:
    """A namespace as the cache's events carry it (bytes: a str UTF-8 encoded)."""
    return namespace.encode() if isinstance(namespace, str) else bytes(namespace)


class _State:
    """What the engine's thread and the writer thread share (the writer holds no reference to
    the tier)."""

    def __init__(self, store: SharedStore, breaker: Breaker) -> None:
        self.store, self.breaker = store, breaker
        self.lock = threading.Lock()
        self.known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        #: Store keys the store lacked -> when that stops counting (monotonic seconds).
        self.misses: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        #: Notified whenever a fetch comes back.
        self.fetched = threading.Condition(self.lock)
        #: KV events of pages the store holds (see ``SharedTier.drain_events``), while recording.
        self.events: list[tuple[Any, ...]] = []
        self.queued_bytes = 0
        self.warned_unexpected = False
        self.counts = dict.fromkeys(
            (
                "lookups",
                "hit_pages",
                "hit_tokens",
                "put_pages",
                "present_pages",
                "dropped_pages",
                "bad_pages",
                "errors",
            ),
            0,
        )

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def remember(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            for k in keys:
                self.known[k] = None
                self.known.move_to_end(k)
            while len(self.known) > KNOWN_KEYS:
                self.known.popitem(last=False)

    def forget(self, key: bytes) -> None:
        with self.lock:
            self.known.pop(key, None)

    def missed(self, key: bytes) -> None:
        with self.lock:
            self.misses[key] = time.monotonic() + MISS_TTL_S
            self.misses.move_to_end(key)
            while len(self.misses) > KNOWN_KEYS:
                self.misses.popitem(last=False)

    def is_missing(self, key: bytes) -> bool:
        with self.lock:
            until = self.misses.get(key)
            if until is None:
                return False
            if time.monotonic() < until:
                return True
            del self.misses[key]
            return False

    def is_known(self, key: bytes) -> bool:
        with self.lock:
            return key in self.known

    def unexpected(self, what: str, e: BaseException) -> None:
        self.add("errors")
        if not self.warned_unexpected:
            self.warned_unexpected = True
            warnings.warn(
                f"{what} the shared KV tier failed unexpectedly ({type(e).__name__}: {e}); "
                "requests compute what it would have given",
                RuntimeWarning,
                stacklevel=4,
            )

    def failed(self, e: BaseException) -> None:
        self.add("errors")
        self.breaker.failure()
        if self.counts["errors"] == 1:
            warnings.warn(
                f"the shared KV tier's store failed ({e}); requests compute what it would "
                "have given until it answers again",
                RuntimeWarning,
                stacklevel=3,
            )


def _writer(q: queue.Queue[Any], state: _State, codec: _Codec) -> None:
    """The background writer: encodes queued ``(store_key, payload)`` pages (header,
    checksum or MAC) and sends them in batches (``EXISTS`` first, ``SET`` of the missing ones)
    until ``None``."""
    stop = False
    while not stop:
        batch = []
        item = q.get()
        while True:
            if item is None:
                stop = True
                q.task_done()
                break
            batch.append(item)
            if len(batch) >= PUT_BATCH:
                break
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
        try:
            if batch and _send([(k, codec.encode(k, payload)) for k, payload, _ in batch], state):
                _announce([meta for _, _, meta in batch if meta is not None], state)
        except Exception as e:  # a bug: the pages are dropped, the writer goes on
            state.unexpected("writing", e)
            state.add("dropped_pages", len(batch))
        finally:
            with state.lock:
                state.queued_bytes -= sum(payload.nbytes for _, payload, _ in batch)
            for _ in batch:
                q.task_done()


def _announce(metas: list[tuple[Any, ...]], state: _State) -> None:
    """Records a ``stored`` event per run of ``metas`` (``(namespace, parent, key, tokens)``
    of pages the store now holds) that chain one onto the next."""
    events: list[tuple[Any, ...]] = []
    for ns, parent, key, tokens in metas:
        last = events[-1] if events else None
        if last is not None and last[1] == ns and last[3][-1] == parent:
            last[3].append(key)
            last[4].append(tokens)
        else:
            events.append(["stored", ns, parent, [key], [tokens]])
    with state.lock:
        state.events.extend((k, ns, up, keys, np.concatenate(t)) for k, ns, up, keys, t in events)


def _send(batch: list[tuple[bytes, bytes]], state: _State) -> bool:
    """Sends ``batch`` (``EXISTS``, then ``SET`` of what the store lacks); whether the store
    holds it all now."""
    if not state.breaker.allow():
        state.add("dropped_pages", len(batch))
        return False
    try:
        held = state.store.exists([k for k, _ in batch])
        missing = [(k, v) for (k, v), h in zip(batch, held) if not h]
        state.store.put(missing)
    except SharedStoreError as e:
        state.failed(e)
        state.add("dropped_pages", len(batch))
        return False
    state.breaker.success()
    state.add("put_pages", len(missing))
    state.add("present_pages", len(batch) - len(missing))
    state.remember([k for k, _ in batch])
    return True


class _Codec:
    """Makes and checks a tier's values (what the reader thread needs of the tier: it holds
    no reference to the tier, whose pools a dropped cache must free)."""

    def __init__(self, secret: bytes | None, setup: bytes, page_bytes: int) -> None:
        self.secret, self.setup, self.page_bytes = secret, setup, page_bytes

    def checksum(self, page_id: bytes, payload: np.ndarray | memoryview) -> bytes:
        if self.secret is None:
            return _page_checksum(page_id + self.setup, payload)
        m = hmac.new(self.secret, page_id + self.setup, hashlib.sha256)
        m.update(payload)
        return m.digest()

    def encode(self, store_key: bytes, payload: np.ndarray) -> bytes:
        page_id = _page_checksum(b"radixkv.shared.key", store_key)
        digest = self.checksum(page_id, payload)
        head = pack_header(SHARED_MAGIC, page_id, digest, len(payload), self.setup)
        return head + payload.tobytes()

    def decode(self, store_key: bytes, value: bytes | None) -> np.ndarray | None:
        if value is None or len(value) != HEADER + self.page_bytes:
            return None
        magic, page_id, digest, length, setup = unpack_header(value)
        expected = _page_checksum(b"radixkv.shared.key", store_key)
        if magic != SHARED_MAGIC or page_id != expected or setup != self.setup:
            return None
        if length != self.page_bytes:
            return None
        payload = np.frombuffer(value, dtype=np.uint8, offset=HEADER)
        if not hmac.compare_digest(self.checksum(expected, payload), digest):
            return None
        return payload


class _Lookup:
    """One fetch: the store keys of pages ``first..`` of a prompt; ``payloads`` (the checked
    leading run) once ``done``."""

    def __init__(self, keys: list[bytes], first: int) -> None:
        self.keys, self.first = keys, first
        self.started = time.monotonic()
        self.payloads: list[np.ndarray] = []
        self.done = False


def _reader(q: queue.Queue[Any], state: _State, codec: _Codec, page_bytes: int) -> None:
    """The background reader: walks each queued :class:`_Lookup` in the store until ``None``."""
    while True:
        lookup = q.get()
        if lookup is None:
            return
        try:
            lookup.payloads = _walk(lookup.keys, state, codec, page_bytes)
        except Exception as e:  # never a wrong page: a miss
            state.unexpected("reading", e)
            lookup.payloads = []
        with state.fetched:
            lookup.done = True
            state.fetched.notify_all()


def _walk(keys: list[bytes], state: _State, codec: _Codec, page_bytes: int) -> list[np.ndarray]:
    """The checked payloads of the leading run of ``keys`` the store holds (see the module
    docstring); a failing store gives none. The first page missing or bad is remembered as a
    miss, a bad one dropped from the store."""
    if not state.breaker.allow():
        return []
    state.add("lookups")
    try:
        held = state.store.exists(keys)
        run = next((i for i, h in enumerate(held) if not h), len(held))
        values: list[bytes | None] = []
        step = max(1, MAX_GET_BYTES // (HEADER + page_bytes))
        for a in range(0, run, step):
            values.extend(state.store.get(keys[a : min(run, a + step)]))
    except SharedStoreError as e:
        state.failed(e)
        return []
    state.breaker.success()
    payloads = []
    for k, value in zip(keys, values):
        payload = codec.decode(k, value)
        if payload is None:
            if value is not None:  # a bad page: dropped from the store, recomputed
                state.add("bad_pages")
                state.forget(k)
                try:
                    state.store.delete([k])
                except SharedStoreError as e:
                    state.failed(e)
            break
        payloads.append(payload)
    if len(payloads) < len(keys):
        state.missed(keys[len(payloads)])
    return payloads


class SharedTier:
    """The shared tier of a ``KVCache`` (``kv``) on the store ``url`` (see
    :func:`radixkv.kv.tiers.store.open_store`), or on ``store`` (any
    :class:`radixkv.kv.tiers.store.SharedStore`).

    ``fingerprint``: what the KV depends on besides the pool's layout (the model's:
    :func:`radixkv.kv.tiers.fingerprint.model_fingerprint`); pages are keyed and checked by it.
    ``key``: the operator's secret (bytes or str, at least 16 bytes): pages carry an HMAC-SHA256
    under it; without one, a store that is not on a loopback address or a unix socket is
    refused (``ValueError`` saying why). ``breaker``: the circuit breaker (default: open after one
    failure, for two seconds).

    Not for a cache with a window group (``ValueError``): a window layer's pool holds a
    request's last pages only.
    """

    def __init__(
        self,
        kv: Any,  # the KVCache (not imported: kv_cache imports this module)
        url: str | None = None,
        fingerprint: Mapping[str, object] | None = None,
        key: bytes | str | None = None,
        *,
        store: SharedStore | None = None,
        breaker: Breaker | None = None,
    ) -> None:
        if fingerprint is not None and not isinstance(fingerprint, Mapping):
            raise TypeError(
                f"fingerprint must be a mapping (e.g. model_fingerprint(model)), got "
                f"{type(fingerprint).__name__}"
            )
        if kv.window_layers:
            raise ValueError(
                "a shared KV tier is not supported with a window group yet: the window layers' "
                "pool holds a request's last pages only"
            )
        secret = check_secret(key)
        if store is None:
            if url is None:
                raise ValueError("SharedTier needs a store URL or a store")
            store = open_store(url)
        if secret is None and not store.local:
            raise ValueError(
                f"the shared store {store.address} is not on a loopback address or a unix "
                "socket, and no key was given: anyone who can write to that store could plant "
                "KV this replica would serve. Give the operator's secret (--shared-store-key-file "
                "FILE, RADIXKV_SHARED_STORE_KEY, or shared_store_key=) so every page carries a "
                "MAC, or use a store on this machine"
            )
        self.kv = kv
        self.page_size = kv.page_size
        self.page_bytes = type(kv).bytes_per_page(
            kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype, kv.page_size
        )
        self.mac = "hmac-sha256" if secret is not None else "blake3"
        full = {**layout_fingerprint(kv, fingerprint), "mac": self.mac}
        text = json.dumps(full, sort_keys=True, separators=(",", ":"))
        #: The digest of what a page is valid for (fingerprint, layout, MAC kind).
        self.setup = _page_checksum(b"radixkv.shared.setup", text.encode())
        self._secret = secret
        self.address = store.address
        self.breaker = breaker if breaker is not None else Breaker()
        self._state = _State(store, self.breaker)
        self._codec = _Codec(secret, self.setup, self.page_bytes)
        self._recording = False
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = threading.Thread(
            target=_writer,
            args=(self._queue, self._state, self._codec),
            name="radixkv-shared",
            daemon=True,
        )
        self._thread.start()
        #: Seconds a request is held out of admission, at most, while its pages are fetched
        #: (past it, it is admitted and computes them; the fetch still lands for later ones).
        self.hold_s = HOLD_S
        self._lookups: dict[bytes, _Lookup] = {}
        self._reads: queue.Queue[Any] = queue.Queue()
        self._reader: threading.Thread | None = threading.Thread(
            target=_reader,
            args=(self._reads, self._state, self._codec, self.page_bytes),
            name="radixkv-shared-read",
            daemon=True,
        )
        self._reader.start()
        ping = getattr(store, "ping", None)
        if ping is not None:
            try:
                ping()
            except SharedStoreError as e:
                self._state.failed(e)

    # ---- keys and pages --------------------------------------------------------------------

    def store_keys(
        self, tokens: Sequence[int] | np.ndarray, namespace: Any, first: int, end: int
    ) -> list[bytes]:
        """The store keys of pages ``first..end`` of ``tokens`` in ``namespace``."""
        hashes = radixkv.block_hashes(tokens[: end * self.page_size], self.page_size, namespace)
        return self._keys_of(hashes[first:end], namespace)

    def key_prefix(self, namespace: Any) -> bytes:
        """The start of every store key of ``namespace``'s pages under this tier's setup,
        ``radixkv:<setup>:<namespace>:``: an operator forgets one tenant's pages on the store
        (``SCAN MATCH <prefix>*``, then ``DEL``) without touching any other's."""
        ns = _page_checksum(b"radixkv.shared.namespace", _namespace_bytes(namespace))
        return b"radixkv:" + self.setup[:16].hex().encode() + b":" + ns[:16].hex().encode() + b":"

    def _keys_of(self, hashes: Sequence[bytes], namespace: Any) -> list[bytes]:
        head = self.key_prefix(namespace)
        return [head + h.hex().encode() for h in hashes]

    def encode(self, store_key: bytes, payload: np.ndarray) -> bytes:
        """The value stored for ``payload`` under ``store_key``: header, then payload."""
        return self._codec.encode(store_key, payload)

    def decode(self, store_key: bytes, value: bytes | None) -> np.ndarray | None:
        """The payload of ``value`` read under ``store_key``, or None unless its header names
        this key and setup, its length is a page's and its checksum (or MAC) holds."""
        return self._codec.decode(store_key, value)

    # ---- reads ----------------------------------------------------------------------------

    def poll(self, tokens: Sequence[int] | np.ndarray, namespace: Any = None) -> tuple[int, bool]:
        """Installs what came back of the fetch of ``tokens``' pages past what the local tiers
        hold, or starts that fetch (on the reader thread; see the module docstring); never
        calls the store. Returns ``(tokens installed now, whether the fetch is still out and
        younger than`` :attr:`hold_s` ``)``: the engine holds such a request out of admission.
        A failing store or a full pool installs nothing; nothing unchecked is ever written
        into a pool, and nothing this tier does fails the request (an unexpected error is
        counted in ``errors``, warned about once, and taken as a miss)."""
        try:
            return self._poll(tokens, namespace)
        except Exception as e:
            self._state.unexpected("reading", e)
            return 0, False

    def prefetch(
        self, tokens: Sequence[int] | np.ndarray, namespace: Any = None, wait_s: float = 0.0
    ) -> int:
        """:meth:`poll`, waiting up to ``wait_s`` seconds for a fetch it started or found out
        (then installing what came back); returns the tokens installed."""
        n, out = self.poll(tokens, namespace)
        deadline = time.monotonic() + wait_s
        while out and time.monotonic() < deadline:
            self.wait(deadline - time.monotonic())
            more, out = self.poll(tokens, namespace)
            n += more
        return n

    def wait(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` seconds for a fetch to come back (at once if one is back
        and not installed)."""
        with self._state.fetched:
            if any(lk.done for lk in self._lookups.values()):
                return
            self._state.fetched.wait(max(0.0, timeout_s))

    @property
    def fetching(self) -> int:
        """Fetches out (not back yet)."""
        return sum(not lk.done for lk in list(self._lookups.values()))

    def _poll(self, tokens: Sequence[int] | np.ndarray, namespace: Any) -> tuple[int, bool]:
        if isinstance(namespace, str) and namespace.startswith(PRIVATE_NAMESPACE):
            return 0, False
        cache, p = self.kv.cache, self.page_size
        tokens = np.asarray(tokens)
        end = (len(tokens) - 1) // p  # the last token is always computed
        if end <= 0:
            return 0, False
        first = cache.match_prefix(tokens, namespace) // p
        if first >= end:
            return 0, False
        keys = self.store_keys(tokens, namespace, first, end)
        ident = keys[-1]  # the chained hash of the whole prefix: one fetch per prefix
        lookup = self._lookups.get(ident)
        if lookup is not None:
            with self._state.lock:
                done = lookup.done
            if not done:
                return 0, time.monotonic() - lookup.started < self.hold_s
            del self._lookups[ident]
            if not lookup.payloads:
                return 0, False
            # Pages past a shorter local match than the fetch's are recomputed (none lost).
            n = self._enter(tokens, namespace, lookup.first, lookup.payloads, lookup.keys)
            return n, False
        if self._state.is_missing(keys[0]) or not self.breaker.ready():
            return 0, False
        if len(self._lookups) >= MAX_LOOKUPS:
            self._drop_oldest()
        lookup = _Lookup(keys, first)
        self._lookups[ident] = lookup
        self._reads.put(lookup)
        return 0, True

    def _drop_oldest(self) -> None:
        """Forgets the oldest fetches that came back (or, were none back, the oldest ones)."""
        with self._state.lock:
            done = [k for k, lk in self._lookups.items() if lk.done]
        for k in done or list(self._lookups)[: MAX_LOOKUPS // 4]:
            del self._lookups[k]

    def _enter(
        self,
        tokens: np.ndarray,
        namespace: Any,
        first: int,
        payloads: list[np.ndarray],
        keys: list[bytes],
    ) -> int:
        """Admits ``tokens`` up to the fetched pages, writes them into the request's pages,
        commits and finishes it: the pages are published as computed ones are."""
        p, cache, kv = self.page_size, self.kv.cache, self.kv
        end = first + len(payloads)
        try:
            req = cache.admit(tokens[: end * p], namespace)
        except radixkv.OutOfPages:
            return 0  # no room now: the request computes them
        try:
            cached = req.num_cached // p
            if cached < first:  # the local tiers lost pages since the match: leave it
                cache.abort(req)
                return 0
            kv.apply_copies()  # the admission's own copies (offloads of reused pages) first
            pages = req.pages.tolist()
            for i in range(cached, end):
                scatter_payload(kv, payloads[i - first], kv.k, kv.v, pages[i])
            cache.commit(req, end * p)
            cache.finish(req)
        except BaseException:
            if not req.closed:
                cache.abort(req)
            raise
        n = max(0, end - cached)
        self._state.add("hit_pages", n)
        self._state.add("hit_tokens", n * p)
        self._state.remember(keys[: len(payloads)])
        return n * p

    # ---- writes ---------------------------------------------------------------------------

    def publish(
        self,
        requests: Sequence[radixkv.Request],
        starts: Sequence[int],
        ends: Sequence[int],
    ) -> int:
        """Queues for the store the pages a step completed: of each request, the full pages
        ending in ``starts[i]+1..ends[i]`` (its tokens computed by the step), copied out of
        the pool now; pages the store is known to hold are skipped. Returns how many were
        queued. Never raises (the writer counts what the store fails; an unexpected error
        here is counted in ``errors`` and warned about once)."""
        try:
            return self._publish(requests, starts, ends)
        except Exception as e:
            self._state.unexpected("writing", e)
            return 0

    def _publish(
        self,
        requests: Sequence[radixkv.Request],
        starts: Sequence[int],
        ends: Sequence[int],
    ) -> int:
        p, kv, state = self.page_size, self.kv, self._state
        keys: list[bytes] = []
        pages: list[int] = []
        metas: list[tuple[Any, ...] | None] = []
        for req, start, end in zip(requests, starts, ends):
            a, b = start // p, end // p
            if b <= a:
                continue
            namespace = req.namespace
            if isinstance(namespace, str) and namespace.startswith(PRIVATE_NAMESPACE):
                continue
            table = req.pages.tolist()
            tokens = req.tokens
            hashes = radixkv.block_hashes(tokens[: b * p], p, namespace)
            ns = None if namespace is None else _event_namespace(namespace)
            for i, k in zip(range(a, b), self._keys_of(hashes[a:b], namespace)):
                if not state.is_known(k):
                    keys.append(k)
                    pages.append(table[i])
                    metas.append(
                        (ns, hashes[i - 1] if i else None, hashes[i], tokens[i * p : (i + 1) * p])
                        if self._recording
                        else None
                    )
        if not keys:
            return 0
        with state.lock:  # what the queue has room for (the rest is dropped, counted)
            room = max(0, (MAX_QUEUED_BYTES - state.queued_bytes) // self.page_bytes)
            take = min(room, len(keys))
            state.queued_bytes += take * self.page_bytes
        if take < len(keys):
            state.add("dropped_pages", len(keys) - take)
        if take == 0:
            return 0
        # One gather on the pools' device and one copy to the host for the whole step; the
        # writer thread makes the values (header, checksum or MAC) and sends them.
        payloads = page_payloads(kv, kv.k, kv.v, pages[:take])
        for k, payload, meta in zip(keys, payloads, metas):
            self._queue.put((k, payload, meta))
        return take

    # ---- events -----------------------------------------------------------------------------

    def record_events(self, enabled: bool) -> None:
        """Turns on (or off) recording which pages this replica put in the store (or found
        there when it went to put them): :meth:`drain_events` hands them over. A router
        counts such a page as one every replica on the store can fetch
        (:class:`radixkv.events.ZmqPublisher` sends them with its ``shared_medium``)."""
        self._recording = bool(enabled)
        if not enabled:
            with self._state.lock:
                self._state.events.clear()

    def drain_events(self) -> list[tuple[Any, ...]]:
        """The events recorded since the last call, in the cache's format (``("stored",
        namespace, parent, keys, tokens)``: radixkv block keys, the key before the first or
        None, their tokens as a numpy array, the namespace as bytes or None), one per chained
        run of pages the store confirmed holding. The store may evict a page later without an
        event: a router's count is then an overestimate that a fetch's miss corrects (the
        request computes the page)."""
        with self._state.lock:
            out, self._state.events = self._state.events, []
        return out

    def flush(self) -> None:
        """Waits until every queued page was sent (or dropped)."""
        self._queue.join()

    # ---- state ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters: ``lookups`` (prefetches that asked the store), ``hit_pages`` and
        ``hit_tokens`` (fetched and entered), ``put_pages`` (sent), ``present_pages`` (the
        store held them already), ``dropped_pages`` (not sent: queue full, store failing),
        ``bad_pages`` (failed their check: dropped, recomputed), ``errors`` (failed store
        calls); ``breaker`` (its state) and ``breaker_trips``."""
        with self._state.lock:
            out: dict[str, Any] = dict(self._state.counts)
        out["breaker"] = self.breaker.state
        out["breaker_trips"] = self.breaker.trips
        return out

    def close(self) -> None:
        """Sends what is queued, stops the writer and the reader (after the fetch it is on, if
        any) and closes the store's connections."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
            reader, self._reader = self._reader, None
            if reader is not None:
                self._reads.put(None)
                reader.join()
            self._lookups.clear()
            self._state.store.close()

    def __repr__(self) -> str:
        return (
            f"SharedTier({redact(self.address)!r}, mac={self.mac!r}, "
            f"breaker={self.breaker.state!r})"
        )
