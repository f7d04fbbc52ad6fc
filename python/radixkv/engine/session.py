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

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import numpy as np

from radixkv.engine.engine import Engine
from radixkv.engine.sampling import to_token_array
from radixkv.engine.sequence import Result


class Session:
    """A conversation: ``history`` (uint32 token ids) grows with every message and reply.

    ``send`` runs one turn to completion and appends the reply; ``append`` adds tokens that need
    no reply (tool output); ``branch`` runs N sub-agents from the current history (which they all
    find cached) without changing it; ``fork`` starts a diverging copy of the conversation.
    """

    def __init__(
        self,
        engine: Engine,
        system: Seq[int] | np.ndarray = (),
        namespace: str | bytes | None = None,
    ) -> None:
        if not isinstance(engine, Engine):
            raise ValueError(f"engine must be a radixkv.Engine, got {type(engine).__name__}")
        if namespace is not None and not isinstance(namespace, (str, bytes)):
            raise ValueError(
                f"namespace must be None, a str or bytes, got {namespace!r} "
                f"({type(namespace).__name__})"
            )
        self.engine = engine
        self.namespace = namespace
        self.history = to_token_array(system, "system", engine.vocab_size, allow_empty=True)
        self.results: list[Result] = []

    def append(self, tokens: Seq[int] | np.ndarray) -> None:
        """Adds ``tokens`` (tool output, a document) to the conversation without a reply."""
        extra = to_token_array(tokens, "tokens", self.engine.vocab_size, allow_empty=True)
        self.history = np.concatenate([self.history, extra])

    def send(
        self,
        message: Seq[int] | np.ndarray,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        stop: Iterable[int] = (),
        seed: int = 0,
    ) -> Result:
        """One turn: prompt = history + ``message``; runs it (and whatever else the engine has)
        until it finishes; history becomes prompt + reply. Bad arguments raise ``ValueError``
        before anything is queued; a turn whose step failed re-raises the request's error
        (``Result.error``). Either way the history is unchanged."""
        extra = to_token_array(message, "message", self.engine.vocab_size, allow_empty=True)
        prompt = np.concatenate([self.history, extra])
        seq_id = self.engine.submit(prompt, max_new_tokens, temperature, stop, self.namespace, seed)
        (result,) = self.engine.run([seq_id])
        if result.error is not None:
            raise result.error
        self.history = np.concatenate([prompt, np.asarray(result.output, dtype=np.uint32)])
        self.results.append(result)
        return result

    def branch(
        self,
        messages: Seq[Seq[int] | np.ndarray],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        stop: Iterable[int] = (),
        seed: int = 0,
    ) -> list[Result]:
        """Sub-agents: branch ``i`` answers history + ``messages[i]``; all run concurrently from
        one computed copy of the history. The history is unchanged (append what you keep). A
        branch whose step failed reports it in its result (``finish_reason="error"``)."""
        ids = self.engine.branch(
            self.history, messages, max_new_tokens, temperature, stop, self.namespace, seed
        )
        return self.engine.run(ids)

    def fork(self) -> Session:
        """A new session with the same history and namespace (their KV is shared in the cache)."""
        other = Session(self.engine, namespace=self.namespace)
        other.history = self.history.copy()
        return other

    def __len__(self) -> int:
        return len(self.history)
