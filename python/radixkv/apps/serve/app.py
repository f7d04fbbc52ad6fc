"""An OpenAI-compatible HTTP server on a radixkv :class:`~radixkv.Engine`.

One process: the engine steps in a thread of its own
(:class:`~radixkv.apps.serve.engine_loop.EngineLoop`), an ASGI app (FastAPI, served by
uvicorn) in front of it. The routes here parse a request and hand it on: a completion to a
:class:`~radixkv.apps.serve.completion.Completion`, whose shapes are OpenAI's
(:mod:`radixkv.apps.serve.openai`); the agent APIs are rooms of their own
(:mod:`~radixkv.apps.serve.responses`, :mod:`~radixkv.apps.serve.messages`).

```text
  client ── HTTP ──> route ──> Completion ── closure ──> EngineLoop thread: submit / step
         <── JSON / server-sent events ── asyncio.Queue <── on_token events, finished Results
```

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI's request and
response shapes; ``usage.prompt_tokens_details.cached_tokens`` is the prefix cache's hit, as
vLLM reports it), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus),
``POST /flush_cache`` (SGLang's; vLLM's ``/reset_prefix_cache``).
A request's cache namespace is its tenant (the configured tenant header) and its
``cache_salt`` (vLLM's field) together: a salt subdivides a tenant's namespace and never leaves
it, so tenants never share KV (:func:`radixkv.apps.serve.prompt_cache.namespace_of`). A
request without a ``seed`` samples with a fresh one; ``keep_alive`` is bounded by the server
(``--max-keep-alive``, per tenant).
``n > 1`` choices branch from one prefilled prompt.
``response_format`` (``json_object``, ``json_schema``) and ``tools`` with ``tool_choice``
``"required"`` or a named function constrain the reply to a grammar, a tool call returned as
OpenAI's ``tool_calls`` (:mod:`radixkv.apps.serve.structured`; streamed whole at its end).
``tool_choice`` ``"auto"`` (the default when ``tools`` are sent) renders the tools through the
chat template and parses the model's calls out of its text (``--tool-call-parser``:
:mod:`radixkv.apps.serve.tool_calls`); text that may be a call is held back while streaming.
A full queue answers 429, a request that can never fit the pool or is malformed 400 with
OpenAI's error object naming the field; a client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from typing import Any

try:
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.responses import JSONResponse, Response
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from starlette.exceptions import HTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"radixkv serve needs FastAPI and uvicorn ({e}): pip install radixkv[serve]"
    ) from e

import radixkv
from radixkv.apps.serve import chat_prompt, messages, openai, responses, structured
from radixkv.apps.serve.completion import Completion, Server
from radixkv.apps.serve.config import MAX_KEEP_ALIVE, ServerConfig
from radixkv.apps.serve.engine_loop import HEARTBEAT_S, EngineLoop, Pending, QueueFull
from radixkv.apps.serve.openai import (
    MAX_TOP_LOGPROBS,
    TOOLS_NOT_RENDERED,
    ChatBody,
    CompletionBody,
    Refusal,
    TokenizeBody,
)
from radixkv.engine import DivergedError

#: The names this module served before its rooms were split out, importable from here still.
__all__ = [
    "HEARTBEAT_S",
    "MAX_KEEP_ALIVE",
    "MAX_TOP_LOGPROBS",
    "TOOLS_NOT_RENDERED",
    "ChatBody",
    "CompletionBody",
    "EngineLoop",
    "Pending",
    "QueueFull",
    "ServerConfig",
    "create_app",
]


def _key_matches(given: str, key: str) -> bool:
    """Whether the bearer token ``given`` (as the HTTP layer decoded it: each byte of the
    header one latin-1 character) is ``key`` (``--api-key``, sent as its UTF-8 bytes), in
    constant time. Bytes, since ``secrets.compare_digest`` refuses non-ASCII text: any key,
    any header, never a 500."""
    return secrets.compare_digest(given.encode("latin-1", "replace"), key.encode("utf-8"))


def create_app(
    loop: EngineLoop, tokenizer: Any, config: ServerConfig | None = None, registry: Any = None
) -> FastAPI:
    """The ASGI app over ``loop`` (started and stopped with the app's lifespan).
    ``tokenizer``: the model's transformers tokenizer (chat template, encoding).
    ``registry``: a ``prometheus_client`` registry for ``/metrics`` (None: made here with a
    :class:`radixkv.metrics.CacheCollector` when prometheus_client is installed)."""
    config = config or ServerConfig()
    if registry is None:
        registry = _registry(loop.engine, {"model_name": config.model_name})
    server = Server.of(loop, tokenizer, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not loop.alive:
            loop.start()
        yield
        # SIGTERM lands here after uvicorn stopped taking requests and drained the open ones.
        await asyncio.get_running_loop().run_in_executor(None, loop.stop)

    bearer = HTTPBearer(auto_error=False)

    async def authorize(
        request: Request,
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008
    ) -> None:
        """``--api-key``: a request without ``Authorization: Bearer KEY`` is a 401."""
        if config.api_key is None or request.url.path in config.open_paths:
            return
        given = credentials.credentials if credentials is not None else None
        given = given or request.headers.get("x-api-key")  # Anthropic's clients send this
        if given is None or not _key_matches(given, config.api_key):
            raise HTTPException(
                401,
                "a valid API key is needed: Authorization: Bearer KEY (--api-key)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    # The schema and its two pages are routes of the app's own (FastAPI adds its defaults
    # outside the app's dependencies), so that --api-key covers them as every other path.
    app = FastAPI(
        title="radixkv",
        lifespan=lifespan,
        dependencies=[Depends(authorize)],
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.renders_tools = server.renders_tools
    #: The registry ``/metrics`` serves (None: prometheus_client is missing; a 404).
    app.state.metrics = registry
    _schema_routes(app)
    _error_handlers(app)
    _server_routes(app, server, registry)
    _token_routes(app, server)
    _completion_routes(app, server)
    responses.register(app, server, registry)
    messages.register(app, server)
    return app


def _schema_routes(app: FastAPI) -> None:
    """The OpenAPI schema and its two pages."""

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def swagger_page() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="radixkv")

    @app.get("/redoc", include_in_schema=False)
    async def redoc_page() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title="radixkv")


def _error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's error object (Anthropic's on ``/v1/messages``)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        where = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(where) or None
        msg = err.get("msg", "invalid request")
        anthropic = request.url.path == "/v1/messages"  # Anthropic's error object there
        if err.get("type") == "json_invalid":
            if anthropic:
                return messages.error(400, f"the body is not valid JSON: {msg}")
            return openai.error(400, f"the body is not valid JSON: {msg}")
        if anthropic:
            return messages.error(400, f"{param}: {msg}" if param else msg)
        return openai.error(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        # FastAPI's own refusals (a body that is not UTF-8, an unknown path, a wrong method)
        # in OpenAI's error object rather than FastAPI's {"detail": ...}.
        message = str(exc.detail)
        if message == "There was an error parsing the body":
            message = "the body could not be read: it must be JSON in UTF-8"
        if request.url.path == "/v1/messages":  # Anthropic's error object there
            return messages.error(exc.status_code, message)
        return openai.error(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Refusal)
    async def refused(request: Request, exc: Refusal):
        return exc.response()

    @app.exception_handler(DivergedError)
    async def parted(request: Request, exc: DivergedError):
        # A call the engine thread failed unrun as the ranks parted (the request had not
        # reached the engine): a 500 with OpenAI's error object, as a request in flight gets.
        return openai.error(500, f"the engine failed: {exc!r}")


def _server_routes(app: FastAPI, server: Server, registry: Any) -> None:
    """The server's own: health, version, the cache's flush, the models, the metrics."""
    loop, config = server.loop, server.config
    created = int(time.time())

    @app.get("/health")
    async def health():
        if not loop.alive:
            return openai.error(503, "the engine thread is not running", kind="server_error")
        late = loop.overdue()
        if late is not None:
            return openai.error(503, late, kind="server_error")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": radixkv.__version__}

    async def flush_cache():
        """SGLang's ``/flush_cache`` (vLLM's ``/reset_prefix_cache``): drops every page no
        running request holds (retained ones too) from the pool, the host and the disk tier,
        on the engine thread between steps; answers how many."""
        flushed = await loop.call(loop.engine.reset_cache)
        return {"flushed_pages": flushed}

    app.post("/flush_cache")(flush_cache)
    app.post("/reset_prefix_cache")(flush_cache)

    @app.get("/v1/models")
    async def models():
        listed = [config.model_name, *(a for a in config.aliases if a != config.model_name)]
        cards = [
            {"id": n, "object": "model", "created": created, "owned_by": "radixkv"} for n in listed
        ]
        return {"object": "list", "data": cards}

    @app.get("/metrics")
    async def metrics():
        if registry is None:
            return openai.error(404, "metrics need prometheus_client: pip install radixkv[metrics]")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        data = await asyncio.get_running_loop().run_in_executor(None, generate_latest, registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


def _token_routes(app: FastAPI, server: Server) -> None:
    """vLLM's ``/tokenize`` and ``/detokenize``."""
    tokenizer, config = server.tokenizer, server.config

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        """vLLM's ``/tokenize``: ``{"prompt": text}`` or ``{"messages": [...], "tools": [...]}``
        (rendered as chat renders them: :func:`chat_prompt.render`) to ``{"tokens", "count",
        "max_model_len"}`` (and ``warnings`` as chat gives them). An unknown ``model`` is a 404,
        as chat answers."""
        bad = openai.text_refusal(body) or openai.unknown_model(body.model, server.names)
        if bad is not None:
            raise bad
        if (body.messages is None) == (body.prompt is None):
            raise Refusal(400, "prompt: give a string prompt or messages, one of them", "prompt")
        warnings: list[str] = []
        if body.prompt is not None:
            special = body.add_special_tokens is not False
            tokens = tokenizer.encode(body.prompt, add_special_tokens=special)
        elif body.add_special_tokens:
            raise Refusal(
                400,
                "add_special_tokens: applies to a prompt; messages are encoded as chat encodes "
                "them (their template writes the special tokens)",
                "add_special_tokens",
            )
        else:
            try:
                tokens, warnings = chat_prompt.render_body(tokenizer, body, server.renders_calls)
            except structured.BadRequest as e:
                raise Refusal(400, str(e), e.param) from None
        reply: dict[str, Any] = {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": config.max_model_len,
        }
        if warnings:
            reply["warnings"] = warnings
        return reply

    @app.post("/detokenize")
    async def detokenize(body: dict[str, Any]):
        """vLLM's ``/detokenize``: ``{"tokens": [ids]}`` to ``{"prompt": text}``."""
        tokens = body.get("tokens")
        vocab = len(tokenizer)
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            raise Refusal(400, f"tokens: must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode(tokens)}


def _completion_routes(app: FastAPI, server: Server) -> None:
    """OpenAI's ``/v1/chat/completions`` and ``/v1/completions``."""

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        return await Completion.chat(server, body, request).respond()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await Completion.text(server, body, request).respond()


def _registry(engine: radixkv.Engine, labels: dict[str, str] | None = None) -> Any:
    """A registry of ``engine``'s metrics with constant ``labels`` (vLLM's ``model_name``), or
    None without prometheus_client."""
    try:
        from prometheus_client import CollectorRegistry

        from radixkv.metrics import CacheCollector
    except ImportError:
        return None
    registry = CollectorRegistry()
    registry.register(CacheCollector(engine.cache, engine=engine, labels=labels))
    return registry
