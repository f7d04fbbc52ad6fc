"""KV events in vLLM's wire format, for cluster routers (extra ``radixkv[events]``: pyzmq and
msgspec).

A cache records, once asked to (``cache.record_events(True)``; off by default, and free when
off), the blocks it publishes and evicts and its resets; ``cache.drain_events()`` hands them over
in order. :class:`ZmqPublisher` turns them into vLLM's ``KVEventBatch`` messages on a ZeroMQ PUB
socket, with vLLM's sequence numbers and replay socket, so a KV-aware router that consumes vLLM
workers (llm-d's KV-cache indexer, NVIDIA Dynamo's KV router) can consume a radixkv worker.

Wire format (as vLLM's ``ZmqEventPublisher``)::

    PUB frames:    [topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]
    KVEventBatch:  [ts, [event, ...], data_parallel_rank]
    BlockStored:   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
                    kv_cache_spec_sliding_window, prompt_cache_key]
    BlockRemoved:  ["BlockRemoved", block_hashes, medium(, group_idx)]
    AllBlocksCleared: ["AllBlocksCleared"]
    replay (ROUTER): request [b"", start_seq (8 bytes)] -> one [b"", seq, payload] per buffered
                     batch with seq >= start_seq, then [b"", seq = -1, b""]

That is msgspec's ``array_like`` layout (tagged arrays); ``layout="map"`` sends the same structs
as maps (``{"type": "BlockStored", "block_hashes": ...}``), the layout of vLLM versions whose
event structs are not ``array_like``. Block hashes are 32-byte ``bytes``, or with
``int_hashes=True`` the integer of their last 8 bytes (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_
HASHES``).

``block_hash="blake3"`` sends radixkv's own block keys (``radixkv.block_hashes``, whose
``algorithm`` names them the same way; ``"radixkv"``, the design's name for them, is the same
value); ``block_hash="sha256_cbor"`` sends vLLM's default block hashes, computed along
each published chain (see ``docs/EVENTS.md``), so an indexer that hashes prompts the vLLM way
finds radixkv's blocks. For a ``RadixCache`` a block is a ``page_size`` group of tokens along
a published path.

``prompt_cache_key`` (radixkv's own field, after vLLM's last; null unless told): blocks that a
request with a ``prompt_cache_key`` (OpenAI's routing hint) stores carry
:func:`prompt_cache_key_hash` of the key and the request's namespace, once the server tells
the publisher (:meth:`ZmqPublisher.hint`). A decoder of vLLM's layout ignores it: msgspec
drops the trailing elements of an ``array_like`` struct it does not declare, and the unknown
keys of a map (vLLM has added its fields at the end over versions, so its decoders take a
longer array). Hashed with the namespace, so the key never names a group of blocks across
tenants (nor shows the key's text, often a user or conversation id, to the event bus); a
router that knows a request's namespace computes the same value.

A cache with a sliding-window group (``window=``) publishes two KV cache groups, as vLLM's
hybrid KV cache manager does: every event says its group (``group_idx`` 0, ``kv_cache_spec_kind
"full_attention"``: the full pages; ``group_idx`` 1, ``"sliding_window"`` with
``kv_cache_spec_sliding_window``: the window pages, under the same block hashes). A prefix is a
hit where group 0 holds all its blocks and group 1 the blocks of its last window (see
``docs/SEMANTICS.md``, "Sliding-window layers"); a router that reads group 0 only overestimates
hits by the window cut. A cache without a window group sends no group fields, as before.

A cache with state slots (a hybrid model's recurrent-state snapshots) publishes two groups, as
vLLM's hybrid KV cache manager does for a Mamba or linear-attention model: ``group_idx`` 0,
``"full_attention"``: the attention pages; ``group_idx`` 1, ``"mamba"``: the snapshots. A
snapshot is one block of the mamba group, under the block hash of the page its prefix ends on
(the hash the attention group gave that page), stored when it becomes findable and removed when
it is evicted (its pages may stay). A prefix is a hit where group 0 holds all its blocks and
group 1 its last one: a router finds where a hybrid replica can resume (see ``docs/EVENTS.md``).
"""

