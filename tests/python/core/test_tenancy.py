"""radixkv.tenant_namespace: no (configuration, tenant, salt) names another's namespace, the
salts a client can craft from other namespaces included."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv import tenant_namespace

texts = st.one_of(st.none(), st.text(max_size=12), st.sampled_from(["", "|", "|s-", ":", "A"]))


def _key(tenants: bool, tenant: str | None, salt: str | None):
    """What must decide the namespace: the configuration, and the tenant only with tenants."""
    return (tenants, tenant if tenants else None, salt)


@given(
    st.lists(st.tuples(st.booleans(), texts, texts), min_size=2, max_size=8),
)
def test_different_requests_never_share_a_namespace(requests):
    seen: dict[str | None, tuple] = {}
    for tenants, tenant, salt in requests:
        tenant = tenant if tenants else None
        ns = tenant_namespace(tenant, salt, tenants=tenants)
        key = _key(tenants, tenant, salt)
        if ns is None:  # the shared namespace: neither a tenant nor a salt, either way
            assert tenant is None and salt is None
            continue
        assert seen.setdefault(ns, key) == key, f"{key} and {seen[ns]} share {ns!r}"


@given(st.text(max_size=8), texts)
def test_a_salt_naming_a_tenants_namespace_gets_a_namespace_of_its_own(tenant, salt):
    """The attack: a client of a replica without tenants sends, as its salt, the namespace a
    tenant has on a replica with them (or the old ``json.dumps([tenant, salt])`` form)."""
    theirs = tenant_namespace(tenant, salt, tenants=True)
    for forged in (theirs, json.dumps([tenant, salt])):
        assert tenant_namespace(None, forged, tenants=False) != theirs
        assert tenant_namespace(None, forged, tenants=True) != theirs


def test_no_tenant_is_its_own_tag_and_nothing_is_shared():
    assert tenant_namespace(None, None, tenants=True) is None
    assert tenant_namespace(None, None, tenants=False) is None
    # The same salt with no tenant on a replica with tenants and on one without: apart.
    assert tenant_namespace(None, "x", tenants=True) != tenant_namespace(None, "x", tenants=False)
    # A tenant named "" is a tenant, not the absence of one.
    assert tenant_namespace("", None, tenants=True) != tenant_namespace(None, "", tenants=True)


def test_misuse_is_named():
    with pytest.raises(ValueError, match="tenant 'A' given, but tenants=False"):
        tenant_namespace("A", None, tenants=False)
    with pytest.raises(TypeError, match="got int"):
        tenant_namespace(None, 3, tenants=False)  # type: ignore[arg-type]
