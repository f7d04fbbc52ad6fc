"""An OpenAI-compatible HTTP server on a radixkv :class:`~radixkv.Engine`.

One process: the engine steps in a thread of its own (:class:`EngineLoop`), an ASGI app
(FastAPI, served by uvicorn) in front of it. Every engine call runs on the engine thread: the
app hands it closures through a queue and waits for their answers, so the engine is never used
from two threads. Tokens reach the app as they are sampled (the engine's ``on_token`` events,
moved onto the event loop with ``call_soon_threadsafe``).

```text
  client ── HTTP ──> FastAPI handler ── closure ──> EngineLoop thread: submit / cancel / step
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
import dataclasses
import json
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

try:
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from pydantic import BaseModel, ConfigDict, Field, StrictBool
    from starlette.exceptions import HTTPException
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"radixkv serve needs FastAPI and uvicorn ({e}): pip install radixkv[serve]"
    ) from e

import radixkv
from radixkv.apps.serve import (
    chat_prompt,
    messages,
    prompt_cache,
    request_fields,
    responses,
    structured,
    tool_calls,
)
from radixkv.apps.serve.token_bytes import token_bytes
from radixkv.engine import DivergedError, StreamEvent

# ---- the engine thread ------------------------------------------------------------------------


@dataclass
class Pending:
    """What the app waits for of one HTTP request: its engine ids (one per choice), the
    events of each as they come, and each one's final result."""

    loop: asyncio.AbstractEventLoop
    ids: list[int] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    results: dict[int, Any] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


class QueueFull(Exception):
    """More requests wait than the server's bound (answered 429)."""


#: Seconds an idle tensor-parallel engine goes without a step: rank 0 then steps an empty
#: one, so that the other ranks, waiting in the broadcast of its next step, never reach their
#: collectives' timeout, and a rank that died is found while nothing is asked.
HEARTBEAT_S = 5.0


