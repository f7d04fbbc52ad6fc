"""Cache namespaces of tenants: one encoding that no client input can forge.

A request's namespace decides whose pages it may read (:class:`radixkv.Cache`: requests in
different namespaces never share KV). A server that takes a tenant from a trusted header and a
``cache_salt`` from the request body must build the namespace so that no body, under any
server's configuration, names another tenant's namespace: replicas configured differently
(one with a tenant header, one without) may share one pool of pages (the shared tier, a disk
directory), so a salt sent to one must never equal a tenant's namespace on the other.

:func:`tenant_namespace` tags each part and prefixes its length::

    "radixkv.ns.v1" + ("|t" + len(tenant) + ":" + tenant  |  "|t-")   with tenants
                    + ("|s" + len(salt) + ":" + salt      |  "|s-")

Without tenants the ``t`` part is absent, so the two configurations never meet; with them a
request that names no tenant has its own tag (``|t-``), apart from every tenant's. A string of
this form reads back one way only, whatever the tenant and salt hold (lengths count code
points), so no salt can reproduce another pair. A request with neither tenant nor salt is in the
shared namespace, None, under either configuration (the pages nobody owns).
"""

from __future__ import annotations

__all__ = ["NAMESPACE_PREFIX", "tenant_namespace"]

#: The start of every namespace :func:`tenant_namespace` builds (the version of its encoding).
NAMESPACE_PREFIX = "radixkv.ns.v1"


def _part(tag: str, value: str | None) -> str:
    if value is None:
        return f"|{tag}-"
    if not isinstance(value, str):
        raise TypeError(f"a namespace part must be a str or None, got {type(value).__name__}")
    return f"|{tag}{len(value)}:{value}"


def tenant_namespace(tenant: str | None, salt: str | None, *, tenants: bool) -> str | None:
    """The cache namespace of a request of ``tenant`` (None: it names none) with ``cache_salt``
    ``salt`` (None: none), on a server that ``tenants`` (configured to take tenants, e.g. from
    a header; False: every request's ``tenant`` must be None). None, the shared namespace,
    when there is neither tenant nor salt; otherwise a str that no other
    ``(tenants, tenant, salt)`` gives (see the module docstring)."""
    if not tenants and tenant is not None:
        raise ValueError(f"tenant {tenant!r} given, but tenants=False")
    if tenant is None and salt is None:
        return None
    head = NAMESPACE_PREFIX + (_part("t", tenant) if tenants else "")
    return head + _part("s", salt)
