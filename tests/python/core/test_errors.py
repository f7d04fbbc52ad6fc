"""Bad input and misuse: the documented error, a message naming the bad value, nothing changed.

Every failing call below is followed by ``check()`` and a comparison of ``stats``, the live
requests' page tables and what ``match_prefix`` finds with a snapshot taken before it. The last
part pins down the token inputs that are accepted: every integer buffer type gives the same
tokens.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import radixkv

KINDS = [("radix", 1), ("radix", 4), ("block", 4), ("block", 16)]


def new_cache(kind: str, page_size: int, num_pages: int = 32) -> Any:
    cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
    return cls(num_pages, page_size)


class World:
    """A cache with something in it: a finished (cached) prompt and a live request."""

    def __init__(self, kind: str, page_size: int, num_pages: int = 32):
        self.cache = new_cache(kind, page_size, num_pages)
        self.p = page_size
        self.cached_prompt = list(range(100, 100 + 4 * page_size))
        done = self.cache.admit(self.cached_prompt, "ns")
        self.cache.commit(done, len(self.cached_prompt))
        self.cache.finish(done)
        self.live = self.cache.admit(list(range(200, 200 + 2 * page_size)), "ns")
        self.cache.commit(self.live, page_size)
        self.probes = [
            ([*self.cached_prompt, 7], "ns"),
            ([*range(200, 200 + 2 * page_size), 7], "ns"),
        ]

    def snapshot(self) -> tuple:
        reqs = [
            (r.pages.tolist(), r.tokens.tolist(), r.num_cached, r.num_computed)
            for r in self.requests()
        ]
        found = [self.cache.match_prefix(t, ns) for t, ns in self.probes]
        return self.cache.stats.as_dict(), reqs, found

    def requests(self) -> list:
        return [self.live]

    def fails(self, exc: type, fn: Callable[[], Any], *names: str) -> str:
        """``fn()`` raises ``exc`` whose message holds every one of ``names``; nothing changed."""
        before = self.snapshot()
        with pytest.raises(exc) as info:
            fn()
        message = str(info.value)
        for name in names:
            assert name in message, f"{name!r} not in {message!r}"
        self.cache.check()
        assert self.snapshot() == before
        return message


@pytest.fixture(params=KINDS, ids=[f"{k}-p{p}" for k, p in KINDS])
def world(request) -> World:
    return World(*request.param)


# ---------------------------------------------------------------------------------------------
# Malformed tokens

BAD_IDS = [
    ([5, -1], "-1"),
    ([4294967296], "4294967296"),
    ([1, 2, 2**64], str(2**64)),
    (np.array([3, -3], dtype=np.int64), "-3"),
    (np.array([-128], dtype=np.int8), "-128"),
    (np.array([1, 2**32], dtype=np.uint64), "4294967296"),
    (np.array([1, 2**40], dtype=np.int64)[::-1], str(2**40)),
    (torch.tensor([1, -7]), "-7"),
]


@pytest.mark.parametrize("tokens,value", BAD_IDS, ids=lambda x: repr(x)[:40])
@pytest.mark.parametrize("call", ["admit", "match_prefix", "extend"])
def test_bad_token_id_is_a_value_error_naming_it(world, tokens, value, call):
    """Negative ids and ids >= 2**32 are refused with ValueError naming ``tokens`` and the id."""
    fn = {
        "admit": lambda: world.cache.admit(tokens),
        "match_prefix": lambda: world.cache.match_prefix(tokens),
        "extend": lambda: world.cache.extend(world.live, tokens),
    }[call]
    world.fails(ValueError, fn, "tokens", value)


EMPTY = [
    [],
    (),
    np.array([], dtype=np.int64),
    np.array([], dtype=np.uint32),
    torch.tensor([], dtype=torch.int64),
    array.array("q"),
]


@pytest.mark.parametrize("tokens", EMPTY, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize("call", ["admit", "match_prefix"])
def test_empty_prompt_is_a_value_error(world, tokens, call):
    """A prompt needs at least one token (there must be logits to sample from)."""
    world.fails(ValueError, lambda: getattr(world.cache, call)(tokens), "tokens", "empty")


FLOATS = [
    ([1.0, 2.0], "float"),
    ([1, 2.5], "float"),
    (np.array([1.0, 2.0]), "float64"),
    (np.array([1.0], dtype=np.float32), "float32"),
    (torch.tensor([1.0, 2.0]), "float32"),
]


@pytest.mark.parametrize("tokens,dtype", FLOATS, ids=lambda x: repr(x)[:30])
@pytest.mark.parametrize("call", ["admit", "match_prefix", "extend"])
def test_float_tokens_are_a_type_error_naming_the_type(world, tokens, dtype, call):
    """Floats are not token ids, even integral ones; the message names the float type."""
    fn = {
        "admit": lambda: world.cache.admit(tokens),
        "match_prefix": lambda: world.cache.match_prefix(tokens),
        "extend": lambda: world.cache.extend(world.live, tokens),
    }[call]
    message = world.fails(TypeError, fn, "tokens")
    np_str = np.dtype(dtype).str if dtype != "float" else "float"
    assert dtype in message or np_str in message, message


@pytest.mark.parametrize(
    "tokens",
    [np.ones((2, 3), dtype=np.int64), torch.ones((2, 3), dtype=torch.int64)],
    ids=["numpy", "torch"],
)
def test_two_dimensional_tokens_are_a_value_error_naming_the_shape(world, tokens):
    """Tokens are 1-D; the message names the shape given."""
    for fn in (lambda: world.cache.admit(tokens), lambda: world.cache.match_prefix(tokens)):
        world.fails(ValueError, fn, "tokens", "2, 3")


def test_nested_list_tokens_are_a_type_error(world):
    """A list of lists is not a list of ids; the message names the offending element's type."""
    world.fails(TypeError, lambda: world.cache.admit([[1, 2], [3, 4]]), "tokens", "list")


