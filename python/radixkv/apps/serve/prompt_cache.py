"""OpenAI's prompt caching fields of a chat completion, in radixkv's retention terms.

- ``prompt_cache_retention``: ``"in_memory"`` (the default) is the cache's own LRU, what a
  request without ``keep_alive`` gets; ``"24h"`` is a ``keep_alive`` of 24 hours.
- One rule for every retention a request names (chat's ``"24h"``, Anthropic's breakpoint
  ``ttl`` ``"5m"``/``"1h"``, ``keep_alive``): honoured up to the server's bound
  (``--max-keep-alive``, per tenant), a 400 naming the field and the bound past it
  (:func:`past_bound`): the server never keeps less than it was asked without saying so.
- The namespace a request's prompt is cached in (:func:`namespace_of`): its tenant and its
  ``cache_salt``, so that requests share KV by their prefix and namespace alone.
- ``prompt_cache_key``: a routing hint OpenAI's router uses to send requests that share a prefix
  to one machine. radixkv never makes it a cache namespace (that would let a key cross
  tenants): requests share KV by their prefix and namespace alone. With ``--kv-events`` it is
  reported with the blocks the request's prompt stores, hashed with the request's namespace
  (:func:`radixkv.events.prompt_cache_key_hash`), so that a router can route by it.
"""

from __future__ import annotations

from typing import Any, Literal

from radixkv.tenancy import tenant_namespace

# ``config`` below: the server's ``radixkv.apps.serve.config.ServerConfig``.

#: ``prompt_cache_retention``'s values.
Retention = Literal["in_memory", "24h"]

#: Seconds of ``keep_alive`` that ``prompt_cache_retention="24h"`` asks for.
EXTENDED_S = 24 * 3600.0


def keep_alive_bound(tenant: str | None, config: Any) -> float:
    """The most seconds of retention a request of ``tenant`` may ask for (``--max-keep-alive``)."""
    return config.tenant_max_keep_alive.get(tenant or "", config.max_keep_alive)


def tenant_of(request: Any, config: Any) -> str | None:
    """The request's tenant: its tenant header's value (None: no header configured, or none
    sent)."""
    return request.headers.get(config.tenant_header) if config.tenant_header else None


def past_bound(value: str, seconds: float, tenant: str | None, config: Any) -> str | None:
    """Why a field's ``value``, which asks for ``seconds`` of retention, is a 400 (the field's
    name not included): it is past the bound of ``tenant``'s requests (``--max-keep-alive``).
    None when within it."""
    bound = keep_alive_bound(tenant, config)
    if seconds <= bound:
        return None
    return (
        f"{value!r} asks for {seconds:g} seconds of retention, past this server's bound of "
        f"{bound:g} seconds (--max-keep-alive)"
    )


def apply(body: Any, request: Any, config: Any) -> str | None:
    """Sets ``body.keep_alive`` from ``body.prompt_cache_retention``; the message of a 400 when
    the server's bound refuses it."""
    if body.prompt_cache_retention != "24h":
        return None
    refused = past_bound("24h", EXTENDED_S, tenant_of(request, config), config)
    if refused is not None:
        return f"prompt_cache_retention: {refused}; send 'in_memory' or a keep_alive within it"
    body.keep_alive = max(body.keep_alive, EXTENDED_S)
    return None


def namespace_of(tenant_header: str | None, tenant: str | None, salt: str | None) -> str | None:
    """A request's cache namespace: with a tenant header configured, its tenant (the header's
    value, None when absent) and its ``cache_salt`` together, so that a salt only subdivides
    its tenant's namespace; without one, the salt alone. Built by
    :func:`radixkv.tenancy.tenant_namespace`, so that no salt sent to a server of either
    configuration names another tenant's namespace on a server of the other (replicas sharing
    a store may be configured differently). None (the shared namespace) when there is
    neither."""
    return tenant_namespace(tenant if tenant_header else None, salt, tenants=bool(tenant_header))
