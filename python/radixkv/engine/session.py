"""`Session`: a multi-turn conversation on an :class:`~radixkv.Engine`.

Each turn's prompt is the whole conversation so far plus the new message, exactly what a chat or
agent loop sends to a stateless server. The prefix cache is what makes that cheap: the previous
turns' KV (prompt and generated reply alike) is found in the cache and only the new message is
computed.

```text
  turn k prompt:  [ system | msg 1 | reply 1 | ... | tool output | msg k ]
                  '------ cached from turn k-1 ----'  computed now
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np

from radixkv.engine.chat import is_messages
from radixkv.engine.chat import render as render_chat
from radixkv.engine.defaults import DEFAULT_MAX_NEW_TOKENS
from radixkv.engine.engine import Engine
from radixkv.engine.params import RequestParams, check_keep, check_namespace
from radixkv.engine.sampling import to_token_array
from radixkv.engine.sequence import Result


class Session:
    """A conversation: ``history`` (uint32 token ids) grows with every message and reply.

    ``send`` runs one turn to completion and appends the reply; ``append`` adds tokens that need
    no reply (tool output); ``branch`` runs N sub-agents from the current history (which they all
    find cached) without changing it; ``fork`` starts a diverging copy of the conversation.

    ``keep_alive``: seconds each turn's pages stay retained in the prefix cache while the
    session waits for its next turn (an agent running a tool), evicted only when nothing else
    can be; the next turn takes over the retention, and :meth:`close` releases it.
    ``cache_priority``: the eviction class of the session's pages (0 .. EVICTION_CLASSES - 1,
    0 evicted first); its branches get one class lower by default.
    """

    def __init__(
        self,
        engine: Engine,
        system: Seq[int] | np.ndarray = (),
        namespace: str | bytes | None = None,
        *,
        keep_alive: float = 0.0,
        cache_priority: int = 0,
    ) -> None:
        if not isinstance(engine, Engine):
            raise ValueError(f"engine must be a radixkv.Engine, got {type(engine).__name__}")
        check_namespace(namespace)
        check_keep(keep_alive, cache_priority, "keep_alive")
        self.engine = engine
        self.namespace = namespace
        self.keep_alive = float(keep_alive)
        self.cache_priority = int(cache_priority)
        #: The prefix cache's retention of the last turn (``keep_alive``), or None.
        self.retention: int | None = None
        self.history = to_token_array(system, "system", engine.vocab_size, allow_empty=True)
        self.results: list[Result] = []
        #: The conversation of a chat session (one sent messages): every message and reply, as
        #: OpenAI-style dicts; None for a session of token ids.
        self.messages: list[dict] | None = None

    def append(self, tokens: Seq[int] | np.ndarray) -> None:
        """Adds ``tokens`` (tool output, a document) to the conversation without a reply."""
        extra = to_token_array(tokens, "tokens", self.engine.vocab_size, allow_empty=True)
        self.history = np.concatenate([self.history, extra])

    def send(
        self,
        message: Seq[int] | np.ndarray | list[dict],
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        stop: Iterable[int] | None = None,
        seed: int = 0,
        *,
        params: RequestParams | None = None,
        **knobs,
    ) -> Result | str:
        """One turn: prompt = history + ``message``; runs it (and whatever else the engine has)
        until it finishes; history becomes prompt + reply (every token sampled, the one that
        completed a stop string included). Bad arguments raise ``ValueError`` before anything
        is queued; a turn whose step failed (or whose ``on_token`` raised) re-raises the
        request's error (``Result.error``). Either way the history is unchanged. ``params``:
        a :class:`RequestParams`, or its fields as keyword options (:meth:`Engine.submit`'s);
        the session sets ``namespace``, ``retain`` (its ``keep_alive``) and
        ``cache_priority`` (``ValueError`` for another namespace or a retention of its own).

        ``message`` as OpenAI-style messages (``[{"role": "user", "content": "..."}]``, a list
        of dicts): a chat session. The conversation (:attr:`messages`) grows by them and the
        prompt is all of it rendered by the tokenizer's chat template as ``radixkv serve``
        renders it (:func:`radixkv.engine.chat.render`: assistant ``tool_calls`` with their
        arguments as objects, or as JSON in the content with a warning for a template that
        ignores them; needs ``radixkv.hf.engine(..., tokenizer=tok)``);
        the reply is returned as text and appended as the assistant's message (its
        :class:`Result` is ``results[-1]``). The earlier turns are found in the prefix cache as
        with token ids. A session holds token ids or messages, not both (``ValueError``)."""
        given = self._params(
            params,
            knobs,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop=stop,
            seed=seed,
        )
        given = dataclasses.replace(
            given, retain=self.keep_alive, cache_priority=self.cache_priority
        )
        conversation = None
        if is_messages(message):
            if self.messages is None and len(self.history):
                raise ValueError("this session holds token ids: send token ids, not messages")
            conversation = [*(self.messages or []), *message]
            prompt = np.asarray(render_chat(self.engine.tokenizer, conversation), dtype=np.uint32)
        else:
            if self.messages is not None:
                raise ValueError("this session is a chat: send messages, not token ids")
            extra = to_token_array(message, "message", self.engine.vocab_size, allow_empty=True)
            prompt = np.concatenate([self.history, extra])
        seq_id = self.engine.submit(prompt, params=given)
        (result,) = self.engine.run([seq_id])
        if result.error is not None:
            raise result.error
        self.history = np.concatenate([prompt, np.asarray(result.output, dtype=np.uint32)])
        self.results.append(result)
        if result.retention is not None:  # this turn's retention covers the last one's pages
            self.close()
            self.retention = result.retention
        if conversation is not None:
            self.messages = [*conversation, {"role": "assistant", "content": result.text}]
            return result.text
        return result

    def close(self) -> None:
        """Releases the retention of the last turn (``keep_alive``), if it is still live: its
        pages are plain cached pages again. The session can go on afterwards."""
        if self.retention is not None:
            self.engine.release_retention(self.retention)
            self.retention = None

    def branch(
        self,
        messages: Seq[Seq[int] | np.ndarray],
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        stop: Iterable[int] | None = None,
        seed: int = 0,
        *,
        params: RequestParams | None = None,
        **knobs,
    ) -> list[Result]:
        """Sub-agents: branch ``i`` answers history + ``messages[i]``; all run concurrently from
        one computed copy of the history. The history is unchanged (append what you keep). A
        branch whose step failed reports it in its result (``finish_reason="error"``).
        ``params`` and the keyword options are :meth:`Engine.branch`'s; the session sets
        ``namespace`` and ``cache_priority`` (one class below its own: a finished sub-agent's
        own pages go before the trunk the session keeps using)."""
        given = self._params(
            params,
            knobs,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop=stop,
            seed=seed,
        )
        given = dataclasses.replace(given, cache_priority=max(self.cache_priority - 1, 0))
        ids = self.engine.branch(self.history, messages, params=given)
        return self.engine.run(ids)

    def _params(self, params: RequestParams | None, knobs: dict, **positional) -> RequestParams:
        """The turn's :class:`RequestParams` in this session's namespace; ``ValueError`` for
        one that names another namespace or asks for a retention (the session's
        ``keep_alive`` and ``cache_priority`` decide it)."""
        given = RequestParams.of(params, **positional, **knobs)
        if given.namespace is not None and given.namespace != self.namespace:
            raise ValueError(
                f"namespace {given.namespace!r} is not this session's ({self.namespace!r}): a "
                "session's turns run in its namespace"
            )
        if given.retain != 0 or given.cache_priority != 0:
            raise ValueError(
                "a session's turns are retained by its keep_alive and cache_priority "
                f"(Session(...)), got retain={given.retain} and "
                f"cache_priority={given.cache_priority}"
            )
        return dataclasses.replace(given, namespace=self.namespace)

    def fork(self) -> Session:
        """A new session with the same history and namespace (their KV is shared in the cache)."""
        other = Session(
            self.engine,
            namespace=self.namespace,
            keep_alive=self.keep_alive,
            cache_priority=self.cache_priority,
        )
        other.history = self.history.copy()
        other.messages = None if self.messages is None else list(self.messages)
        return other

    def __len__(self) -> int:
        return len(self.history)