import hashlib
import threading
import time
from collections import OrderedDict, deque
from typing import Any

try:
    import msgspec
    import zmq
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "radixkv.events needs pyzmq and msgspec: pip install 'radixkv[events]' "
        "(or pip install pyzmq msgspec)"
    ) from e

from radixkv._radixkv import _sha256_cbor_chain, _sha256_cbor_none_hash
from radixkv._radixkv import block_hashes as _block_hashes

__all__ = [
    "BLOCK_HASHES",
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEventBatch",
    "ZmqPublisher",
    "cbor_block_hash",
    "event_types",
    "prompt_cache_key_hash",
]

#: ``block_hash`` values: radixkv's blake3 block keys, vLLM's sha256_cbor block hashes (the
#: ``algorithm`` names of ``radixkv.block_hashes``).
BLOCK_HASHES = ("blake3", "sha256_cbor")
#: The name ``docs/DESIGN``'s contract gives ``block_hash="blake3"``: accepted as the same value.
BLAKE3_ALIAS = "radixkv"

#: Block hashes of the shared tier's blocks the publisher keeps for ``sha256_cbor`` chains.
SHARED_HASHES = 1 << 20
#: The KV cache groups of a cache with a window group, as vLLM numbers and names them:
#: ``(group_idx, kv_cache_spec_kind)`` of its full pages and of its window pages.
FULL_GROUP = (0, "full_attention")
WINDOW_GROUP = (1, "sliding_window")
#: The group of a cache with state slots' snapshots (its pages are in ``FULL_GROUP``), as vLLM
#: numbers and names a hybrid model's Mamba group.
STATE_GROUP = (1, "mamba")

#: Blocks whose ``prompt_cache_key`` the publisher keeps until they are stored (the oldest
#: dropped: a hint for blocks never stored costs a bounded amount).
HINTS = 1 << 20

#: The replay socket's end-of-stream sequence number.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def event_types(layout: str = "array") -> dict[str, type]:
    """vLLM's event structs (``KVEventBatch``, ``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``) for ``layout="array"`` (msgspec ``array_like``) or ``"map"``; a
    subscriber decodes with ``msgspec.msgpack.Decoder(types["KVEventBatch"])``."""
    if layout not in ("array", "map"):
        raise ValueError(f"layout must be 'array' or 'map', got {layout!r}")
    array_like = layout == "array"
    # The annotations below are evaluated here (this module does not postpone them), so each
    # layout's batch refers to its own event structs.

    class EventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):
        """Base class of the KV cache events."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        prompt_cache_key: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return {
        "KVEventBatch": KVEventBatch,
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
    }


_ARRAY = event_types("array")
KVEventBatch = _ARRAY["KVEventBatch"]
BlockStored = _ARRAY["BlockStored"]
BlockRemoved = _ARRAY["BlockRemoved"]
AllBlocksCleared = _ARRAY["AllBlocksCleared"]


# ---- vLLM's sha256_cbor, for the publisher's chains -------------------------------------------
# One implementation, the core's (radixkv.block_hashes(algorithm="sha256_cbor") uses it too).


def cbor_block_hash(parent: bytes, tokens: Any, salt: str | bytes | None = None) -> bytes:
    """vLLM's ``hash_block_tokens`` with ``sha256_cbor``:
    ``sha256(cbor([parent, [tokens...], [salt] or null]))`` in canonical CBOR."""
    toks = [int(t) for t in tokens]
    if not toks:
        raise ValueError("tokens must hold at least one token (vLLM hashes no empty block)")
    return _sha256_cbor_chain(parent, toks, len(toks), salt or None)[0]


def none_hash(seed: str) -> bytes:
    """vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=seed`` under ``sha256_cbor``."""
    return _sha256_cbor_none_hash(seed)


def prompt_cache_key_hash(key: str, namespace: str | bytes | None) -> str:
    """What a ``BlockStored`` event reports of a request's ``prompt_cache_key``: the hex
    ``sha256(b"radixkv.prompt_cache_key.v1" || u8(tag) || le32(len(ns)) || ns || utf-8 key)``
    with ``ns``, ``tag`` the request's namespace as the block hashes take it (tag 0 and no
    bytes for None, else 1 and its UTF-8 or raw bytes). Equal keys of two namespaces (two
    tenants) report two values."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str (a prompt_cache_key), got {type(key).__name__}")
    if namespace is None:
        tag, ns = b"\x00", b""
    elif isinstance(namespace, (str, bytes)):
        tag, ns = b"\x01", namespace.encode() if isinstance(namespace, str) else namespace
    else:
        raise TypeError(f"namespace must be None, a str or bytes, got {namespace!r}")
    h = hashlib.sha256(b"radixkv.prompt_cache_key.v1")
    h.update(tag + len(ns).to_bytes(4, "little") + ns + key.encode())
    return h.hexdigest()