class EngineLoop:
    """Owns ``engine`` and steps it on a thread of its own until :meth:`stop`.

    ``max_waiting``: sequences submitted and not yet finished at most (a request of ``n``
    choices over ``k`` prompts is ``n * k`` of them); a request that would pass it is refused
    with :class:`QueueFull`. Finished requests are released from the engine as soon as their results
    are handed over, so memory stays flat however long the server runs.

    A tensor-parallel engine (``Engine(group=...)``, rank 0) is stepped at once and then every
    ``heartbeat_s`` seconds when idle (None: never; the other ranks then time out in their
    collectives after the group's timeout). Once its ranks part (``radixkv.engine.DivergedError``:
    a rank died, stopped answering, or disagreed) it takes no more steps: every request in
    flight fails with the error (a final event with ``finish_reason="error"``, so a stream ends
    with OpenAI's error object), so does every call waiting for the thread or made later, the
    thread ends (``/health`` answers 503) and :attr:`on_fatal`'s callbacks get the error.

    ``overdue_s``: a step that has run for longer is overdue (:meth:`overdue`; ``/health``
    answers 503 while it lasts); None: never."""

    def __init__(
        self,
        engine: radixkv.Engine,
        max_waiting: int = 256,
        heartbeat_s: float | None = HEARTBEAT_S,
        overdue_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.overdue_s = overdue_s
        self.max_waiting = max_waiting
        # Each call with what fails it unrun (None: nobody waits for it).
        self._inbox: queue.Queue[tuple[Callable[[], None], Callable[[BaseException], None] | None]]
        self._inbox = queue.Queue()
        # Held while a call is queued and while the thread, ending, fails the calls left, so
        # that none is queued after that and never run.
        self._gate = threading.Lock()
        self._ended: BaseException | None = None  # why the thread ended, once it has
        self._pending: dict[int, Pending] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-engine", daemon=True)
        self.steps = 0
        #: ``time.monotonic()`` when the step now running began; None between steps.
        self.step_started: float | None = None
        self.error: BaseException | None = None
        #: Called on the engine thread after every step (a KV event publisher's ``publish``).
        self.after_step: list[Callable[[], Any]] = []
        #: Called on the engine thread when it wakes with nothing to step (at least every half
        #: second while idle): a KV event publisher's ``publish``, so that what changed outside
        #: a step (pages the shared tier stored, a flush) is announced without waiting for one.
        self.on_idle: list[Callable[[], Any]] = []
        #: Called on the engine thread with the error that parted a tensor-parallel engine's
        #: ranks, as the thread ends (``radixkv serve`` stops the server).
        self.on_fatal: list[Callable[[BaseException], Any]] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Finishes the requests in flight (up to ``timeout`` seconds), then ends the thread."""
        self._stop.set()
        self._inbox.put((lambda: None, None))  # wakes it
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def overdue(self) -> str | None:
        """Why the engine is late, if it is: the step now running has run for longer than
        ``overdue_s`` (a rank of a tensor-parallel engine stopped answering, say); else None."""
        started = self.step_started
        if self.overdue_s is None or started is None:
            return None
        took = time.monotonic() - started
        if took <= self.overdue_s:
            return None
        return (
            f"the engine's step has run for {took:.1f} s, more than {self.overdue_s:g} s: "
            "it is overdue"
        )

    def _queue(self, run: Callable[[], None], fail: Callable[[BaseException], None]) -> None:
        """Queues ``run`` for the engine thread, or calls ``fail`` with why it will never run."""
        with self._gate:
            ended = self._ended
            if ended is None and not self.alive:
                ended = radixkv.Error("the engine thread is not running")
            if ended is None:
                self._inbox.put((run, fail))
                return
        fail(ended)

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Runs ``fn()`` on the engine thread; a future (of the running event loop) for what it
        returns or raises."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                value = fn()
            except BaseException as e:  # handed to the caller
                loop.call_soon_threadsafe(_settle, fut, None, e)
            else:
                loop.call_soon_threadsafe(_settle, fut, value, None)

        def fail(error: BaseException) -> None:
            loop.call_soon_threadsafe(_settle, fut, None, error)

        self._queue(run, fail)
        return fut

    def call_blocking(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs ``fn()`` on the engine thread from any other thread and returns what it returns
        (raises what it raises)."""
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append((fn(), None))
            except BaseException as e:  # handed to the caller
                box.append((None, e))
            done.set()

        def fail(error: BaseException) -> None:
            box.append((None, error))
            done.set()

        self._queue(run, fail)
        if not done.wait(timeout):
            raise TimeoutError("the engine thread did not run the call in time")
        value, error = box[0]
        if error is not None:
            raise error
        return value

    def submit(
        self, pending: Pending, submit: Callable[[Callable], list[int]], sequences: int = 1
    ) -> None:
        """Engine thread: ``submit(on_token)`` makes the request's ``sequences`` sequences;
        their events and results go to ``pending``. Raises :class:`QueueFull` when they would
        take the sequences in flight past ``max_waiting``."""
        if len(self._pending) + sequences > self.max_waiting:
            raise QueueFull(
                f"{len(self._pending)} sequences are in flight and this request adds "
                f"{sequences}, past the server's bound (--max-waiting {self.max_waiting}): "
                "retry later"
            )
        loop = pending.loop

        def on_token(event: Any) -> None:
            loop.call_soon_threadsafe(pending.events.put_nowait, event)

        ids = submit(on_token)
        pending.ids = list(ids)
        for i in ids:
            self._pending[i] = pending

    def cancel(self, pending: Pending) -> None:
        """Engine thread: cancels every unfinished request of ``pending`` and forgets them."""
        for i in pending.ids:
            if self._pending.pop(i, None) is not None:
                self.engine.cancel(i)
        self.engine.forget_finished()

    def _run(self) -> None:
        fatal = None
        try:
            fatal = self._loop()
        finally:
            with self._gate:  # calls left, or queued as it ended, are failed, not lost
                self._ended = fatal or radixkv.Error("the engine thread stopped")
                while True:
                    try:
                        _, fail = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if fail is not None:
                        fail(self._ended)

    def _loop(self) -> BaseException | None:
        """Steps until stopped (None) or until the ranks part (the error that parted them)."""
        eng = self.engine
        heartbeat = self.heartbeat_s if eng.lockstep is not None else None
        last = -float("inf")  # the first heartbeat at once: the other ranks wait for it
        while True:
            block = not eng.has_work
            if block and self._stop.is_set() and not self._pending:
                return None
            try:
                fn, _ = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
                fn()
                while True:  # every call waiting, before the next step
                    self._inbox.get_nowait()[0]()
            except queue.Empty:
                pass
            due = heartbeat is not None and time.monotonic() - last >= heartbeat
            if not eng.has_work and not due:
                for hook in self.on_idle:
                    hook()
                continue
            self.step_started = time.monotonic()
            try:
                results = eng.step()
            except BaseException as e:  # a bug: every waiter is told, the server stays up
                self.error = e
                results = []
                for waiting in {id(p): p for p in self._pending.values()}.values():
                    waiting.loop.call_soon_threadsafe(_fail_pending, waiting, e)
                self._pending.clear()
                if isinstance(e, DivergedError):  # the ranks parted: no step can follow
                    for fatal in self.on_fatal:
                        fatal(e)
                    return e
            finally:
                self.step_started = None
            last = time.monotonic()
            self.steps += 1
            for r in results:
                pending = self._pending.pop(r.id, None)
                if pending is not None:
                    pending.loop.call_soon_threadsafe(_deliver, pending, r)
            if results:
                eng.forget_finished()  # every finished result was handed over above
            for hook in self.after_step:
                hook()


def _settle(fut: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


def _deliver(pending: Pending, result: Any) -> None:
    pending.results[result.id] = result
    if all(i in pending.results for i in pending.ids):
        pending.done.set()


def _fail_pending(pending: Pending, error: BaseException) -> None:
    """Every request of ``pending`` not finished yet fails with ``error``: its result, and a
    final event with ``finish_reason="error"`` (a stream then ends with the error object, not
    as if complete)."""
    for i in pending.ids:
        if i not in pending.results:
            pending.results[i] = error
            pending.events.put_nowait(StreamEvent(i, None, "", None, "error"))
    pending.done.set()


# ---- the request bodies -----------------------------------------------------------------------


#: The warning of a ``tool_choice="auto"`` request on a chat template that ignores ``tools``
#: (served, as vLLM serves it: the model answers without seeing the tools).
TOOLS_NOT_RENDERED = (
    "tools: this model's chat template does not render tools, so the model was not shown them; "
    "tool calls are still parsed out of its text"
)

#: The most ``top_logprobs`` (chat) or ``logprobs`` (completions) a request may ask for.
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    """Fields common to both endpoints. Unknown fields are kept in ``model_extra`` and ignored
    (clients send extras), except those :mod:`radixkv.apps.serve.request_fields` refuses; known ones
    of the wrong type or range are a 400 naming the field."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)  # 0 asks for nothing: a 400, as vLLM
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # [0.01, 1e4]: radixkv.engine.sampling's bounds (a logit is divided by it)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=1e4)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None
    # radixkv's own fields (OpenAI clients that do not send them are unaffected; the openai
    # client sends them with extra_body): seconds the request's pages stay retained in the
    # prefix cache after it finishes (an agent about to run a tool sends its next turn later),
    # and their eviction class (0 evicted first). See SEMANTICS.md, "Eviction classes".
    keep_alive: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    cache_priority: int = Field(default=0, ge=0, lt=radixkv.EVICTION_CLASSES)
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI's: token id (a string, as JSON keys are) -> a bias in [-100, 100] added to its
    # logit before sampling; the engine checks the ids against the vocabulary and the values.
    logit_bias: dict[str, Any] | None = None


class ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # vLLM's chat template fields: the last message continued rather than answered, the
    # assistant's turn opened or not, and keywords the template reads (enable_thinking, ...).
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # OpenAI's prompt caching fields (radixkv.apps.serve.prompt_cache)
    prompt_cache_key: str | None = None
    prompt_cache_retention: prompt_cache.Retention | None = None


class CompletionBody(_Body):
    #: One prompt (text or token ids) or a list of them: one choice per prompt, in order.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenizeBody(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (text), or chat ``messages`` with ``tools`` and chat's
    template fields, rendered as chat renders them. Booleans are JSON booleans (the string
    ``"false"`` is a 400, not true); other fields are ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    #: The tokenizer's special tokens (BOS) around a ``prompt`` (by default); ``messages`` are
    #: encoded as chat encodes them (their template writes its own), so true is refused there.
    add_special_tokens: StrictBool | None = None


def _error_body(status: int, message: str, param: str | None = None, kind: str | None = None):
    """OpenAI's error object, as a dict."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(
    status: int,
    message: str,
    param: str | None = None,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
):
    """OpenAI's error object, as a response."""
    body = _error_body(status, message, param, kind)
    return JSONResponse(body, status_code=status, headers=headers)


# ---- the app ----------------------------------------------------------------------------------


#: Seconds of ``keep_alive`` a request may ask for by default (``--max-keep-alive``).
MAX_KEEP_ALIVE = 300.0


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


def _key_matches(given: str, key: str) -> bool:
    """Whether the bearer token ``given`` (as the HTTP layer decoded it: each byte of the
    header one latin-1 character) is ``key`` (``--api-key``, sent as its UTF-8 bytes), in
    constant time. Bytes, since ``secrets.compare_digest`` refuses non-ASCII text: any key,
    any header, never a 500."""
    return secrets.compare_digest(given.encode("latin-1", "replace"), key.encode("utf-8"))


def _bad_text(value: Any, where: str) -> str | None:
    """The path of the first string in ``value`` (a request body, as parsed) that is not valid
    Unicode (a lone surrogate such as ``"\\ud800"``, which no tokenizer can encode), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        if isinstance(k, str) and _bad_text(k, where) is not None:
            return where or "body"
        bad = _bad_text(v, f"{where}.{k}" if where else str(k))
        if bad is not None:
            return bad
    return None


def _text_error(body: BaseModel) -> JSONResponse | None:
    """A 400 naming the field of ``body`` that holds a string that is not valid Unicode."""
    bad = _bad_text(body.model_dump(exclude_defaults=True), "")
    if bad is None:
        return None
    return _error(
        400,
        f"{bad}: not valid Unicode text (it holds a lone surrogate, such as \\ud800, that "
        "cannot be encoded as UTF-8)",
        bad,
    )


def create_app(
    loop: EngineLoop, tokenizer: Any, config: ServerConfig | None = None, registry: Any = None
) -> FastAPI:
    """The ASGI app over ``loop`` (started and stopped with the app's lifespan).
    ``tokenizer``: the model's transformers tokenizer (chat template, encoding).
    ``registry``: a ``prometheus_client`` registry for ``/metrics`` (None: made here with a
    :class:`radixkv.metrics.CacheCollector` when prometheus_client is installed)."""
    config = config or ServerConfig()
    eng = loop.engine
    if registry is None:
        registry = _registry(eng, {"model_name": config.model_name})
    created = int(time.time())
    renders_tools = tool_calls.template_renders_tools(tokenizer)
    renders_calls = chat_prompt.template_renders_calls(tokenizer)

    from contextlib import asynccontextmanager

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

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def swagger_page() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="radixkv")

    @app.get("/redoc", include_in_schema=False)
    async def redoc_page() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title="radixkv")

    app.state.renders_tools = renders_tools
    #: The registry ``/metrics`` serves (None: prometheus_client is missing; a 404).
    app.state.metrics = registry

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
            return _error(400, f"the body is not valid JSON: {msg}")
        if anthropic:
            return messages.error(400, f"{param}: {msg}" if param else msg)
        return _error(400, f"{param}: {msg}" if param else msg, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        # FastAPI's own refusals (a body that is not UTF-8, an unknown path, a wrong method)
        # in OpenAI's error object rather than FastAPI's {"detail": ...}.
        message = str(exc.detail)
        if message == "There was an error parsing the body":
            message = "the body could not be read: it must be JSON in UTF-8"
        if request.url.path == "/v1/messages":  # Anthropic's error object there
            return messages.error(exc.status_code, message)
        return _error(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(DivergedError)
    async def parted(request: Request, exc: DivergedError):
        # A call the engine thread failed unrun as the ranks parted (the request had not
        # reached the engine): a 500 with OpenAI's error object, as a request in flight gets.
        return _error(500, f"the engine failed: {exc!r}")

    @app.get("/health")
    async def health():
        if not loop.alive:
            return _error(503, "the engine thread is not running", kind="server_error")
        late = loop.overdue()
        if late is not None:
            return _error(503, late, kind="server_error")
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": radixkv.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        """vLLM's ``/tokenize``: ``{"prompt": text}`` or ``{"messages": [...], "tools": [...]}``
        (rendered as chat renders them: :func:`chat_prompt.render`) to ``{"tokens", "count",
        "max_model_len"}`` (and ``warnings`` as chat gives them). An unknown ``model`` is a 404,
        as chat answers."""
        bad = _text_error(body) or _unknown_model(body.model)
        if bad is not None:
            return bad
        if (body.messages is None) == (body.prompt is None):
            return _error(400, "prompt: give a string prompt or messages, one of them", "prompt")
        warnings: list[str] = []
        if body.prompt is not None:
            special = body.add_special_tokens is not False
            tokens = tokenizer.encode(body.prompt, add_special_tokens=special)
        elif body.add_special_tokens:
            return _error(
                400,
                "add_special_tokens: applies to a prompt; messages are encoded as chat encodes "
                "them (their template writes the special tokens)",
                "add_special_tokens",
            )
        else:
            try:
                tokens, warnings = chat_prompt.render(
                    tokenizer,
                    body.messages or [],
                    body.tools,
                    renders_calls=renders_calls,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    template_kwargs=body.chat_template_kwargs,
                )
            except structured.BadRequest as e:
                return _error(400, str(e), e.param)
        reply: dict[str, Any] = {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": config.max_model_len,
        }
        if warnings:
            reply["warnings"] = warnings
        return reply

    async def flush_cache():
        """SGLang's ``/flush_cache`` (vLLM's ``/reset_prefix_cache``): drops every page no
        running request holds (retained ones too) from the pool, the host and the disk tier,
        on the engine thread between steps; answers how many."""
        flushed = await loop.call(eng.reset_cache)
        return {"flushed_pages": flushed}

    app.post("/flush_cache")(flush_cache)
    app.post("/reset_prefix_cache")(flush_cache)

    @app.post("/detokenize")
    async def detokenize(body: dict[str, Any]):
        """vLLM's ``/detokenize``: ``{"tokens": [ids]}`` to ``{"prompt": text}``."""
        tokens = body.get("tokens")
        vocab = len(tokenizer)
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
        ):
            return _error(400, f"tokens: must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": tokenizer.decode(tokens)}

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
            return _error(404, "metrics need prometheus_client: pip install radixkv[metrics]")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        data = await asyncio.get_running_loop().run_in_executor(None, generate_latest, registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        bad = _text_error(body) or _refusal(body, chat=True)
        if bad is not None:
            return bad
        held = prompt_cache.apply(body, request, config)
        if held is not None:
            return _error(400, held, "prompt_cache_retention")
        # OpenAI's default tool_choice is "auto" when tools are sent: calls parsed out of text
        auto = bool(body.tools) and body.tool_choice in (None, "auto")
        parser, warnings = None, []
        if auto:
            if config.tool_call_parser is None:
                return _error(
                    400,
                    'tool_choice: "auto" needs the server started with --tool-call-parser '
                    '(hermes or llama3_json); send tool_choice "required" or a named function',
                    "tool_choice",
                )
            try:
                declared = structured.check_tools(body.tools)
            except structured.BadRequest as e:
                return _error(400, str(e), e.param)
            parallel = body.parallel_tool_calls is not False
            parser = tool_calls.Auto(config.tool_call_parser, declared, parallel)
            if not renders_tools:
                warnings.append(TOOLS_NOT_RENDERED)
        try:  # a tool call the request demands, else its response format, else free text
            grammar = structured.tool_grammar(body.tools, body.tool_choice)
            tool_call = grammar is not None
            if grammar is None:
                grammar = structured.response_grammar(body.response_format)
            prompt, rendered = chat_prompt.render(
                tokenizer,
                body.messages,
                body.tools,
                renders_calls=renders_calls,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
            )
        except structured.BadRequest as e:
            return _error(400, str(e), e.param)
        warnings += rendered
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else None
        if body.top_logprobs and not body.logprobs:
            return _error(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        return await _complete(
            request,
            body,
            [prompt],
            limit,
            chat=True,
            logprobs=body.logprobs,
            grammar=grammar,
            tool_call=tool_call,
            top_logprobs=body.top_logprobs or 0,
            parser=parser,
            warnings=warnings,
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        bad = _text_error(body) or _refusal(body, chat=False)
        if bad is not None:
            return bad
        # OpenAI's prompt: a string, token ids, or a list of either (one choice per prompt)
        given = body.prompt
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            return _error(400, "prompt: must hold at least one prompt", "prompt")
        prompts = [
            tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            for p in given
        ]
        for k, prompt in enumerate(prompts):
            if len(prompt) == 0:
                where = "prompt" if len(prompts) == 1 else f"prompt.{k}"
                return _error(400, f"{where}: must hold at least one token", where)
        try:
            grammar = structured.response_grammar(body.response_format)
        except structured.BadRequest as e:
            return _error(400, str(e), e.param)
        return await _complete(
            request,
            body,
            prompts,
            None,
            chat=False,
            logprobs=body.logprobs is not None,
            grammar=grammar,
            top_logprobs=body.logprobs or 0,
        )

    names = {config.model_name, *config.aliases}

    def _unknown_model(model: str | None) -> JSONResponse | None:
        """The 404 of a ``model`` this server does not serve (None: any request is served)."""
        if model is None or model in names:
            return None
        return JSONResponse(
            {
                "error": {
                    "message": f"The model `{model}` does not exist: this server "
                    f"serves {', '.join(repr(n) for n in sorted(names))}",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            },
            status_code=404,
        )

    def _refusal(body: _Body, chat: bool) -> JSONResponse | None:
        """The 404 of an unknown model, or the 400 of a field this server does not implement."""
        unknown = _unknown_model(body.model)
        if unknown is not None:
            return unknown
        bad = request_fields.refused(body.model_extra or {}, chat)
        if bad is not None:
            return _error(400, bad[1], bad[0])
        return None

    async def _complete(
        request,
        body,
        prompts,
        limit,
        chat: bool,
        logprobs: bool,
        grammar=None,
        tool_call=False,
        top_logprobs: int = 0,
        parser: tool_calls.Auto | None = None,
        warnings: list[str] | None = None,
    ):
        max_tokens = limit if limit is not None else body.max_tokens
        asked = max_tokens
        if max_tokens is None:
            max_tokens = config.default_max_tokens
        context = config.max_model_len
        prompt = max(prompts, key=len)  # the longest bounds the completion
        if context is not None:
            if asked is None:  # the default never asks past the context: cut to what is left
                max_tokens = max(min(max_tokens, context - len(prompt)), 0)
            if len(prompt) + max_tokens > context or len(prompt) >= context:
                where = "messages" if chat else "prompt"
                return _error(
                    400,
                    f"This model's maximum context length is {context} tokens (--max-model-len). "
                    f"However, you requested {len(prompt) + max_tokens} tokens "
                    f"({len(prompt)} in the {where}, {max_tokens} in the completion). Please "
                    f"reduce the length of the {where} or completion.",
                    where,
                )
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops):
            return _error(400, "stop: stop strings must not be empty", "stop")
        tenant = request.headers.get(config.tenant_header) if config.tenant_header else None
        namespace = prompt_cache.namespace_of(config.tenant_header, tenant, body.cache_salt)
        bound = config.tenant_max_keep_alive.get(tenant or "", config.max_keep_alive)
        if body.keep_alive > bound:
            who = f"tenant {tenant!r}" if tenant in config.tenant_max_keep_alive else "a request"
            return _error(
                400,
                f"keep_alive: at most {bound:g} seconds for {who} on this server "
                f"(--max-keep-alive), got {body.keep_alive:g}",
                "keep_alive",
            )
        bias = _logit_bias(body.logit_bias)
        if isinstance(bias, str):
            return _error(400, bias, "logit_bias")
        # No seed: a fresh one (as OpenAI and vLLM), so that unseeded samples differ; below
        # 2**62, so that every branch's seed + i stays in range.
        seed = body.seed if body.seed is not None else secrets.randbelow(2**62)
        params = dict(
            max_new_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            seed=seed,
            namespace=namespace,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            logit_bias=bias,
            stop_strings=stops,
            grammar=grammar,
            retain=body.keep_alive,
            cache_priority=body.cache_priority,
        )
        pending = Pending(asyncio.get_running_loop())
        n = body.n
        sequences = n * len(prompts)
        if sequences > loop.max_waiting:  # never served, however long it waits: not a 429
            where = "n" if len(prompts) == 1 else "prompt"
            return _error(
                400,
                f"{where}: this request asks for {sequences} sequences ({len(prompts)} "
                f"prompt(s) x n={n}), more than the server ever runs at once "
                f"(--max-waiting {loop.max_waiting})",
                where,
            )

        def submit(on_token: Callable) -> list[int]:
            ids: list[int] = []
            try:
                for p in prompts:  # choices in order: prompt by prompt, n of each
                    if n == 1:
                        ids.append(eng.submit(p, **params, on_token=on_token))
                    else:
                        ids += eng.branch(p, [[]] * n, **params, on_token=on_token)
            except BaseException:  # a later prompt refused: the earlier ones are not served
                for i in ids:
                    eng.cancel(i)
                eng.forget_finished()
                raise
            return ids

        cached = None
        if n > 1:  # the branches find the context cached by its own prefill: ask beforehand
            cached = loop.call(lambda: sum(_cached_now(eng, p, namespace) for p in prompts))
        try:
            await loop.call(lambda: loop.submit(pending, submit, sequences))
        except QueueFull as e:
            return _error(429, str(e), kind="rate_limit_error")
        except (ValueError, ImportError) as e:  # a knob out of range, a request the pool can
            # never hold, a schema that does not compile, no grammar library
            param = _param_of(str(e))
            if grammar is not None and str(e).startswith("grammar"):
                param = "tools" if tool_call else "response_format"
            return _error(400, str(e), param)
        cached_tokens = await cached if cached is not None else None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ids = pending.ids
        index = {i: k for k, i in enumerate(ids)}
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            gen = _stream(
                request,
                pending,
                index,
                rid,
                chat,
                include_usage,
                prompts,
                cached_tokens,
                tool_call,
                logprobs,
                top_logprobs,
                parser,
                warnings,
            )
            return StreamingResponse(gen, media_type="text/event-stream")
        waiter = asyncio.ensure_future(pending.done.wait())
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=0.25)
            if not waiter.done() and await request.is_disconnected():
                waiter.cancel()
                await loop.call(lambda: loop.cancel(pending))
                return Response(status_code=499)
        results = [pending.results[i] for i in ids]
        for r in results:
            if isinstance(r, BaseException):
                return _error(500, f"the engine failed: {r!r}")
            if r.finish_reason == "error":
                return _error(500, f"the request failed: {r.error!r}")
        choices = []
        for k, r in enumerate(results):
            choice: dict[str, Any] = {"index": k, "finish_reason": _finish(r.finish_reason)}
            text = r.text or ""
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                calls = structured.tool_calls(text) if tool_call else None
                if calls is not None and r.finish_reason == "stop":
                    choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                    choice["finish_reason"] = "tool_calls"
                if parser is not None:
                    content, calls = parser.parse(text)
                    if calls:
                        choice["message"] = {
                            "role": "assistant",
                            "content": content,
                            "tool_calls": calls,
                        }
                        choice["finish_reason"] = "tool_calls"
                if logprobs:
                    choice["logprobs"] = {"content": _logprob_entries(tokenizer, _scored(r))}
            else:
                choice["text"] = text
                choice["logprobs"] = (
                    _completion_logprobs(tokenizer, _scored(r), top_logprobs > 0)
                    if logprobs
                    else None
                )
            choices.append(choice)
        usage = _usage(prompts, results, cached_tokens)
        reply = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": config.model_name,
            "choices": choices,
            "usage": usage,
        }
        if warnings:
            reply["warnings"] = warnings
        return reply

    async def _stream(
        request,
        pending,
        index,
        rid,
        chat,
        include_usage,
        prompts,
        cached_tokens,
        tool_call=False,
        logprobs=False,
        top_logprobs=0,
        parser=None,
        warnings=None,
    ):
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body: dict[str, Any] = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": config.model_name,
                "choices": choices,
            }
            if include_usage:
                body["usage"] = usage
            if warnings and first:
                body["warnings"] = warnings
                first.clear()
            return f"data: {json.dumps(body)}\n\n"

        first = [True]  # the first chunk carries the warnings
        splitters = {k: parser.splitter() for k in range(len(index))} if parser else {}

        finished: set[int] = set()
        held: dict[int, str] = {}  # a tool call's text, sent whole as one delta at its end
        # Each choice's tokens and log-probabilities not yet sent: a token whose text is held
        # back (part of a character, of a possible stop string) goes with the next chunk.
        unsent: dict[int, list[Scored]] = {}

        def with_logprobs(k: int, choice: dict[str, Any]) -> dict[str, Any]:
            if logprobs:
                toks = unsent.pop(k, [])
                choice["logprobs"] = _chunk_logprobs(tokenizer, toks, chat, top_logprobs > 0)
            return choice

        try:
            if chat:
                yield chunk(
                    [
                        {
                            "index": k,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                        for k in range(len(index))
                    ]
                )
            while len(finished) < len(index):
                try:
                    ev = await asyncio.wait_for(pending.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError from None
                    if pending.done.is_set() and pending.events.empty():
                        break  # the engine failed: no more events come
                    continue
                k = index.get(ev.id)
                if k is None:
                    continue
                reason = _finish(ev.finish_reason) if ev.finish_reason else None
                if ev.finish_reason:
                    finished.add(ev.id)
                if logprobs and ev.token is not None and ev.logprob is not None:
                    unsent.setdefault(k, []).append((ev.token, ev.logprob, ev.top_logprobs))
                if ev.finish_reason == "error":  # OpenAI's error object, not a finish reason
                    await pending.done.wait()
                    r = pending.results.get(ev.id)
                    why = getattr(r, "error", None) if r is not None else None
                    message = f"the request failed: {why or r!r}"
                    yield f"data: {json.dumps(_error_body(500, message))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if tool_call:
                    held[k] = held.get(k, "") + ev.text
                    if reason is None:
                        continue
                    calls = structured.tool_calls(held[k]) if ev.finish_reason == "stop" else None
                    if calls is not None:
                        delta = {"tool_calls": [{"index": 0, **calls[0]}]}
                        choice = {"index": k, "delta": delta, "finish_reason": "tool_calls"}
                        yield chunk([with_logprobs(k, choice)])
                        continue
                    ev = dataclasses.replace(ev, text=held[k])  # cut short: sent as text
                elif parser is not None:
                    text = splitters[k].feed(ev.text)
                    if reason is not None:
                        content, calls = splitters[k].finish()
                        text += content or ""
                        if calls:
                            if text:
                                delta = {"content": text}
                                yield chunk([{"index": k, "delta": delta, "finish_reason": None}])
                            delta = {"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]}
                            choice = {"index": k, "delta": delta, "finish_reason": "tool_calls"}
                            yield chunk([with_logprobs(k, choice)])
                            continue
                    ev = dataclasses.replace(ev, text=text)
                if not ev.text and reason is None:
                    continue
                if chat:
                    delta = {"content": ev.text} if ev.text else {}
                    choice = {"index": k, "delta": delta, "finish_reason": reason}
                else:
                    choice = {"index": k, "text": ev.text, "finish_reason": reason}
                yield chunk([with_logprobs(k, choice)])
            await pending.done.wait()
            if include_usage:
                results = [pending.results[i] for i in pending.ids]
                ok = [r for r in results if not isinstance(r, BaseException)]
                yield chunk([], _usage(prompts, ok, cached_tokens))
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            if not pending.done.is_set():
                await asyncio.shield(loop.call(lambda: loop.cancel(pending)))
            raise

    # The agent APIs turn their requests into chat requests through the chat handler.
    app.state.chat, app.state.chat_body = chat, ChatBody
    responses.register(app, loop, config, registry)
    messages.register(app, loop, tokenizer, config)
    return app


def _cached_now(eng: radixkv.Engine, prompt: list[int], namespace: Any) -> int:
    """Prompt tokens the cache holds right now (engine thread)."""
    if not eng.prefix_caching:
        return 0
    return int(eng.cache.match_prefix(prompt, namespace))


def _usage(prompts: list[list[int]], results: list[Any], cached: int | None) -> dict[str, Any]:
    """OpenAI's ``usage`` of ``prompts`` (each counted once, whatever ``n``) and their
    ``results``; ``cached``: the prompts' cached tokens (None: the results', one per prompt)."""
    completion = sum(len(r.output) for r in results)
    if cached is None:
        cached = sum(r.cached_tokens for r in results)
    prompt = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(cached)},
    }


def _finish(reason: str) -> str:
    """The engine's finish reason in OpenAI's words."""
    return {"stop": "stop", "length": "length"}.get(reason, reason)


#: One output token as the server reports it: its id, its logprob, and its most likely
#: alternatives ``(token, logprob)`` with ``top_logprobs`` (else None).
Scored = tuple[int, float, list[tuple[int, float]] | None]


def _scored(r: Any) -> list[Scored]:
    """A result's output tokens with their logprobs and alternatives."""
    tops = r.top_logprobs or [None] * len(r.output)
    return list(zip(r.output, r.logprobs or [], tops))


def _token_entry(tokenizer: Any, tok: int, lp: float) -> dict[str, Any]:
    """One token of chat's ``logprobs``: its text, logprob, and its own UTF-8 bytes (a token
    holding part of a character has the text U+FFFD, but its bytes are its own)."""
    text = tokenizer.decode([tok])
    return {"token": text, "logprob": lp, "bytes": list(token_bytes(tokenizer, tok))}


def _logprob_entries(tokenizer: Any, toks: list[Scored]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries, each with its ``top_logprobs`` (OpenAI's shape)."""
    out = []
    for tok, lp, top in toks:
        entry = _token_entry(tokenizer, tok, lp)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, v) for t, v in top or []]
        out.append(entry)
    return out


def _completion_logprobs(tokenizer: Any, toks: list[Scored], with_top: bool) -> dict[str, Any]:
    """``/v1/completions``' ``logprobs``: tokens, their logprobs, and with ``logprobs=k > 0``
    each position's ``k`` most likely tokens as ``{text: logprob}`` (OpenAI's legacy shape)."""
    out: dict[str, Any] = {
        "tokens": [tokenizer.decode([t]) for t, _, _ in toks],
        "token_logprobs": [lp for _, lp, _ in toks],
    }
    if with_top:
        out["top_logprobs"] = [
            {tokenizer.decode([t]): v for t, v in top or []} for _, _, top in toks
        ]
    return out


def _chunk_logprobs(
    tokenizer: Any, toks: list[Scored], chat: bool, with_top: bool = False
) -> dict[str, Any]:
    """A streamed chunk's ``logprobs``: its tokens' (those sampled since the last chunk of the
    choice), in the endpoint's shape."""
    if chat:
        return {"content": _logprob_entries(tokenizer, toks)}
    return _completion_logprobs(tokenizer, toks, with_top)


def _logit_bias(given: dict[str, Any] | None) -> dict[int, Any] | str | None:
    """A request's ``logit_bias`` with its keys as token ids (the engine checks the ids against
    the vocabulary and the biases), or the message of a key that is not a token id."""
    if not given:
        return None
    bias = {}
    for key, value in given.items():
        try:
            tok = int(key)
        except ValueError:
            return f"logit_bias: keys must be token ids, got {key!r}"
        bias[tok] = value
    return bias


def _param_of(message: str) -> str | None:
    """The argument a ``ValueError`` of the engine names first (``"top_p must be ..."``)."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None


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