@pytest.mark.parametrize("text", ["hello world", "x"])
def test_str_tokens_are_a_type_error(world, text):
    """Text must be tokenized first: a str is refused, not read as code points or bytes."""
    world.fails(TypeError, lambda: world.cache.admit(text), "tokens", "str")
    world.fails(TypeError, lambda: world.cache.match_prefix(text), "tokens", "str")
    world.fails(TypeError, lambda: world.cache.extend(world.live, text), "tokens", "str")


@pytest.mark.parametrize("namespace,type_name", [(1, "int"), ([1], "list"), (1.5, "float")])
def test_wrong_namespace_type_is_a_type_error(world, namespace, type_name):
    """A namespace is None, str or bytes; the message names the type given."""
    tokens = world.cached_prompt
    world.fails(TypeError, lambda: world.cache.admit(tokens, namespace), "namespace", type_name)
    world.fails(
        TypeError, lambda: world.cache.match_prefix(tokens, namespace), "namespace", type_name
    )
    with pytest.raises(TypeError, match="namespace"):
        radixkv.block_hashes(tokens, world.p, namespace)


# ---------------------------------------------------------------------------------------------
# Closed and foreign requests


def request_calls(cache: Any, req: Any) -> dict[str, Callable[[], Any]]:
    """Every cache method that takes a request."""
    return {
        "extend": lambda: cache.extend(req, [1]),
        "commit": lambda: cache.commit(req, 0),
        "fork": lambda: cache.fork(req),
        "finish": lambda: cache.finish(req),
        "abort": lambda: cache.abort(req),
    }


@pytest.mark.parametrize("close", ["finish", "abort"])
def test_closed_request_is_refused_by_every_method(world, close):
    """After finish or abort, every method taking the request raises InvalidRequest."""
    req = world.cache.admit([*world.cached_prompt, 1, 2, 3], "ns")
    world.cache.commit(req, req.num_tokens)
    getattr(world.cache, close)(req)
    assert req.closed
    for name, call in request_calls(world.cache, req).items():
        message = world.fails(radixkv.InvalidRequest, call)
        assert "closed" in message, (name, message)
    assert isinstance(radixkv.InvalidRequest("x"), radixkv.Error)


@pytest.mark.parametrize("close", ["finish", "abort"])
def test_closed_request_attributes_raise_but_namespace_stays(world, close):
    """A closed request's page table is gone; reading it raises instead of showing stale ids."""
    req = world.cache.admit([1, 2, 3, 4, 5], b"tenant")
    getattr(world.cache, close)(req)
    for attr in ["num_tokens", "num_cached", "num_computed", "pages", "slots", "tokens"]:
        with pytest.raises(radixkv.InvalidRequest):
            getattr(req, attr)
    assert req.closed is True
    assert req.namespace == b"tenant"
    assert req.cache is world.cache


