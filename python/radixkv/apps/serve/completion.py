"""One completion request's way through the engine: :class:`Completion`, built from a chat
completions body (:meth:`Completion.chat`) or a completions body (:meth:`Completion.text`),
checked as it is built (a :class:`~radixkv.apps.serve.openai.Refusal` naming the field),
then :meth:`~Completion.submit`-ted, then :meth:`~Completion.collect`-ed whole or
:meth:`~Completion.stream`-ed. The agent APIs (:mod:`radixkv.apps.serve.chat_bridge`) build
the same object from the chat body they translate theirs into, and read its reply or chunks.

```text
  body ─> Completion.chat / .text ─> submit ─> EngineLoop ─> collect: the reply
           (checks, renders,          (n choices    (steps)  chunks: its chunks (dicts)
            tool-call parser)          per prompt)            stream: chunks as SSE text
```
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

import radixkv
from radixkv.apps.serve import (
    chat_prompt,
    openai,
    prompt_cache,
    request_fields,
    structured,
    tool_calls,
)
from radixkv.apps.serve.config import ServerConfig
from radixkv.apps.serve.engine_loop import EngineLoop, Pending, QueueFull
from radixkv.apps.serve.openai import Refusal
from radixkv.engine.params import RequestParams


@dataclass(frozen=True)
class Server:
    """What every completion of one app shares: the engine's loop, the tokenizer, the
    configuration, and what the chat template renders."""

    loop: EngineLoop
    tokenizer: Any
    config: ServerConfig
    #: The chat template renders ``tools`` (:func:`tool_calls.template_renders_tools`).
    renders_tools: bool
    #: The chat template renders an assistant's ``tool_calls``
    #: (:func:`chat_prompt.template_renders_calls`).
    renders_calls: bool

    @classmethod
    def of(cls, loop: EngineLoop, tokenizer: Any, config: ServerConfig) -> Server:
        return cls(
            loop,
            tokenizer,
            config,
            tool_calls.template_renders_tools(tokenizer),
            chat_prompt.template_renders_calls(tokenizer),
        )

    @property
    def names(self) -> frozenset[str]:
        """Every ``model`` a request may name."""
        return frozenset({self.config.model_name, *self.config.aliases})

    def refusal(self, body: openai.Body, chat: bool) -> Refusal | None:
        """The 400 of text that is not valid Unicode, the 404 of an unknown model, or the 400
        of a field this server does not implement."""
        bad = openai.text_refusal(body) or openai.unknown_model(body.model, self.names)
        if bad is not None:
            return bad
        field_refused = request_fields.refused(body.model_extra or {}, chat)
        if field_refused is not None:
            return Refusal(400, field_refused[1], field_refused[0])
        return None


@dataclass
class Shape:
    """How a completion's reply reads: chat's or completions', with ``logprobs`` (and
    ``top_logprobs`` alternatives), a ``grammar`` the output keeps to, a tool call the grammar
    demands (``tool_call``: returned as ``tool_calls``), calls parsed out of free text
    (``parser``: ``tool_choice="auto"``), and ``warnings`` for the reply."""

    chat: bool
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Any = None
    tool_call: bool = False
    parser: tool_calls.Auto | None = None
    warnings: list[str] = field(default_factory=list)


class Completion:
    """One request's choices: ``n`` of each of ``prompts``, sampled as ``body`` asks and
    shaped as ``shape`` says. Built checked (raises :class:`Refusal`); :meth:`submit` once,
    then :meth:`collect` or :meth:`chunks` / :meth:`stream` once. A client that goes away
    cancels what is left of it."""

    def __init__(
        self,
        server: Server,
        request: Request,
        body: openai.Body,
        prompts: list[list[int]],
        shape: Shape,
        limit: int | None = None,
    ) -> None:
        self.server = server
        self.request = request
        self.body = body
        self.prompts = prompts
        self.shape = shape
        config = server.config
        #: The request's tenant (the tenant header's value) and cache namespace.
        self.tenant = prompt_cache.tenant_of(request, config)
        self.namespace = prompt_cache.namespace_of(
            config.tenant_header, self.tenant, body.cache_salt
        )
        #: The engine's parameters of the request (``submit``'s and ``branch``'s).
        self.params = self._params(limit)
        self.n = body.n
        self.sequences = self.n * len(prompts)
        if self.sequences > server.loop.max_waiting:  # never served however long it waits
            where = "n" if len(prompts) == 1 else "prompt"
            raise Refusal(
                400,
                f"{where}: this request asks for {self.sequences} sequences ({len(prompts)} "
                f"prompt(s) x n={self.n}), more than the server ever runs at once "
                f"(--max-waiting {server.loop.max_waiting})",
                where,
            )
        #: What the engine thread hands back: the sequences' ids, events and results.
        self.pending = Pending(asyncio.get_running_loop())
        #: The prompts' tokens cached before ``n > 1`` branches prefilled them (None: read
        #: off the results).
        self.cached_tokens: int | None = None
        self.rid = ""  # the reply's id, once submitted
        self.model = server.config.model_name

    # ---- building ------------------------------------------------------------------------------

    @classmethod
    def chat(cls, server: Server, body: openai.ChatBody, request: Request) -> Completion:
        """A chat completion: ``body``'s messages rendered through the chat template, its
        ``tools`` demanded by a grammar or parsed out of the text (``tool_choice="auto"``)."""
        bad = server.refusal(body, chat=True)
        if bad is not None:
            raise bad
        config = server.config
        held = prompt_cache.apply(body, request, config)
        if held is not None:
            raise Refusal(400, held, "prompt_cache_retention")
        shape = Shape(chat=True, logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0)
        # OpenAI's default tool_choice is "auto" when tools are sent: calls parsed out of text
        if body.tools and body.tool_choice in (None, "auto"):
            if config.tool_call_parser is None:
                raise Refusal(
                    400,
                    'tool_choice: "auto" needs the server started with --tool-call-parser '
                    '(hermes or llama3_json); send tool_choice "required" or a named function',
                    "tool_choice",
                )
            try:
                declared = structured.check_tools(body.tools)
            except structured.BadRequest as e:
                raise Refusal(400, str(e), e.param) from None
            parallel = body.parallel_tool_calls is not False
            shape.parser = tool_calls.Auto(config.tool_call_parser, declared, parallel)
            if not server.renders_tools:
                shape.warnings.append(openai.TOOLS_NOT_RENDERED)
        try:  # a tool call the request demands, else its response format, else free text
            shape.grammar = structured.tool_grammar(body.tools, body.tool_choice)
            shape.tool_call = shape.grammar is not None
            if shape.grammar is None:
                shape.grammar = structured.response_grammar(body.response_format)
            prompt, rendered = chat_prompt.render_body(server.tokenizer, body, server.renders_calls)
        except structured.BadRequest as e:
            raise Refusal(400, str(e), e.param) from None
        shape.warnings += rendered
        if body.top_logprobs and not body.logprobs:
            raise Refusal(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
        return cls(server, request, body, [prompt], shape, body.max_completion_tokens)

    @classmethod
    def text(cls, server: Server, body: openai.CompletionBody, request: Request) -> Completion:
        """A completion of ``body``'s prompt (text or token ids) or prompts, one choice each."""
        bad = server.refusal(body, chat=False)
        if bad is not None:
            raise bad
        # OpenAI's prompt: a string, token ids, or a list of either (one choice per prompt)
        given = body.prompt
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise Refusal(400, "prompt: must hold at least one prompt", "prompt")
        prompts = [
            server.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
            for p in given
        ]
        for k, prompt in enumerate(prompts):
            if len(prompt) == 0:
                where = "prompt" if len(prompts) == 1 else f"prompt.{k}"
                raise Refusal(400, f"{where}: must hold at least one token", where)
        try:
            grammar = structured.response_grammar(body.response_format)
        except structured.BadRequest as e:
            raise Refusal(400, str(e), e.param) from None
        logprobs = body.logprobs is not None
        shape = Shape(chat=False, logprobs=logprobs, top_logprobs=body.logprobs or 0)
        shape.grammar = grammar
        return cls(server, request, body, prompts, shape)

    def _params(self, limit: int | None) -> RequestParams:
        """The engine's parameters of this request, checked (raises :class:`Refusal` for a
        request past the context, an empty stop string, a ``keep_alive`` past the server's
        bound, a ``logit_bias`` key that is no token id, a knob out of range)."""
        body, config, prompts = self.body, self.server.config, self.prompts
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
                where = "messages" if self.shape.chat else "prompt"
                raise openai.too_long(context, len(prompt), max_tokens, where)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stops):
            raise Refusal(400, "stop: stop strings must not be empty", "stop")
        tenant = self.tenant
        bound = prompt_cache.keep_alive_bound(tenant, config)
        if body.keep_alive > bound:
            who = f"tenant {tenant!r}" if tenant in config.tenant_max_keep_alive else "a request"
            raise Refusal(
                400,
                f"keep_alive: at most {bound:g} seconds for {who} on this server "
                f"(--max-keep-alive), got {body.keep_alive:g}",
                "keep_alive",
            )
        bias = openai.logit_bias(body.logit_bias)
        # No seed: a fresh one (as OpenAI and vLLM), so that unseeded samples differ; below
        # 2**62, so that every branch's seed + i stays in range.
        seed = body.seed if body.seed is not None else secrets.randbelow(2**62)
        try:
            return RequestParams(
                max_new_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                seed=seed,
                namespace=self.namespace,
                logprobs=self.shape.logprobs,
                top_logprobs=self.shape.top_logprobs,
                logit_bias=bias,
                stop_strings=stops,
                grammar=self.shape.grammar,
                retain=body.keep_alive,
                cache_priority=body.cache_priority,
            )
        except ValueError as e:  # a knob out of range: what the engine would refuse
            raise self._refused(e) from None

    def _refused(self, e: Exception) -> Refusal:
        """The 400 for a request the engine (or its parameters) refused: the field the message
        names, ``tools`` or ``response_format`` for a grammar that does not compile."""
        param = openai.param_of(str(e))
        if self.shape.grammar is not None and str(e).startswith("grammar"):
            param = "tools" if self.shape.tool_call else "response_format"
        return Refusal(400, str(e), param)

    # ---- running ------------------------------------------------------------------------------

    async def submit(self) -> None:
        """Hands the request to the engine thread (raises :class:`Refusal`: 429 when the queue
        is full, 400 for a knob the engine refuses, a prompt the pool can never hold, a schema
        that does not compile)."""
        loop, eng = self.server.loop, self.server.loop.engine
        cached = None
        if self.n > 1:  # the branches find the context cached by its own prefill: ask before
            prompts, ns = self.prompts, self.namespace
            cached = loop.call(lambda: sum(_cached_now(eng, p, ns) for p in prompts))
        try:
            await loop.call(lambda: loop.submit(self.pending, self._start, self.sequences))
        except QueueFull as e:
            raise Refusal(429, str(e), kind="rate_limit_error") from None
        except (ValueError, ImportError) as e:  # a knob out of range, a request the pool can
            # never hold, a schema that does not compile, no grammar library
            raise self._refused(e) from None
        self.cached_tokens = await cached if cached is not None else None
        self.rid = ("chatcmpl-" if self.shape.chat else "cmpl-") + uuid.uuid4().hex

    def _start(self, on_token: Callable) -> list[int]:
        """Engine thread: the request's sequences, choices in order (prompt by prompt, ``n``
        of each); a later prompt refused leaves none of the earlier ones served."""
        eng, ids = self.server.loop.engine, []
        params = dataclasses.replace(self.params, on_token=on_token)
        key, hint = getattr(self.body, "prompt_cache_key", None), self.server.loop.hint
        if key is not None and hint is not None:  # reported with the blocks it stores
            for p in self.prompts:
                hint(p, self.namespace, key)
        try:
            for p in self.prompts:
                if self.n == 1:
                    ids.append(eng.submit(p, params=params))
                else:
                    ids += eng.branch(p, [[]] * self.n, params=params)
        except BaseException:
            for i in ids:
                eng.cancel(i)
            eng.forget_finished()
            raise
        return ids

    async def respond(self) -> Any:
        """Submits, then the reply: a stream of server-sent events, or the whole reply."""
        await self.submit()
        if self.body.stream:
            return StreamingResponse(self.stream(), media_type="text/event-stream")
        return await self.collect()

    async def _cancel(self) -> None:
        loop = self.server.loop
        await loop.call(lambda: loop.cancel(self.pending))

    async def collect(self) -> dict[str, Any] | Response:
        """The whole reply once every choice finished (a 499 response when the client went
        away first: the request is cancelled; :class:`Refusal` 500 when the engine failed)."""
        pending = self.pending
        waiter = asyncio.ensure_future(pending.done.wait())
        while not waiter.done():
            await asyncio.wait({waiter}, timeout=0.25)
            if not waiter.done() and await self.request.is_disconnected():
                waiter.cancel()
                await self._cancel()
                return Response(status_code=499)
        results = [pending.results[i] for i in pending.ids]
        for r in results:
            if isinstance(r, BaseException):
                raise Refusal(500, f"the engine failed: {r!r}")
            if r.finish_reason == "error":
                raise Refusal(500, f"the request failed: {r.error!r}")
        choices = [self._choice(k, r) for k, r in enumerate(results)]
        usage = openai.usage(self.prompts, results, self.cached_tokens)
        chat, warnings = self.shape.chat, self.shape.warnings
        return openai.reply(self.rid, chat, self.model, int(time.time()), choices, usage, warnings)

    def _choice(self, k: int, r: Any) -> dict[str, Any]:
        """Choice ``k`` of a whole reply, of the finished result ``r``."""
        shape, tokenizer = self.shape, self.server.tokenizer
        choice: dict[str, Any] = {"index": k, "finish_reason": openai.finish(r.finish_reason)}
        text = r.text or ""
        if not shape.chat:
            choice["text"] = text
            choice["logprobs"] = (
                openai.completion_logprobs(tokenizer, openai.scored(r), shape.top_logprobs > 0)
                if shape.logprobs
                else None
            )
            return choice
        choice["message"] = {"role": "assistant", "content": text}
        calls = structured.tool_calls(text) if shape.tool_call else None
        if calls is not None and r.finish_reason == "stop":
            choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
            choice["finish_reason"] = "tool_calls"
        if shape.parser is not None:
            content, calls = shape.parser.parse(text)
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
        if shape.logprobs:
            choice["logprobs"] = {"content": openai.logprob_entries(tokenizer, openai.scored(r))}
        return choice

    async def stream(self) -> AsyncIterator[str]:
        """:meth:`chunks` as server-sent events, ending with ``data: [DONE]``."""
        async with contextlib.aclosing(self.chunks()) as chunks:  # type: ignore[type-var]
            async for body in chunks:
                yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The streamed reply's chunks as they come (the usage last, when the request asks
        for it); a failure ends it with OpenAI's error object. Closing it early (the client
        went away) cancels the request."""
        pending, shape = self.pending, self.shape
        self._created = int(time.time())
        self._first = True  # the first chunk carries the warnings
        count = len(pending.ids)
        index = {i: k for k, i in enumerate(pending.ids)}
        self._splitters = {k: shape.parser.splitter() for k in range(count)} if shape.parser else {}
        self._held: dict[int, str] = {}  # a tool call's text, sent whole as one delta at its end
        # Each choice's tokens and log-probabilities not yet sent: a token whose text is held
        # back (part of a character, of a possible stop string) goes with the next chunk.
        self._unsent: dict[int, list[openai.Scored]] = {}
        finished: set[int] = set()
        try:
            if shape.chat:
                yield self._chunk([_opened(k) for k in range(count)])
            while len(finished) < count:
                try:
                    ev = await asyncio.wait_for(pending.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await self.request.is_disconnected():
                        raise asyncio.CancelledError from None
                    if pending.done.is_set() and pending.events.empty():
                        break  # the engine failed: no more events come
                    continue
                k = index.get(ev.id)
                if k is None:
                    continue
                if ev.finish_reason:
                    finished.add(ev.id)
                if shape.logprobs and ev.token is not None and ev.logprob is not None:
                    self._unsent.setdefault(k, []).append((ev.token, ev.logprob, ev.top_logprobs))
                if ev.finish_reason == "error":  # OpenAI's error object, not a finish reason
                    await pending.done.wait()
                    r = pending.results.get(ev.id)
                    why = getattr(r, "error", None) if r is not None else None
                    yield openai.error_body(500, f"the request failed: {why or r!r}")
                    return
                for choices in self._deltas(k, ev):
                    yield self._chunk(choices)
            await pending.done.wait()
            if self._include_usage:
                results = [pending.results[i] for i in pending.ids]
                ok = [r for r in results if not isinstance(r, BaseException)]
                yield self._chunk([], openai.usage(self.prompts, ok, self.cached_tokens))
        except (asyncio.CancelledError, GeneratorExit):
            if not pending.done.is_set():
                await asyncio.shield(self._cancel())
            raise

    @property
    def _include_usage(self) -> bool:
        return bool((self.body.stream_options or {}).get("include_usage"))

    def _chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        warnings = self.shape.warnings if self._first else None
        if warnings:
            self._first = False
        chat, model, include = self.shape.chat, self.model, self._include_usage
        return openai.chunk(self.rid, chat, model, self._created, choices, include, usage, warnings)

    def _with_logprobs(self, k: int, choice: dict[str, Any]) -> dict[str, Any]:
        """``choice`` with the logprobs of choice ``k``'s tokens not sent yet."""
        if self.shape.logprobs:
            toks = self._unsent.pop(k, [])
            tokenizer, chat = self.server.tokenizer, self.shape.chat
            choice["logprobs"] = openai.chunk_logprobs(
                tokenizer, toks, chat, self.shape.top_logprobs > 0
            )
        return choice

    def _deltas(self, k: int, ev: Any) -> list[list[dict[str, Any]]]:
        """The chunks' choices that event ``ev`` of choice ``k`` sends (none while its text is
        held back: a tool call the grammar demands is sent whole at its end, text that may be
        a parsed call until it is known)."""
        shape = self.shape
        reason = openai.finish(ev.finish_reason) if ev.finish_reason else None
        if shape.tool_call:
            self._held[k] = self._held.get(k, "") + ev.text
            if reason is None:
                return []
            calls = structured.tool_calls(self._held[k]) if ev.finish_reason == "stop" else None
            if calls is not None:
                delta = {"tool_calls": [{"index": 0, **calls[0]}]}
                choice = {"index": k, "delta": delta, "finish_reason": "tool_calls"}
                return [[self._with_logprobs(k, choice)]]
            ev = dataclasses.replace(ev, text=self._held[k])  # cut short: sent as text
        elif shape.parser is not None:
            text = self._splitters[k].feed(ev.text)
            if reason is not None:
                content, calls = self._splitters[k].finish()
                text += content or ""
                if calls:
                    out = []
                    if text:
                        said = {"index": k, "delta": {"content": text}, "finish_reason": None}
                        out.append([said])
                    delta = {"tool_calls": [{"index": j, **c} for j, c in enumerate(calls)]}
                    choice = {"index": k, "delta": delta, "finish_reason": "tool_calls"}
                    out.append([self._with_logprobs(k, choice)])
                    return out
            ev = dataclasses.replace(ev, text=text)
        if not ev.text and reason is None:
            return []
        if shape.chat:
            delta = {"content": ev.text} if ev.text else {}
            choice = {"index": k, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": k, "text": ev.text, "finish_reason": reason}
        return [[self._with_logprobs(k, choice)]]


def _opened(k: int) -> dict[str, Any]:
    """Choice ``k``'s first chunk of a streamed chat completion: the assistant's turn opens."""
    return {"index": k, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


def _cached_now(eng: radixkv.Engine, prompt: list[int], namespace: Any) -> int:
    """Prompt tokens the cache holds right now (engine thread)."""
    if not eng.prefix_caching:
        return 0
    return int(eng.cache.match_prefix(prompt, namespace))
