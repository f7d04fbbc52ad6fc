"""What ``radixkv serve`` was started with, as the app reads it (:class:`ServerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Seconds of ``keep_alive`` a request may ask for by default (``--max-keep-alive``): an hour,
#: what Anthropic's longest breakpoint TTL ("1h") asks for.
MAX_KEEP_ALIVE = 3600.0


@dataclass
class ServerConfig:
    """What ``radixkv serve`` was started with (for ``/v1/models``, the tenant header and the
    bound on ``keep_alive``).

    ``max_keep_alive``: the most seconds of ``keep_alive`` a request may ask for (more is a
    400); ``tenant_max_keep_alive``: that bound for the tenants named (values of the tenant
    header), in place of ``max_keep_alive``."""

    model_name: str = "radixkv"
    #: Every name a request's ``model`` may give (``model_name`` always among them; a request
    #: without ``model`` is served too); another is a 404, as OpenAI and vLLM answer.
    aliases: tuple[str, ...] = ()
    #: The most tokens of a request, prompt and ``max_tokens`` together (``--max-model-len``;
    #: None: no bound but the pool's).
    max_model_len: int | None = None
    #: ``--api-key``: the bearer token every request needs (401 without it), but those to
    #: ``open_paths``; None: no key.
    api_key: str | None = None
    open_paths: tuple[str, ...] = ("/health", "/metrics")
    tenant_header: str | None = None
    default_max_tokens: int = 256
    #: ``--tool-call-parser``: the format of the calls ``tool_choice="auto"`` parses out of the
    #: model's text (:data:`radixkv.apps.serve.tool_calls.PARSERS`); None: ``"auto"`` is a 400.
    tool_call_parser: str | None = "hermes"
    max_keep_alive: float = MAX_KEEP_ALIVE
    tenant_max_keep_alive: dict[str, float] = field(default_factory=dict)
    #: ``--max-stored-responses``, ``--max-stored-response-bytes``: the bounds of the stored
    #: responses of ``/v1/responses`` (:class:`radixkv.apps.serve.responses.Store`).
    max_stored_responses: int = 10_000
    max_stored_response_bytes: int = 256 * 2**20