@pytest.mark.parametrize("other_kind", ["radix", "block"])
def test_request_of_another_cache_is_refused(world, other_kind):
    """A request of another cache (same kind or not) is refused; neither cache changes."""
    other = new_cache(other_kind, world.p)
    foreign = other.admit(list(range(3 * world.p)))
    other_before = other.stats
    for name, call in request_calls(world.cache, foreign).items():
        message = world.fails(radixkv.InvalidRequest, call)
        assert "another cache" in message, (name, message)
    assert other.stats == other_before
    assert not foreign.closed
    other.check()


# ---------------------------------------------------------------------------------------------
# Counts


def test_commit_beyond_num_tokens_is_a_value_error(world):
    """Committing more tokens than the request has is a ValueError naming the count."""
    n = world.live.num_tokens
    world.fails(
        ValueError, lambda: world.cache.commit(world.live, n + 1), "num_computed", str(n + 1)
    )


def test_commit_decreasing_is_a_value_error(world):
    """``num_computed`` is monotone: going back is refused, naming the current and new value."""
    done = world.live.num_computed
    assert done == world.p
    world.fails(
        ValueError, lambda: world.cache.commit(world.live, done - 1), "num_computed", str(done - 1)
    )


def test_commit_negative_or_non_int_is_refused(world):
    """A negative count is a ValueError, a float a TypeError; both name ``num_computed``."""
    world.fails(ValueError, lambda: world.cache.commit(world.live, -1), "num_computed", "-1")
    world.fails(TypeError, lambda: world.cache.commit(world.live, 2.0), "num_computed", "float")


def test_negative_evict_is_a_value_error(world):
    """``evict`` takes a non-negative int: -1 is a ValueError, a str a TypeError."""
    world.fails(ValueError, lambda: world.cache.evict(-1), "num_pages", "-1")
    world.fails(TypeError, lambda: world.cache.evict("3"), "num_pages", "str")


@pytest.mark.parametrize("cls", [radixkv.RadixCache, radixkv.BlockCache], ids=["radix", "block"])
@pytest.mark.parametrize(
    "kwargs,name,value",
    [
        ({"num_pages": 0}, "num_pages", "0"),
        ({"num_pages": -5}, "num_pages", "-5"),
        ({"num_pages": 8, "page_size": 0}, "page_size", "0"),
        ({"num_pages": 8, "page_size": -1}, "page_size", "-1"),
    ],
)
def test_bad_pool_arguments_are_value_errors(cls, kwargs, name, value):
    """An empty pool or empty pages cannot be built; the message names the argument and value."""
    with pytest.raises(ValueError) as info:
        cls(**kwargs)
    assert name in str(info.value) and value in str(info.value)


def test_block_hashes_page_size_zero_is_a_value_error():
    """``block_hashes`` refuses pages of no tokens, like the caches do."""
    with pytest.raises(ValueError, match="page_size"):
        radixkv.block_hashes([1, 2, 3], page_size=0)


HUGE = 10**20  # fits no machine integer


def test_commit_far_beyond_num_tokens_is_a_value_error(world):
    """However large, a count beyond num_tokens is the documented ValueError naming it."""
    world.fails(ValueError, lambda: world.cache.commit(world.live, HUGE), "num_computed", str(HUGE))


def test_evict_of_a_huge_count_evicts_everything_or_names_the_value(world):
    """``evict(k)`` evicts up to k pages; a k too large for the machine may instead be refused,
    but then as a malformed argument: ValueError/TypeError naming it, nothing changed."""
    evictable = world.cache.stats.evictable_pages
    before = world.snapshot()
    try:
        done = world.cache.evict(HUGE)
    except (ValueError, TypeError) as e:
        assert "num_pages" in str(e) and str(HUGE) in str(e), str(e)
        assert world.snapshot() == before
    else:
        assert done == evictable
        assert world.cache.stats.evictable_pages == 0
    world.cache.check()


@pytest.mark.parametrize("cls", [radixkv.RadixCache, radixkv.BlockCache], ids=["radix", "block"])
@pytest.mark.parametrize(
    "kwargs,name",
    [({"num_pages": HUGE}, "num_pages"), ({"num_pages": 8, "page_size": HUGE}, "page_size")],
    ids=["num_pages", "page_size"],
)
def test_huge_pool_arguments_are_refused_naming_them(cls, kwargs, name):
    """No pool of 10**20 pages (or pages of 10**20 tokens): ValueError/TypeError naming it."""
    with pytest.raises((ValueError, TypeError)) as info:
        cls(**kwargs)
    assert name in str(info.value) and str(HUGE) in str(info.value), str(info.value)


