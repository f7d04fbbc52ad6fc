"""Type stubs of the native core (``radixkv._radixkv``)."""

from collections.abc import Sequence
from typing import Any, Literal, final, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

__all__ = [
    "COPY_LOAD",
    "COPY_OFFLOAD",
    "COPY_PERSIST",
    "COPY_SPILL",
    "COPY_WINDOW_LOAD",
    "COPY_WINDOW_OFFLOAD",
    "EVICTION_CLASSES",
    "BlockCache",
    "Cache",
    "CacheStats",
    "CorruptionError",
    "Error",
    "InvalidRequest",
    "OutOfPages",
    "RadixCache",
    "Request",
    "Scheduler",
    "StaleStepError",
    "StepPlan",
    "_page_checksum",
    "_sha256_cbor_chain",
    "_sha256_cbor_none_hash",
    "block_hashes",
    "plan_step",
]

_Tokens = Sequence[int] | npt.NDArray[np.integer[Any]] | Any
"""A sequence of ints, a 1-D integer numpy array, a 1-D CPU torch integer tensor, or any integer
buffer; every id in ``0 <= t < 2**32``."""
_Namespace = str | bytes | bytearray | None

class Error(Exception):
    """Base class of every radixkv error that is not a plain ValueError or TypeError."""

class OutOfPages(Error):
    """The pool cannot supply the pages a call needs, even after evicting every evictable page."""

class CorruptionError(Error):
    """check() found a broken internal invariant, or an internal error occurred."""

COPY_OFFLOAD: int
COPY_LOAD: int
COPY_SPILL: int
COPY_PERSIST: int
COPY_WINDOW_OFFLOAD: int
COPY_WINDOW_LOAD: int
#: Eviction classes of cached pages: ``finish(..., priority=0 .. EVICTION_CLASSES - 1)``.
EVICTION_CLASSES: int

class InvalidRequest(Error):
    """The request is closed (finished or aborted) or belongs to another cache."""

class StaleStepError(InvalidRequest):
    """A step was used after one of its requests was committed, extended, finished or aborted:
    plan a new step."""

