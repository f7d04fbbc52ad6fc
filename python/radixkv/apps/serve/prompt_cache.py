"""OpenAI's prompt caching fields of a chat completion, in radixkv's retention terms.

- ``prompt_cache_retention``: ``"in_memory"`` (the default) is the cache's own LRU, what a
  request without ``keep_alive`` gets; ``"24h"`` is a ``keep_alive`` of 24 hours, which the
  server's bound on ``keep_alive`` (``--max-keep-alive``, per tenant) applies to: past it, a
  400 naming the field (the server never keeps less than it was asked without saying so).
- ``prompt_cache_key``: a routing hint OpenAI's router uses to send requests that share a prefix
  to one machine. radixkv accepts it and never makes it a cache namespace (that would let a
  key cross tenants): requests share KV by their prefix and namespace alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.apps.serve.app import ServerConfig

#: ``prompt_cache_retention``'s values.
Retention = Literal["in_memory", "24h"]

#: Seconds of ``keep_alive`` that ``prompt_cache_retention="24h"`` asks for.
EXTENDED_S = 24 * 3600.0


def keep_alive_bound(tenant: str | None, config: ServerConfig) -> float:
    """The most seconds of retention a request of ``tenant`` may ask for (``--max-keep-alive``)."""
    return config.tenant_max_keep_alive.get(tenant or "", config.max_keep_alive)


def tenant_of(request: Any, config: ServerConfig) -> str | None:
    """The request's tenant: its tenant header's value (None: no header configured, or none
    sent)."""
    return request.headers.get(config.tenant_header) if config.tenant_header else None


def apply(body: Any, request: Any, config: ServerConfig) -> str | None:
    """Sets ``body.keep_alive`` from ``body.prompt_cache_retention``; the message of a 400 when
    the server's bound refuses it."""
    if body.prompt_cache_retention != "24h":
        return None
    bound = keep_alive_bound(tenant_of(request, config), config)
    if EXTENDED_S > bound:
        return (
            f'prompt_cache_retention: "24h" asks for {EXTENDED_S:g} seconds of retention, past '
            f'this server\'s bound of {bound:g} (--max-keep-alive); send "in_memory" or a '
            "keep_alive within the bound"
        )
    body.keep_alive = max(body.keep_alive, EXTENDED_S)
    return None
