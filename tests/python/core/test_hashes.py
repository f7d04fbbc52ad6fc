"""``block_hashes`` follows the ``radixkv.block.v1`` spec of DESIGN.md byte for byte, and
``BlockCache`` hits exactly where those hashes agree.

The spec is recomputed here with the Python ``blake3`` package from explicitly assembled bytes:

    h_root = blake3(b"radixkv.block.v1" || le32(P) || u8(tag) || le32(len(ns)) || ns)
    h_i    = blake3_keyed(key=h_{i-1}, le32(t[i*P]) || ... || le32(t[i*P + P - 1]))

with ``tag`` 0 and ``ns`` empty for namespace None, tag 1 and the utf-8 / raw bytes otherwise.
"""

from __future__ import annotations

from typing import Any

import blake3
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import radixkv
from reference import ref_block_hashes

U32_MAX = 2**32 - 1


def le32(x: int) -> bytes:
    return x.to_bytes(4, "little")


def spec_hashes(tokens: list[int], page_size: int, namespace: Any) -> list[bytes]:
    """The spec, spelled out."""
    if namespace is None:
        tag, ns = 0, b""
    else:
        tag, ns = 1, namespace.encode("utf-8") if isinstance(namespace, str) else namespace
    h = blake3.blake3(
        b"radixkv.block.v1" + le32(page_size) + bytes([tag]) + le32(len(ns)) + ns
    ).digest()
    out = []
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        h = blake3.blake3(b"".join(le32(t) for t in page), key=h).digest()
        out.append(h)
    return out


def test_blake3_package_matches_the_official_test_vector():
    """The yardstick itself: BLAKE3's published digest of the empty input."""
    assert blake3.blake3(b"").hexdigest() == (
        "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
    )


@pytest.mark.parametrize("page_size", [1, 16, 100])
@pytest.mark.parametrize(
    "namespace", [None, "", b"", "tenant-a", b"tenant-a", "ünïcødé", b"\x00\xff"], ids=repr
)
def test_hashes_follow_the_spec(page_size, namespace):
    """Every page size and namespace kind, ids up to 2**32 - 1, a partial last page."""
    partial = 0 if page_size == 1 else page_size // 2 + 1  # a page of 1 cannot be partial
    n = 3 * page_size + partial
    tokens = [(U32_MAX - 7 * i) if i % 3 else i for i in range(n)]
    got = radixkv.block_hashes(tokens, page_size, namespace)
    want = spec_hashes(tokens, page_size, namespace)
    assert len(want) == 3
    assert got == want
    assert all(isinstance(h, bytes) and len(h) == 32 for h in got)
    assert ref_block_hashes(tokens, page_size, namespace) == want


def test_partial_last_page_has_no_hash():
    """Only full pages are hashed: extra tokens short of a page change nothing."""
    tokens = list(range(40))
    assert radixkv.block_hashes(tokens[:15], 16) == []
    full = radixkv.block_hashes(tokens[:32], 16)
    assert len(full) == 2
    for extra in range(33, 40):
        assert radixkv.block_hashes(tokens[:extra], 16) == full


def test_hash_chain_covers_the_whole_prefix():
    """A page's hash depends on every earlier page: change token 0, every hash changes."""
    tokens = list(range(64))
    a = radixkv.block_hashes(tokens, 16)
    b = radixkv.block_hashes([1, *tokens[1:]], 16)
    assert all(x != y for x, y in zip(a, b))
    # ...and not on later ones.
    c = radixkv.block_hashes([*tokens[:32], *([9] * 32)], 16)
    assert c[:2] == a[:2] and c[2:] != a[2:]


def test_namespace_rules():
    """str is its utf-8 bytes; None differs from the empty namespace; page size is keyed in."""
    t = list(range(32))
    assert radixkv.block_hashes(t, 16, "a") == radixkv.block_hashes(t, 16, b"a")
    assert radixkv.block_hashes(t, 16, "é") == radixkv.block_hashes(t, 16, "é".encode())
    assert radixkv.block_hashes(t, 16, "") == radixkv.block_hashes(t, 16, b"")
    assert radixkv.block_hashes(t, 16, None)[0] != radixkv.block_hashes(t, 16, "")[0]
    assert radixkv.block_hashes(t, 8, None)[1] != radixkv.block_hashes(t, 16, None)[0]


def test_tokens_near_the_top_of_the_range():
    """le32 of 2**32 - 1 and 2**31: the encoding must not wrap or sign-extend."""
    for top in ([U32_MAX] * 16, [2**31] * 16, [U32_MAX, 0] * 8):
        assert radixkv.block_hashes(top, 16) == spec_hashes(top, 16, None)
        arr = np.array(top, dtype=np.uint32)
        assert radixkv.block_hashes(arr, 16) == spec_hashes(top, 16, None)
    assert radixkv.block_hashes([U32_MAX] * 16, 16) != radixkv.block_hashes([0] * 16, 16)


namespaces = st.one_of(st.none(), st.text(max_size=4), st.binary(max_size=4))


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, U32_MAX), max_size=70),
    page_size=st.sampled_from([1, 2, 3, 5, 16, 33]),
    namespace=namespaces,
)
def test_hashes_follow_the_spec_for_any_input(tokens, page_size, namespace):
    """Random ids over the whole u32 range, odd page sizes, any str or bytes namespace."""
    assert radixkv.block_hashes(tokens, page_size, namespace) == spec_hashes(
        tokens, page_size, namespace
    )


def leading_equal(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(
    cached=st.lists(st.integers(0, 2), min_size=1, max_size=40),
    asked=st.lists(st.integers(0, 2), min_size=1, max_size=40),
    ns_cached=st.sampled_from([None, "a", b"a", ""]),
    ns_asked=st.sampled_from([None, "a", b"a", ""]),
    page_size=st.sampled_from([1, 2, 4]),
)
def test_block_cache_hits_iff_hashes_agree(cached, asked, ns_cached, ns_asked, page_size):
    """After caching one prompt, another hits exactly its leading pages whose hashes agree."""
    cache = radixkv.BlockCache(64, page_size)
    req = cache.admit(cached, ns_cached)
    cache.commit(req, len(cached))
    owner_pages = req.pages.tolist()
    cache.finish(req)
    published = radixkv.block_hashes(cached, page_size, ns_cached)
    wanted = radixkv.block_hashes(asked, page_size, ns_asked)
    limit_pages = (len(asked) - 1) // page_size
    expect = min(leading_equal(published, wanted), limit_pages) * page_size
    assert cache.match_prefix(asked, ns_asked) == expect
    hit = cache.admit(asked, ns_asked)
    assert hit.num_cached == expect
    assert hit.pages.tolist()[: expect // page_size] == owner_pages[: expect // page_size]
    cache.check()
