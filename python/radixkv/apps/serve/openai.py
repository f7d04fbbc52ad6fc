"""OpenAI's shapes on ``radixkv serve``: the request bodies of chat completions and completions
(pydantic models: a field of the wrong type or range is a 400 naming it), the error object
(:class:`Refusal`, :func:`error`), and the builders of the replies, their streamed chunks,
``usage`` and ``logprobs``. Pure: nothing here reads a socket or the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

import radixkv
from radixkv.apps.serve import prompt_cache
from radixkv.apps.serve.token_bytes import token_bytes

# ---- the request bodies -----------------------------------------------------------------------


#: The warning of a ``tool_choice="auto"`` request on a chat template that ignores ``tools``
#: (served, as vLLM serves it: the model answers without seeing the tools).
TOOLS_NOT_RENDERED = (
    "tools: this model's chat template does not render tools, so the model was not shown them; "
    "tool calls are still parsed out of its text"
)

#: The most ``top_logprobs`` (chat) or ``logprobs`` (completions) a request may ask for.
MAX_TOP_LOGPROBS = 20


class Body(BaseModel):
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


class ChatBody(Body):
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


class CompletionBody(Body):
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


# ---- errors -----------------------------------------------------------------------------------


@dataclass
class Refusal(Exception):
    """A request the server refuses: its status and OpenAI's error fields (``param`` in chat
    completions' words; the agent APIs name their own field). The app answers it with
    :func:`error`."""

    status: int
    message: str
    param: str | None = None
    kind: str | None = None
    code: int | None = None

    def __str__(self) -> str:
        return self.message

    def response(self) -> JSONResponse:
        return error(self.status, self.message, self.param, self.kind, code=self.code)


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    kind: str | None = None,
    code: int | None = None,
) -> dict[str, Any]:
    """OpenAI's error object, as a dict."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(
    status: int,
    message: str,
    param: str | None = None,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
    code: int | None = None,
) -> JSONResponse:
    """OpenAI's error object, as a response."""
    body = error_body(status, message, param, kind, code)
    return JSONResponse(body, status_code=status, headers=headers)


def unknown_model(model: str | None, names: set[str] | frozenset[str]) -> Refusal | None:
    """The 404 of a ``model`` not among ``names`` (None: any request is served), as OpenAI and
    vLLM answer it."""
    if model is None or model in names:
        return None
    return Refusal(
        404,
        f"The model `{model}` does not exist: this server "
        f"serves {', '.join(repr(n) for n in sorted(names))}",
        "model",
        "NotFoundError",
        code=404,
    )


def bad_text(value: Any, where: str) -> str | None:
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
        if isinstance(k, str) and bad_text(k, where) is not None:
            return where or "body"
        bad = bad_text(v, f"{where}.{k}" if where else str(k))
        if bad is not None:
            return bad
    return None


def text_refusal(body: BaseModel) -> Refusal | None:
    """The 400 naming the field of ``body`` that holds a string that is not valid Unicode."""
    bad = bad_text(body.model_dump(exclude_defaults=True), "")
    if bad is None:
        return None
    return Refusal(
        400,
        f"{bad}: not valid Unicode text (it holds a lone surrogate, such as \\ud800, that "
        "cannot be encoded as UTF-8)",
        bad,
    )


def too_long(context: int, prompt: int, max_tokens: int, where: str) -> Refusal:
    """The 400 of a request past ``--max-model-len`` (vLLM's words)."""
    return Refusal(
        400,
        f"This model's maximum context length is {context} tokens (--max-model-len). "
        f"However, you requested {prompt + max_tokens} tokens "
        f"({prompt} in the {where}, {max_tokens} in the completion). Please "
        f"reduce the length of the {where} or completion.",
        where,
    )


def param_of(message: str) -> str | None:
    """The argument a ``ValueError`` of the engine names first (``"top_p must be ..."``)."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None


def logit_bias(given: dict[str, Any] | None) -> dict[int, Any] | None:
    """A request's ``logit_bias`` with its keys as token ids (the engine checks the ids against
    the vocabulary and the biases); a 400 for a key that is not a token id."""
    if not given:
        return None
    bias = {}
    for key, value in given.items():
        try:
            tok = int(key)
        except ValueError:
            raise Refusal(
                400, f"logit_bias: keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        bias[tok] = value
    return bias


# ---- the replies ------------------------------------------------------------------------------


def usage(prompts: list[list[int]], results: list[Any], cached: int | None) -> dict[str, Any]:
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


def finish(reason: str) -> str:
    """The engine's finish reason in OpenAI's words."""
    return {"stop": "stop", "length": "length"}.get(reason, reason)


#: One output token as the server reports it: its id, its logprob, and its most likely
#: alternatives ``(token, logprob)`` with ``top_logprobs`` (else None).
Scored = tuple[int, float, list[tuple[int, float]] | None]


def scored(r: Any) -> list[Scored]:
    """A result's output tokens with their logprobs and alternatives."""
    tops = r.top_logprobs or [None] * len(r.output)
    return list(zip(r.output, r.logprobs or [], tops))


def token_entry(tokenizer: Any, tok: int, lp: float) -> dict[str, Any]:
    """One token of chat's ``logprobs``: its text, logprob, and its own UTF-8 bytes (a token
    holding part of a character has the text U+FFFD, but its bytes are its own)."""
    text = tokenizer.decode([tok])
    return {"token": text, "logprob": lp, "bytes": list(token_bytes(tokenizer, tok))}


def logprob_entries(tokenizer: Any, toks: list[Scored]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries, each with its ``top_logprobs`` (OpenAI's shape)."""
    out = []
    for tok, lp, top in toks:
        entry = token_entry(tokenizer, tok, lp)
        entry["top_logprobs"] = [token_entry(tokenizer, t, v) for t, v in top or []]
        out.append(entry)
    return out


def completion_logprobs(tokenizer: Any, toks: list[Scored], with_top: bool) -> dict[str, Any]:
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


def chunk_logprobs(
    tokenizer: Any, toks: list[Scored], chat: bool, with_top: bool = False
) -> dict[str, Any]:
    """A streamed chunk's ``logprobs``: its tokens' (those sampled since the last chunk of the
    choice), in the endpoint's shape."""
    if chat:
        return {"content": logprob_entries(tokenizer, toks)}
    return completion_logprobs(tokenizer, toks, with_top)


def reply(
    rid: str,
    chat: bool,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    warnings: list[str] | None = None,
) -> dict[str, Any]:
    """A whole completion (``chat.completion`` or ``text_completion``)."""
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    if warnings:
        body["warnings"] = warnings
    return body


def chunk(
    rid: str,
    chat: bool,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    include_usage: bool = False,
    usage: dict[str, Any] | None = None,
    warnings: list[str] | None = None,
) -> dict[str, Any]:
    """A streamed completion's chunk (``chat.completion.chunk`` or ``text_completion``);
    ``include_usage``: the stream reports ``usage`` (None in each chunk but the last)."""
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = usage
    if warnings:
        body["warnings"] = warnings
    return body