def test_block_hashes_huge_page_size_is_refused_naming_it():
    """A page size no machine integer holds is a malformed argument, named in the message."""
    with pytest.raises((ValueError, TypeError)) as info:
        radixkv.block_hashes([1, 2, 3], page_size=HUGE)
    assert "page_size" in str(info.value) and str(HUGE) in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------------
# OutOfPages changes nothing


def pool_world(kind: str, page_size: int) -> World:
    """A pool of 8 pages: 4 evictable (the cached prompt), 2 used by the live request, 2 free."""
    w = World(kind, page_size, num_pages=8)
    s = w.cache.stats
    assert (s.evictable_pages, s.used_pages, s.free_pages) == (4, 2, 2)
    return w


@pytest.mark.parametrize("kind,page_size", KINDS)
def test_out_of_pages_on_admit_changes_nothing(kind, page_size):
    """Needing one page more than free + evictable fails, and evicts nothing on the way."""
    w = pool_world(kind, page_size)
    s = w.cache.stats
    too_many = (s.free_pages + s.evictable_pages + 1) * page_size
    message = w.fails(radixkv.OutOfPages, lambda: w.cache.admit(list(range(5000, 5000 + too_many))))
    assert str(s.free_pages + s.evictable_pages + 1) in message
    # Exactly free + evictable pages fit (evicting every evictable page).
    req = w.cache.admit(list(range(5000, 5000 + too_many - page_size)))
    assert w.cache.stats.evicted_pages == s.evictable_pages
    w.cache.check()
    assert req.num_cached == 0


@pytest.mark.parametrize("kind,page_size", KINDS)
def test_out_of_pages_counts_the_pages_the_match_pins(kind, page_size):
    """The match's own evictable pages cannot be evicted to make room for the rest of it.

    The cached prompt holds 4 evictable pages. A prompt of its first 3 pages plus 4 pages of new
    tokens matches 3 pages and needs 4 new ones; free + evictable is 2 + 4 = 6, but 3 of those are
    the match's own pages, which admission pins: available is 3.
    """
    w = pool_world(kind, page_size)
    prompt = w.cached_prompt[: 4 * page_size] + list(range(7000, 7000 + 3 * page_size))
    matched = w.cache.match_prefix(prompt, "ns")
    assert matched == 4 * page_size
    prompt = prompt[: 3 * page_size] + list(range(7000, 7000 + 4 * page_size))
    assert w.cache.match_prefix(prompt, "ns") == 3 * page_size
    w.fails(radixkv.OutOfPages, lambda: w.cache.admit(prompt, "ns"))
    # One page less fits: 3 matched + 3 new pages, one evictable page evicted.
    ok = w.cache.admit(prompt[: 6 * page_size], "ns")
    assert ok.num_cached == 3 * page_size
    w.cache.check()


@pytest.mark.parametrize("kind,page_size", KINDS)
def test_out_of_pages_on_extend_leaves_the_request_unchanged(kind, page_size):
    """One token more than free + evictable pages hold fails, changing nothing; exactly that
    many fits."""
    w = pool_world(kind, page_size)
    s = w.cache.stats
    too_many = (s.free_pages + s.evictable_pages) * page_size + 1
    w.fails(radixkv.OutOfPages, lambda: w.cache.extend(w.live, [9] * too_many))
    w.cache.extend(w.live, [9] * (too_many - 1))
    assert w.live.num_tokens == 2 * page_size + too_many - 1
    w.cache.check()


@pytest.mark.parametrize("kind,page_size", KINDS)
def test_out_of_pages_on_fork_changes_nothing(kind, page_size):
    """A fork needs pages for everything its parent has not published; if they are missing
    nothing happens."""
    w = pool_world(kind, page_size)
    s = w.cache.stats
    # The live request has 1 of its 2 pages computed; grow it so its fork cannot fit.
    w.cache.extend(w.live, [3] * ((s.free_pages + s.evictable_pages - 1) * page_size))
    w.fails(radixkv.OutOfPages, lambda: w.cache.fork(w.live))
    assert w.cache.stats.queries == s.queries


# ---------------------------------------------------------------------------------------------
# Accepted token inputs

SMALL = [0, 1, 5, 127, 3, 64, 100, 7, 9, 11, 13, 126, 2, 4, 8, 16, 32]
INT_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]


