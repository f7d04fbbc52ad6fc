"""Namespaces isolate KV: requests in different namespaces never share pages.

Every test is a pair: the same prompt re-admitted in the namespace that cached it hits (so
caching is on and the miss next to it means something), in the other namespace it misses.
``None`` is its own namespace; ``""`` and ``b""`` are one namespace, as are ``"a"`` and ``b"a"``
(a str is its utf-8 bytes).
"""

from __future__ import annotations

from typing import Any

import pytest

import radixkv

KINDS = [("radix", 1), ("radix", 4), ("block", 16)]


@pytest.fixture(params=KINDS, ids=[f"{k}-p{p}" for k, p in KINDS])
def make(request):
    kind, page_size = request.param

    def new() -> Any:
        cls = radixkv.RadixCache if kind == "radix" else radixkv.BlockCache
        return cls(64, page_size)

    return new


def prompt(page_size: int) -> list[int]:
    return list(range(500, 500 + 3 * page_size + 1))


def cache_prompt(cache: Any, tokens: list[int], namespace: Any) -> int:
    """Computes ``tokens`` in ``namespace`` and finishes; returns what a re-admission finds."""
    req = cache.admit(tokens, namespace)
    assert req.num_cached == 0
    cache.commit(req, len(tokens))
    cache.finish(req)
    p = cache.stats.page_size
    return (len(tokens) - 1) // p * p


def hits(cache: Any, tokens: list[int], namespace: Any) -> int:
    """``num_cached`` of a real admission (aborted at once), checked against match_prefix."""
    probe = cache.match_prefix(tokens, namespace)
    req = cache.admit(tokens, namespace)
    assert req.num_cached == probe
    assert req.namespace is namespace
    cache.abort(req)
    cache.check()
    return probe


SAME = [("a", b"a"), (b"a", "a"), ("", b""), (b"", ""), (None, None), ("ü", "ü".encode())]
DIFFERENT = [
    (None, ""),
    (None, b""),
    ("", None),
    ("a", "b"),
    ("a", b"b"),
    ("a", "A"),
    ("a", "a "),
    ("ü", "ü".encode("latin-1")),
    (None, "None"),
]


@pytest.mark.parametrize("cached_in,asked_in", SAME, ids=repr)
def test_equal_namespaces_share(make, cached_in, asked_in):
    """A str and the bytes of its utf-8 encoding are one namespace; None equals None."""
    cache = make()
    tokens = prompt(cache.stats.page_size)
    expect = cache_prompt(cache, tokens, cached_in)
    assert expect > 0
    assert hits(cache, tokens, cached_in) == expect
    assert hits(cache, tokens, asked_in) == expect


@pytest.mark.parametrize("cached_in,asked_in", DIFFERENT, ids=repr)
def test_different_namespaces_do_not_share(make, cached_in, asked_in):
    """None differs from "" and b""; distinct strings or bytes never share a page."""
    cache = make()
    tokens = prompt(cache.stats.page_size)
    expect = cache_prompt(cache, tokens, cached_in)
    assert hits(cache, tokens, cached_in) == expect > 0
    assert hits(cache, tokens, asked_in) == 0


def test_same_tokens_in_two_namespaces_get_separate_pages(make):
    """Both namespaces cache their own copy; each one's re-admission gets its own page ids."""
    cache = make()
    p = cache.stats.page_size
    tokens = prompt(p)
    owners = {}
    for ns in ["tenant-1", "tenant-2"]:
        req = cache.admit(tokens, ns)
        assert req.num_cached == 0
        cache.commit(req, len(tokens))
        owners[ns] = req.pages.tolist()
        cache.finish(req)
    # The full pages are published and stay cached; a partial last page is freed and reused.
    published = len(tokens) // p
    assert set(owners["tenant-1"][:published]).isdisjoint(owners["tenant-2"][:published])
    full = (len(tokens) - 1) // p
    for ns, pages in owners.items():
        req = cache.admit(tokens, ns)
        assert req.pages.tolist()[:full] == pages[:full]
        cache.abort(req)


def test_namespace_of_a_fork_is_its_parents(make):
    """A fork stays in its parent's namespace: it hits the parent's pages, not None's."""
    cache = make()
    p = cache.stats.page_size
    tokens = prompt(p)
    cache_prompt(cache, tokens, None)
    parent = cache.admit(tokens, b"x")
    assert parent.num_cached == 0
    cache.commit(parent, len(tokens))
    child = cache.fork(parent)
    assert child.namespace == b"x"
    full = (len(tokens) - 1) // p
    assert child.num_cached == full * p
    assert child.pages.tolist()[:full] == parent.pages.tolist()[:full]
    cache.check()


def test_reset_then_namespaces_still_isolated(make):
    """After reset nothing hits; re-caching in one namespace still leaves the other cold."""
    cache = make()
    tokens = prompt(cache.stats.page_size)
    cache_prompt(cache, tokens, "a")
    assert cache.reset() > 0
    assert hits(cache, tokens, "a") == 0
    expect = cache_prompt(cache, tokens, "a")
    assert hits(cache, tokens, b"a") == expect
    assert hits(cache, tokens, None) == 0