@final
class CacheStats:
    """A snapshot of a cache's page states and hit counters."""

    @property
    def num_pages(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def free_pages(self) -> int: ...
    @property
    def evictable_pages(self) -> int: ...
    @property
    def used_pages(self) -> int: ...
    @property
    def queries(self) -> int: ...
    @property
    def query_tokens(self) -> int: ...
    @property
    def hit_tokens(self) -> int: ...
    @property
    def hit_rate(self) -> float: ...
    @property
    def evicted_pages(self) -> int: ...
    @property
    def host_pages(self) -> int: ...
    @property
    def host_free_pages(self) -> int: ...
    @property
    def host_hit_tokens(self) -> int: ...
    @property
    def offloaded_pages(self) -> int: ...
    @property
    def loaded_pages(self) -> int: ...
    @property
    def host_evicted_pages(self) -> int: ...
    @property
    def retentions(self) -> int: ...
    @property
    def forced_evictions(self) -> int: ...
    @property
    def expired_retentions(self) -> int: ...
    @property
    def disk_pages(self) -> int: ...
    @property
    def disk_free_pages(self) -> int: ...
    @property
    def disk_written_pages(self) -> int: ...
    @property
    def disk_fetched_pages(self) -> int: ...
    @property
    def disk_evicted_pages(self) -> int: ...
    @property
    def disk_bad_pages(self) -> int: ...
    @property
    def window(self) -> int: ...
    @property
    def window_pages(self) -> int: ...
    @property
    def window_free_pages(self) -> int: ...
    @property
    def window_evictable_pages(self) -> int: ...
    @property
    def window_cut_hits(self) -> int: ...
    @property
    def window_cut_tokens(self) -> int: ...
    @property
    def window_evicted_pages(self) -> int: ...
    @property
    def window_host_used_pages(self) -> int: ...
    @property
    def window_offloaded_pages(self) -> int: ...
    @property
    def window_loaded_pages(self) -> int: ...
    @property
    def state_slots(self) -> int:
        """State slots: snapshots of a hybrid model's recurrent state kept (0: none)."""
    @property
    def state_free_slots(self) -> int:
        """State slots holding nothing."""
    @property
    def state_pinned_slots(self) -> int:
        """State slots whose snapshot a live request's hit pins (not copied yet)."""
    @property
    def state_hit_tokens(self) -> int:
        """Of ``hit_tokens``, those whose hit ended at a snapshot."""
    @property
    def taken_states(self) -> int:
        """Snapshots taken so far (slots handed out by ``take_state``)."""
    @property
    def evicted_states(self) -> int:
        """Snapshots evicted so far: for their slot, or with a page they needed."""
    def as_dict(self) -> dict[str, float]: ...

@final
class Request:
    """A live request: its tokens, page table and how much of it is cached and computed.

    A request garbage-collected while open is aborted, with a ``ResourceWarning``."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    @property
    def num_computed(self) -> int: ...
    @property
    def pages(self) -> npt.NDArray[np.int32]: ...
    @property
    def window_pages(self) -> npt.NDArray[np.int32]:
        """With a window group: each page's window page, ``-1`` where released. Unlike
        ``pages`` it may change at a commit (released, or swapped for the page another request
        published first for the same prefix)."""
    @property
    def slots(self) -> npt.NDArray[np.int64]: ...
    @property
    def tokens(self) -> npt.NDArray[np.uint32]: ...
    @property
    def namespace(self) -> _Namespace: ...
    @property
    def closed(self) -> bool: ...
    @property
    def cache(self) -> Cache: ...
    @property
    def kv_matched(self) -> int:
        """With ``state_slots``: tokens the KV match ran to at admission (``num_cached`` or
        more: the hit ends at the last snapshot); ``num_cached`` without them."""
    @property
    def state_slot(self) -> int | None:
        """With ``state_slots``: the slot of the snapshot the hit ended at, pinned until
        ``cache.release_state(req)``; None with no hit, or once released."""

@disjoint_base
class Cache:
    """Common base of RadixCache and BlockCache."""

    def admit(self, tokens: _Tokens, namespace: _Namespace = None) -> Request: ...
    def extend(self, req: Request, tokens: _Tokens) -> None: ...
    def commit(self, req: Request, num_computed: int) -> None: ...
    def extend_many(self, requests: Sequence[Request], tokens: Sequence[_Tokens]) -> int:
        """Extends ``requests[i]`` by ``tokens[i]`` in order, in one call, and stops before the
        first request the pool cannot supply; returns how many were extended (that one and the
        rest are unchanged). A closed, foreign or repeated request, bad tokens or lengths that
        differ raise and change nothing."""

    def commit_many(self, requests: Sequence[Request], num_computed: Sequence[int]) -> None:
        """Commits ``requests[i]`` to ``num_computed[i]`` in one call; every pair is checked
        first (as ``commit`` checks it, requests distinct), all or nothing."""

    def fork(self, req: Request) -> Request: ...
    def truncate(self, req: Request, num_tokens: int) -> None:
        """Gives back ``req``'s tokens past ``num_tokens`` (from its ``num_computed`` to its
        ``num_tokens``) and frees the pages only they used: the draft tokens a speculative step
        rejected, never computed nor published (with a window group, their window pages too:
        truncate before committing up to ``num_tokens``; ``ValueError`` where a commit already
        released a window page the shorter request needs)."""

    def continuation(
        self, tokens: _Tokens, max_tokens: int, namespace: _Namespace = None
    ) -> npt.NDArray[np.uint32]:
        """Up to ``max_tokens`` tokens cached after ``tokens`` in ``namespace`` (never another
        namespace's): the continuation of the cached sequence ``tokens`` begins, the most
        recently used where several are (empty where none, and always for a ``BlockCache``).
        Changes nothing, LRU order included."""

    def finish(
        self, req: Request, *, retain: float = 0.0, priority: int | None = None
    ) -> int | None:
        """Publishes what is computed, unpins, frees what is not published, and closes ``req``.
        ``priority``: the eviction class (0 evicted first) its pages are raised to at least;
        ``retain``: seconds of the cache's clock its pages stay out of eviction while anything
        else can go (``math.inf``: until released). Returns the retention's id, or None."""
    def retain_prefix(
        self,
        tokens: _Tokens,
        namespace: _Namespace = None,
        *,
        retain: float = 0.0,
        priority: int | None = None,
    ) -> tuple[int | None, int]:
        """Retains the cached device prefix of ``tokens`` (whole pages) as ``finish`` retains
        a request's pages, without admitting it: no query or hit counted, nothing pinned, the
        LRU order unchanged. Returns ``(retention id or None, tokens held)``."""
    def release_retention(self, retention: int) -> bool: ...
    def advance(self, now: float) -> int: ...
    @property
    def now(self) -> float: ...
    def abort(self, req: Request) -> None: ...
    def match_prefix(self, tokens: _Tokens, namespace: _Namespace = None) -> int: ...
    def evict(self, num_pages: int) -> int: ...
    def reset(self) -> int: ...
    @overload
    def drain_copies(self, keys: Literal[False] = False) -> npt.NDArray[np.int32]:
        """The copies between the tiers decided since the last call, in order: int32 rows
        ``(kind, src, dst)``, kind ``COPY_OFFLOAD`` (device ``src`` to host ``dst``),
        ``COPY_LOAD`` (host ``src`` to device ``dst``), ``COPY_SPILL`` (host ``src`` to disk slot
        ``dst``) or ``COPY_PERSIST`` (device ``src`` to disk slot ``dst``), ids per tier; shape
        ``[N, 3]``. Empties the log. Perform them in order before the next computation on the
        pages they name, and before reading a disk slot they write."""

    @overload
    def drain_copies(self, keys: Literal[True]) -> tuple[npt.NDArray[np.int32], bytes]:
        """With ``keys=True``: ``(rows, keys)``, the 32-byte block key of each disk copy in
        order, concatenated."""

    @property
    def host_pages(self) -> int: ...
    @property
    def disk_pages(self) -> int: ...
    @property
    def window(self) -> int:
        """Tokens a sliding-window layer's query reads (0: no window group)."""
    @property
    def window_pages(self) -> int:
        """Pages of the window group's pool (0: none)."""
    @property
    def window_host_pages(self) -> int:
        """Pages of the window group's host tier (0: none)."""
    @property
    def window_chunk(self) -> int | None:
        """With a window group: the most tokens to append to one request in one step."""
    def disk_prefetch(
        self, tokens: _Tokens, namespace: _Namespace = None
    ) -> tuple[int, int, npt.NDArray[np.uint32], bytes, npt.NDArray[np.uint32]] | None:
        """Starts reading back from disk the pages of ``tokens`` past the device and host
        match: ``(id, from_token, slots, keys, host_pages)`` (read ``slots[i]``, which must hold
        the page whose block key is ``keys[32*i:32*i+32]``, into ``host_pages[i]``, then
        :meth:`disk_confirm`), or ``None`` when the disk holds none of them."""

    def disk_confirm(self, id: int, good: int, bad: bool = False) -> int:
        """Ends prefetch ``id``: its first ``good`` pages enter the cache as host pages; with
        ``bad``, page ``good`` read torn or corrupted and leaves the disk. Returns how many
        entered."""

    def disk_persist(self) -> int:
        """Logs a copy to disk of every cached page the disk lacks; returns how many."""

    def disk_entries(self) -> tuple[bytes, npt.NDArray[np.uint32]]:
        """The disk tier's ``(keys, slots)``, least recently used first (32-byte keys
        concatenated)."""

    def disk_restore(
        self, keys: bytes, slots: Sequence[int] | npt.NDArray[np.integer[Any]]
    ) -> None:
        """Fills the empty disk tier with entries saved by an earlier process."""
    @property
    def stats(self) -> CacheStats: ...
    def record_events(self, enabled: bool = True) -> None:
        """Turns recording of KV events (blocks published and evicted, resets) on or off; off
        (the default) costs nothing and drops what was not drained."""

    def drain_events(self) -> list[tuple[Any, ...]]:
        """The KV events recorded since the last call, in order: ``("stored", namespace,
        parent, keys, tokens)``, ``("removed", keys)`` and ``("cleared",)``; with a window
        group also ``("window_stored", namespace, parent, keys, tokens)`` and
        ``("window_removed", keys)`` (window pages entering and leaving the group); with state
        slots also ``("state_stored", namespace, parent, [key], tokens)`` and
        ``("state_removed", keys)`` (recurrent-state snapshots becoming findable, ending on the
        page of ``key``, and leaving)."""

    def check(self) -> None: ...
    def _panic_for_test(self) -> None:
        """Test hook: panics inside the core, as an internal error would; the cache is broken
        (every later call raises ``CorruptionError``) after it."""
    def state_digest(self) -> int:
        """A 64-bit digest of the decision-relevant state, equal for caches driven alike in any
        process whatever their per-cache keys; one pass over the index."""

    @property
    def num_pages(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def metadata_bytes(self) -> int: ...
    def take_state(self, req: Request, pos: int) -> int | None:
        """With ``state_slots``: a slot for ``req``'s recurrent state at token ``pos`` (a
        multiple of ``page_size``, at most ``num_tokens``), to copy the state into before the
        ``commit`` that covers ``pos``; the snapshot is findable from the first ``commit`` or
        ``finish`` that leaves its pages published, never before. None, changing nothing, when
        every slot is pinned or pending, when ``req`` took one at ``pos`` already, or when that
        prefix has a snapshot. ``ValueError`` naming ``pos``, or without state slots."""
    def release_state(self, req: Request) -> bool:
        """Unpins the snapshot ``req``'s hit ended at, once copied; False when none is
        pinned. ``finish`` and ``abort`` unpin it too."""
    def evict_state(self, slot: int) -> bool:
        """Evicts the snapshot in state slot ``slot`` (found damaged, or the owner's own
        policy); its pages stay cached. False, changing nothing, when the slot is free or its
        snapshot pending or pinned. ``ValueError`` naming ``slot`` past ``state_slots``."""
    def drain_freed_states(self) -> list[int]:
        """State slots freed since the last call (evicted, dropped with a page, or never
        published) and free still, each once, in the order freed."""

@final
class RadixCache(Cache):
    """A prefix cache indexed by a compressed radix tree over token ids."""

    def __new__(
        cls,
        num_pages: int,
        page_size: int = 1,
        host_pages: int = 0,
        disk_pages: int = 0,
        *,
        window: int = 0,
        window_pages: int = 0,
        window_host_pages: int | None = None,
        state_slots: int = 0,
    ) -> RadixCache: ...

@final
class BlockCache(Cache):
    """A prefix cache indexed by chained block hashes (full pages only)."""

    def __new__(
        cls,
        num_pages: int,
        page_size: int = 16,
        host_pages: int = 0,
        disk_pages: int = 0,
        *,
        window: int = 0,
        window_pages: int = 0,
        window_host_pages: int | None = None,
        state_slots: int = 0,
    ) -> BlockCache: ...

@final
class Scheduler:
    """A waiting queue that admits requests into a cache in a cache-aware order.

    ``policy``: ``"fcfs"`` (arrival order), ``"lpm"`` (longest cached prefix first) or
    ``"dfs-weight"`` (requests sharing a prefix back to back, heaviest group first).
    ``max_wait``: a request that has waited more than this many ``schedule`` calls goes ahead of
    cache order (``0`` turns the bound off). Higher ``priority`` goes first within every policy.

    In-batch prefix sharing (``"lpm"``, ``"dfs-weight"``): of waiting requests that share an
    uncached prefix of at least 64 tokens (one chunk: 64 rounded up to whole pages,
    ``radixkv.engine.defaults.sharing_threshold(page_size)``), one ``schedule`` call admits the
    first only; the others wait one call and find the prefix cached. A shorter shared prefix is
    computed by each.
    """

    def __new__(cls, cache: Cache, policy: str = "lpm", max_wait: int = 256) -> Scheduler: ...
    def add(
        self,
        tokens: _Tokens,
        namespace: _Namespace = None,
        priority: int = 0,
        max_new_tokens: int = 0,
    ) -> int:
        """Queues a prompt; returns its id (ids grow with arrival). Raises ``ValueError``
        (naming the token count, the pages needed and the pool size) for a request that could
        never fit the pool: ``ceil((len(tokens) + max(max_new_tokens, 1) - 1) / page_size) >
        num_pages``."""

    def check_fits(self, num_tokens: int, max_new_tokens: int, name: str = "a request") -> None:
        """``ValueError`` when such a request could never fit the pool (the rule of ``add``)."""
    def cancel(self, id: int) -> bool:
        """Drops a waiting request; returns whether it was waiting. ``ValueError`` naming ``id``
        when it is negative or beyond 64 bits."""

    def schedule(
        self, token_budget: int, max_requests: int | None = None
    ) -> list[tuple[int, Request]]:
        """Admits waiting requests in service order while ``token_budget`` (tokens to compute
        in this step), ``max_requests`` and the cache's pages last; returns ``(id, Request)``
        pairs in admission order. Each request is opened on its cached prefix plus at most what
        is left of the budget: one whose uncached part does not fit is admitted in part
        (``num_tokens < len(tokens)``), and the caller appends the rest with ``extend`` over
        later steps (chunked prefill). The sum of ``num_tokens - num_computed`` over one call
        is at most ``token_budget``. A call that admits nothing leaves the cache unchanged."""

    @property
    def waiting(self) -> list[int]: ...
    @property
    def wait_histogram(self) -> tuple[list[tuple[float, int]], int]:
        """How long the requests admitted so far waited, in ``schedule`` calls that passed them
        over: ``(upper_bound, count)`` pairs (counts not cumulative, the last bound ``inf``)
        and the sum of the waits."""

    @property
    def num_namespaces(self) -> int:
        """Namespaces the waiting requests use: the scheduler forgets a namespace as soon as no
        waiting request uses it."""

    @property
    def policy(self) -> str: ...
    def __len__(self) -> int: ...

def _sha256_cbor_chain(
    parent: bytes | None,
    tokens: _Tokens,
    page_size: int,
    salt: str | bytes | None = None,
    seed: str = "0",
) -> list[bytes]:
    """vLLM's ``sha256_cbor`` hashes of every full page of ``tokens``, chained from ``parent``
    (``NONE_HASH`` for ``seed`` when None), the first salted with ``salt``."""

def _page_checksum(key: bytes, data: npt.NDArray[np.uint8] | bytes) -> bytes:
    """The 32-byte checksum of a disk page: blake3 of its block key and its bytes."""

def _sha256_cbor_none_hash(seed: str) -> bytes:
    """vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=seed``."""

def block_hashes(
    tokens: _Tokens,
    page_size: int = 16,
    namespace: _Namespace = None,
    algorithm: str = "blake3",
    hash_seed: str = "0",
) -> list[bytes]:
    """Block hashes of every full page of ``tokens``, 32 bytes each: ``"blake3"``, the keys
    ``BlockCache`` uses; ``"sha256_cbor"``, vLLM's default block hashes (first block chained
    from vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=hash_seed``, salted with ``namespace``).
    ``hash_seed`` seeds ``sha256_cbor`` only: another seed with ``blake3`` raises ``ValueError``."""

@final
class StepPlan:
    """One planned step: numpy arrays (a fresh copy on every read) and ints.

    int64: ``input_ids``, ``positions``, ``write_slots`` ``[T]``, ``q_start`` ``[B+1]``,
    ``kv_len``, ``last_token_index`` ``[B]``. int32 page tables: ``block_table``
    ``[B, max_pages]`` (row ``b`` starts with request ``b``'s pages, padded with page 0),
    ``seq_lens`` ``[B]``, ``qo_indptr`` ``[B+1]``, ``paged_kv_indptr`` ``[B+1]``,
    ``paged_kv_indices``, ``paged_kv_last_page_len`` ``[B]`` (``1..page_size``)."""

    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def write_slots(self) -> npt.NDArray[np.int64]: ...
    @property
    def window_write_slots(self) -> npt.NDArray[np.int64]:
        """With a window group: each new token's slot in the window layers' pool."""
    @property
    def window_block_table(self) -> npt.NDArray[np.int32]:
        """With a window group: ``[B, max_pages]`` window pages (0 where released)."""
    @property
    def q_start(self) -> npt.NDArray[np.int64]: ...
    @property
    def kv_len(self) -> npt.NDArray[np.int64]: ...
    @property
    def last_token_index(self) -> npt.NDArray[np.int64]: ...
    @property
    def block_table(self) -> npt.NDArray[np.int32]: ...
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def qo_indptr(self) -> npt.NDArray[np.int32]: ...
    @property
    def paged_kv_indptr(self) -> npt.NDArray[np.int32]: ...
    @property
    def paged_kv_indices(self) -> npt.NDArray[np.int32]: ...
    @property
    def paged_kv_last_page_len(self) -> npt.NDArray[np.int32]: ...
    @property
    def longs(self) -> npt.NDArray[np.int64]:
        """``input_ids``, ``positions``, ``write_slots``, ``last_token_index``, ``kv_len``
        back to back, in one array."""
    @property
    def ints(self) -> npt.NDArray[np.int32]:
        """``block_table`` (row-major), ``seq_lens``, ``qo_indptr``, ``paged_kv_indptr``,
        ``paged_kv_last_page_len``, ``paged_kv_indices`` back to back, in one array."""
    @property
    def batch_size(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def max_pages(self) -> int: ...
    @property
    def max_kv_len(self) -> int: ...
    @property
    def max_q_len(self) -> int: ...
    def check_current(self) -> None:
        """Raises ``StaleStepError`` unless every request of the step is as it was planned:
        open, with the same ``num_computed`` and ``num_tokens``."""

def plan_step(requests: Sequence[Request], cache: Cache | None = None) -> StepPlan:
    """Plans one step over ``requests`` (each a ``Request`` of one cache, ``cache`` when given,
    each named once, each with tokens left to compute)."""