# ---- the publisher ------------------------------------------------------------------------------


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to anything else."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


class ZmqPublisher:
    """Publishes a cache's KV events as vLLM's ``ZmqEventPublisher`` does.

    ``endpoint``: the PUB address (``tcp://*:5557`` binds; a host address connects, as in vLLM;
    ``bind`` overrides). ``replay_endpoint``: a ROUTER address for replay requests (always bound),
    or None. ``topic``: the first frame of every message. ``block_hash``: ``"blake3"`` (radixkv's
    block keys) or ``"sha256_cbor"`` (vLLM's), the names ``radixkv.block_hashes(algorithm=...)``
    uses; ``"radixkv"`` (the design's name) is the same as ``"blake3"`` and reads back as it.
    ``hash_seed``: vLLM's ``PYTHONHASHSEED`` for ``sha256_cbor`` (vLLM workers must run with
    the same value for hashes to match; with ``"blake3"``, whose keys take no seed, only the
    default ``"0"`` is accepted). ``buffer_steps``: batches kept for replay.
    ``data_parallel_rank`` (an int >= 0, or None), ``medium`` (a str such as vLLM's ``"GPU"``
    or ``"CPU"``, or None) and ``int_hashes`` (a bool) go into every batch as vLLM's
    ``KVEventBatch``/``BlockStored``/``BlockRemoved`` define them; ``hwm``: the PUB socket's
    high-water mark (an int >= 0, 0: no limit). Every argument is checked before anything is
    opened (``ValueError`` or ``TypeError`` naming it and the value).

    Creating it turns event recording on in ``cache`` (blocks cached before that are not
    announced). :meth:`publish` sends what the cache recorded since the last call as one batch;
    :meth:`close` sends the rest and closes the sockets. A background thread answers replay
    requests.
    """

    def __init__(
        self,
        cache: Any,
        endpoint: str = "tcp://*:5557",
        *,
        topic: str = "",
        block_hash: str = "blake3",
        replay_endpoint: str | None = None,
        data_parallel_rank: int | None = 0,
        medium: str | None = "GPU",
        hash_seed: str = "0",
        int_hashes: bool = False,
        layout: str = "array",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        bind: bool | None = None,
    ) -> None:
        if not hasattr(cache, "drain_events"):
            raise TypeError(
                f"cache must be a radixkv RadixCache or BlockCache, got {type(cache).__name__}"
            )
        if block_hash == BLAKE3_ALIAS:  # the design's name for it: accepted, read back as blake3
            block_hash = "blake3"
        if block_hash not in BLOCK_HASHES:
            raise ValueError(
                f"block_hash must be 'blake3' or 'sha256_cbor' (as radixkv.block_hashes' "
                f"algorithm), got {block_hash!r}"
            )
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(
                f"endpoint must be a ZeroMQ address like 'tcp://*:5557', got {endpoint!r}"
            )
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {topic!r}")
        if isinstance(buffer_steps, bool) or not isinstance(buffer_steps, int) or buffer_steps < 1:
            raise ValueError(f"buffer_steps must be a positive int, got {buffer_steps!r}")
        if not isinstance(hash_seed, str):
            raise TypeError(f"hash_seed must be a str (vLLM's PYTHONHASHSEED), got {hash_seed!r}")
        if block_hash == "blake3" and hash_seed != "0":
            raise ValueError(
                f"hash_seed={hash_seed!r} has no effect with block_hash='blake3' (radixkv's "
                "block keys take no seed): it seeds block_hash='sha256_cbor' only"
            )
        if data_parallel_rank is not None and (
            isinstance(data_parallel_rank, bool)
            or not isinstance(data_parallel_rank, int)
            or data_parallel_rank < 0
        ):
            raise ValueError(
                f"data_parallel_rank must be an int >= 0 or None, got {data_parallel_rank!r}"
            )
        if medium is not None and not isinstance(medium, str):
            raise ValueError(
                f"medium must be a str (as vLLM's, e.g. 'GPU' or 'CPU') or None, got {medium!r}"
            )
        if not isinstance(int_hashes, bool):
            raise ValueError(f"int_hashes must be a bool, got {int_hashes!r}")
        if isinstance(hwm, bool) or not isinstance(hwm, int) or hwm < 0:
            raise ValueError(f"hwm must be an int >= 0 (0: no limit), got {hwm!r}")
        if bind is not None and not isinstance(bind, bool):
            raise ValueError(f"bind must be a bool or None, got {bind!r}")
        if replay_endpoint is not None and (
            not isinstance(replay_endpoint, str) or "://" not in replay_endpoint
        ):
            raise ValueError(
                "replay_endpoint must be a ZeroMQ address like 'tcp://*:5558' or None, got "
                f"{replay_endpoint!r}"
            )
        types = event_types(layout)
        self._stored, self._removed = types["BlockStored"], types["BlockRemoved"]
        self._cleared, self._batch = types["AllBlocksCleared"], types["KVEventBatch"]
        self.cache, self.block_hash, self.medium = cache, block_hash, medium
        self.data_parallel_rank, self.int_hashes = data_parallel_rank, int_hashes
        self.page_size = cache.page_size
        #: The cache's sliding window in tokens (0: no window group, no group fields sent).
        self.window = int(getattr(cache, "window", 0) or 0)
        #: Whether the cache keeps recurrent-state snapshots (a second group, ``STATE_GROUP``).
        self.states = int(getattr(cache.stats, "state_slots", 0) or 0) > 0
        self._topic = topic.encode()
        self._none_hash = none_hash(hash_seed)
        # radixkv key -> sha256_cbor hash of every block announced and not removed, per group.
        self._sha: dict[bytes, bytes] = {}
        self._wsha: dict[bytes, bytes] = {}
        #: The same for the snapshots announced and not removed (by the key of their page).
        self._msha: dict[bytes, bytes] = {}
        #: The same for the shared tier's blocks (never removed: bounded, oldest dropped).
        self._ssha: OrderedDict[bytes, bytes] = OrderedDict()
        #: radixkv block key -> the reported ``prompt_cache_key`` of the request that will store
        #: it (see :meth:`hint`), until it is stored; bounded, oldest dropped.
        self._hints: OrderedDict[bytes, str] = OrderedDict()
        #: The shared tier whose pages are announced too (see :meth:`announce_shared`).
        self.shared: Any = None
        self.shared_medium = "SHARED"
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 1000)
        if bind if bind is not None else _binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = None
        self._replay = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(
                target=self._serve_replay, name="radixkv-replay", daemon=True
            )
            self._thread.start()
        cache.record_events(True)
        self.closed = False

    def announce_shared(self, shared: Any, medium: str = "SHARED") -> None:
        """Also announces the pages ``shared`` (a ``KVCache``'s shared tier, ``kv.shared``)
        put in its store (or found there), as ``BlockStored`` with ``medium`` (a str). Every
        replica on that store can fetch them, so a prefix-aware router may count them for any
        of its replicas (a fetch costs less than computing, more than a device hit). The store
        evicts without events: a router's count may run ahead of it, and a fetch that misses
        computes the page. Turns recording on in ``shared``."""
        if not isinstance(medium, str) or not medium:
            raise ValueError(f"medium must be a non-empty str such as 'SHARED', got {medium!r}")
        if not hasattr(shared, "drain_events") or not hasattr(shared, "record_events"):
            raise TypeError(
                f"shared must be a KVCache's shared tier (kv.shared), got {type(shared).__name__}"
            )
        self.shared, self.shared_medium = shared, medium
        shared.record_events(True)

    def hint(self, tokens: Any, namespace: str | bytes | None, key: str) -> int:
        """Reports ``key``, the ``prompt_cache_key`` of a request about to run on ``tokens``
        (its prompt) in ``namespace``, with the blocks of that prompt the cache stores from
        now on: their ``BlockStored`` events carry :func:`prompt_cache_key_hash` of ``key`` and
        ``namespace`` (blocks cached already were announced before and are not again; those of
        the reply are not hinted). Call it before the step that computes the prompt, on the
        thread that calls :meth:`publish`. Returns how many blocks it hints."""
        value = prompt_cache_key_hash(key, namespace)
        cached = int(self.cache.match_prefix(tokens, namespace)) if len(tokens) else 0
        keys = _block_hashes(tokens, self.page_size, namespace)[cached // self.page_size :]
        for k in keys:
            self._hints.setdefault(k, value)  # the first request to ask stores it first
        while len(self._hints) > HINTS:
            self._hints.popitem(last=False)
        return len(keys)

    # ---- events -> vLLM structs ---------------------------------------------------------------

    def _ext(self, h: bytes) -> bytes | int:
        return int.from_bytes(h[-8:], "big") if self.int_hashes else h

    def _group(self, window: bool, state: bool = False) -> dict[str, Any]:
        """The group fields of an event of the full, the window or the state group (none for a
        cache with neither of the last two)."""
        if state:
            return {"group_idx": STATE_GROUP[0], "kv_cache_spec_kind": STATE_GROUP[1]}
        if not self.window:
            return (
                {"group_idx": FULL_GROUP[0], "kv_cache_spec_kind": FULL_GROUP[1]}
                if self.states
                else {}
            )
        idx, kind = WINDOW_GROUP if window else FULL_GROUP
        out: dict[str, Any] = {"group_idx": idx, "kv_cache_spec_kind": kind}
        if window:
            out["kv_cache_spec_sliding_window"] = self.window
        return out

    def _state_event(self, ev: tuple) -> Any:
        """The ``BlockStored`` of the state group for a ``state_stored`` event: one block, the
        page the snapshot ends on (None: that page was announced before recording began)."""
        _, ns, parent, keys, tokens = ev
        (key,) = keys
        if self.block_hash == "sha256_cbor":
            sha = self._sha.get(key)
            prev = None if parent is None else self._sha.get(parent)
            if sha is None or (parent is not None and prev is None):
                return None
            self._msha[key] = sha
            block, parent_out = sha, prev
        else:
            block, parent_out = key, parent
        extra = None
        if parent is None and ns:  # the first block carries the namespace (cache_salt)
            try:
                salt_key: str | bytes = ns.decode("utf-8")
            except UnicodeDecodeError:
                salt_key = ns
            extra = [(salt_key,)]
        return self._stored(
            block_hashes=[self._ext(block)],
            parent_block_hash=None if parent_out is None else self._ext(parent_out),
            token_ids=[int(t) for t in tokens],
            block_size=self.page_size,
            lora_id=None,
            medium=self.medium,
            lora_name=None,
            extra_keys=extra,
            **self._group(False, state=True),
        )

    def _stored_event(self, ev: tuple, window: bool, shared: bool = False) -> Any:
        """The ``BlockStored`` of a ``stored``/``window_stored`` event (None: a chain whose
        vLLM hashes cannot be known, below a block announced before recording began);
        ``shared``: an event of the shared tier (``shared_medium``)."""
        _, ns, parent, keys, tokens = ev
        tokens = [int(t) for t in tokens]
        hinted = None
        if self._hints and not shared:
            for k in keys:
                hinted = self._hints.pop(k, None) or hinted
        p = self.page_size
        sha_of = self._ssha if shared else self._wsha if window else self._sha
        extra = None
        if self.block_hash == "sha256_cbor":
            # A block's hash depends on its prefix only: a parent known in any group serves.
            prev = self._none_hash if parent is None else self._sha.get(parent)
            if prev is None:
                prev = self._wsha.get(parent)
            if prev is None:
                prev = self._ssha.get(parent)
            if prev is None:
                return None
            parent_out: bytes | None = None if parent is None else prev
            salt = ns if parent is None and ns else None
            hashes = _sha256_cbor_chain(prev, tokens[: len(keys) * p], p, salt)
            sha_of.update(zip(keys, hashes))
            if shared:
                while len(self._ssha) > SHARED_HASHES:
                    self._ssha.popitem(last=False)
        else:
            parent_out, hashes = parent, list(keys)
        if parent is None and ns:  # the namespace salts the first block (cache_salt)
            try:
                salt_key: str | bytes = ns.decode("utf-8")
            except UnicodeDecodeError:
                salt_key = ns
            extra = [(salt_key,)] + [None] * (len(keys) - 1)
        return self._stored(
            block_hashes=[self._ext(h) for h in hashes],
            parent_block_hash=None if parent_out is None else self._ext(parent_out),
            token_ids=tokens,
            block_size=p,
            lora_id=None,
            medium=self.shared_medium if shared else self.medium,
            lora_name=None,
            extra_keys=extra,
            **self._group(window),
            prompt_cache_key=hinted,
        )

    def _convert(self, raw: list[tuple]) -> list[Any]:
        out: list[Any] = []
        sha = self.block_hash == "sha256_cbor"
        for ev in raw:
            kind = ev[0]
            if kind in ("stored", "window_stored"):
                stored = self._stored_event(ev, kind == "window_stored")
                if stored is not None:
                    out.append(stored)
            elif kind in ("removed", "window_removed"):
                window = kind == "window_removed"
                keys = ev[1]
                if sha:
                    sha_of = self._wsha if window else self._sha
                    hashes = [sha_of.pop(k) for k in keys if k in sha_of]
                else:
                    hashes = list(keys)
                if hashes:
                    group = self._group(window)
                    idx = {"group_idx": group["group_idx"]} if group else {}
                    out.append(
                        self._removed(
                            block_hashes=[self._ext(h) for h in hashes], medium=self.medium, **idx
                        )
                    )
            elif kind == "state_stored":
                stored = self._state_event(ev)
                if stored is not None:
                    out.append(stored)
            elif kind == "state_removed":
                keys = ev[1]
                if sha:
                    hashes = [self._msha.pop(k) for k in keys if k in self._msha]
                else:
                    hashes = list(keys)
                if hashes:
                    out.append(
                        self._removed(
                            block_hashes=[self._ext(h) for h in hashes],
                            medium=self.medium,
                            group_idx=STATE_GROUP[0],
                        )
                    )
            elif kind == "cleared":
                self._sha.clear()
                self._wsha.clear()
                self._msha.clear()
                out.append(self._cleared())
            else:  # pragma: no cover - the core records only these
                raise ValueError(f"unknown cache event {kind!r}")
        return out

    # ---- sending ------------------------------------------------------------------------------

    def publish(self) -> int:
        """Sends the events the cache recorded since the last call as one ``KVEventBatch``
        (nothing when there are none); returns how many events it sent."""
        if self.closed:
            raise RuntimeError("publish on a closed ZmqPublisher")
        events = self._convert(self.cache.drain_events())
        if self.shared is not None:
            for ev in self.shared.drain_events():
                stored = self._stored_event(ev, False, shared=True)
                if stored is not None:
                    events.append(stored)
        if not events:
            return 0
        batch = self._batch(
            ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank
        )
        payload = self._encoder.encode(batch)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        return len(events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # not a replay request: [identity, b"", start_seq]
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                batches = [(s, b) for s, b in self._buffer if s >= first]
            for s, b in batches:
                self._replay.send_multipart((client, b"", s.to_bytes(8, "big"), b))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        """Sends what is left, stops the replay thread and closes the sockets; turns event
        recording off in the cache."""
        if self.closed:
            return
        self.publish()
        self.closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._pub.close()
        self.cache.record_events(False)

    def __enter__(self) -> "ZmqPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