def token_inputs(values: list[int]) -> dict[str, Any]:
    """The same ids in every accepted container (values must fit in int8)."""
    out: dict[str, Any] = {"list": list(values), "tuple": tuple(values)}
    for dt in INT_DTYPES:
        name = np.dtype(dt).name
        out[name] = np.array(values, dtype=dt)
        strided = np.zeros(2 * len(values), dtype=dt)
        strided[::2] = values
        out[f"{name}-strided"] = strided[::2]
        out[f"{name}-reversed"] = np.array(values[::-1], dtype=dt)[::-1]
    for dt in [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]:
        name = str(dt).removeprefix("torch.")
        out[f"torch-{name}"] = torch.tensor(values, dtype=dt)
        out[f"torch-{name}-strided"] = torch.tensor([v for v in values for _ in (0, 1)], dtype=dt)[
            ::2
        ]
    for name in ["uint16", "uint32", "uint64"]:  # unsigned tensors, where torch has them
        if hasattr(torch, name):
            out[f"torch-{name}"] = torch.tensor(values, dtype=getattr(torch, name))
    for code in "bBhHiIlLqQ":
        out[f"array-{code}"] = array.array(code, values)
    out["numpy-scalars"] = [np.int64(v) for v in values]
    return out


@pytest.mark.parametrize("kind,page_size", KINDS)
def test_every_integer_container_gives_the_same_tokens(kind, page_size):
    """Each container admits the same ids: same tokens, and it hits the pages the list cached."""
    cache = new_cache(kind, page_size, num_pages=64)
    first = cache.admit(SMALL)
    cache.commit(first, len(SMALL))
    cache.finish(first)
    expect = (len(SMALL) - 1) // page_size * page_size
    hashes = radixkv.block_hashes(SMALL, page_size)
    for name, tokens in token_inputs(SMALL).items():
        assert cache.match_prefix(tokens) == expect, name
        req = cache.admit(tokens)
        assert req.tokens.tolist() == SMALL, name
        assert req.num_cached == expect, name
        cache.extend(req, tokens)
        assert req.tokens.tolist() == SMALL + SMALL, name
        cache.abort(req)
        assert radixkv.block_hashes(tokens, page_size) == hashes, name
    cache.check()


@pytest.mark.parametrize("dtype", [">u2", ">i4", ">u8"])
def test_non_native_byte_order_arrays_are_accepted(dtype):
    """Big-endian arrays are integer arrays too ("any integer dtype"): same ids as native."""
    values = [1, 2, 300, 7]
    cache = radixkv.RadixCache(16)
    req = cache.admit(np.array(values, dtype=dtype))
    assert req.tokens.tolist() == values
    assert radixkv.block_hashes(np.array(values, dtype=dtype), 2) == radixkv.block_hashes(values, 2)


@pytest.mark.parametrize(
    "tokens",
    [
        np.array([2**32 - 1, 0, 2**31], dtype=np.uint32),
        np.array([2**32 - 1, 0, 2**31], dtype=np.int64),
        np.array([2**32 - 1, 0, 2**31], dtype=np.uint64),
        torch.tensor([2**32 - 1, 0, 2**31], dtype=torch.int64),
        array.array("Q", [2**32 - 1, 0, 2**31]),
        [2**32 - 1, 0, 2**31],
    ],
    ids=["uint32", "int64", "uint64", "torch-int64", "array-Q", "list"],
)
def test_largest_token_ids_are_accepted(tokens):
    """Ids up to 2**32 - 1 pass through every container without wrapping or sign errors."""
    cache = radixkv.RadixCache(8)
    req = cache.admit(tokens)
    assert req.tokens.tolist() == [2**32 - 1, 0, 2**31]


@pytest.mark.parametrize("kind,page_size", KINDS)
def test_request_arrays_have_the_documented_dtypes_and_slots(kind, page_size):
    """pages int32 with ceil(n/P) entries, slots int64 = pages[i//P]*P + i%P, tokens uint32."""
    cache = new_cache(kind, page_size)
    req = cache.admit(list(range(1, 2 * page_size + 2)))
    n = req.num_tokens
    assert req.pages.dtype == np.int32 and req.slots.dtype == np.int64
    assert req.tokens.dtype == np.uint32
    assert len(req.pages) == -(-n // page_size)
    expect = [int(req.pages[i // page_size]) * page_size + i % page_size for i in range(n)]
    assert req.slots.tolist() == expect
