"""A synthetic agent workload: sessions of many turns that pause for tools, sub-agents, and a
background stream of one-shot requests, as requests ``radixkv replay`` replays.

Shape (every figure is a parameter of :class:`AgentWorkload`; defaults in brackets):

- Lead sessions [64] start as a Poisson process [0.2 per second]. Every prompt of every session
  starts with one shared system prompt with tool schemas [2,048 tokens], then the session's own
  context (the task, files) [500-4,000 tokens, uniform].
- A lead session runs [4-24, uniform] turns. Turn ``k``'s prompt is the whole history so far;
  the model replies [40-400 tokens, uniform: the request's ``output_length``], a tool runs for
  a pause drawn from a lognormal [median 8 s, sigma 1.4: p90 about 48 s, p99 about 210 s; capped
  at 600 s], and turn ``k + 1``'s prompt is turn ``k``'s plus the reply and the tool's output
  [lognormal, median 400 tokens, sigma 1.0, 16-8,000].
- At a lead turn (not its last), with probability [0.1], the tool is a set of sub-agents
  [1-3]: each branches from the lead's history with the reply so far plus its own task
  [100-400 tokens] and runs [2-6] turns of its own, pausing like the lead. The lead's next
  turn comes when the last sub-agent is done, its tool output being their results (as many
  tokens as their last replies together).
- One-shot requests of unrelated tokens arrive as a Poisson process [1 per second] while the
  agents run: lognormal prompts [median 1,500 tokens, sigma 0.8, 16-16,000], replies
  [40-400 tokens].

Time is open loop: a turn's reply is taken to last ``prompt / prefill_tps + output_length /
decode_tps`` seconds [50,000 and 50 tokens per second, ``radixkv replay``'s defaults], and the
next turn arrives a pause after that; a slower simulated server does not delay it.

Token ids: every new stretch of content (the system prompt, a context, a reply, a tool output,
a one-shot prompt) takes fresh ids from one counter, so two prompts share tokens exactly where
they share history; ids stay below ``2**31`` (the replay's synthetic output ids live above).

The requests are :class:`AgentRequest`: :class:`radixkv.apps.common.trace.TraceRequest` with the
session id, turn number, kind (lead, subagent or oneshot), parent session and whether the turn
is the session's last, so that retention can be applied per session. The same parameters and
seed give the same requests, token for token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from radixkv.apps.common.trace import TraceRequest

#: Kinds of :class:`AgentRequest`, in the order requests arriving together are listed.
KINDS = ("lead", "subagent", "oneshot")
#: Fresh token ids stay below this (the replay's synthetic output ids start there).
TOKEN_LIMIT = 2**31


@dataclass(frozen=True)
class AgentRequest(TraceRequest):
    """A request of the agent workload: a trace request with its session.

    ``session``: the session id (lead sessions ``0 .. sessions - 1``, then sub-agents in the
    order they branch; -1 for a one-shot request); ``turn``: its turn in the session, from 0;
    ``kind``: one of :data:`KINDS`; ``parent``: the lead session a sub-agent branched from (-1
    otherwise); ``final``: whether no later turn of this session follows."""

    session: int = -1
    turn: int = 0
    kind: str = "oneshot"
    parent: int = -1
    final: bool = True


def _int_range(name: str, value: object, low: int) -> None:
    ok = (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and low <= value[0] <= value[1]
    )
    if not ok:
        raise ValueError(
            f"{name} must be a pair of ints (low, high) with {low} <= low <= high, got {value!r}"
        )


@dataclass(frozen=True)
class AgentWorkload:
    """Parameters of the agent workload (see the module docstring); token counts in tokens,
    times in seconds, rates per second; ``(low, high)`` pairs are uniform and inclusive."""

    sessions: int = 64
    seed: int = 0
    session_rate: float = 0.2
    system_tokens: int = 2048
    context_tokens: tuple[int, int] = (500, 4000)
    turns: tuple[int, int] = (4, 24)
    reply_tokens: tuple[int, int] = (40, 400)
    pause_median: float = 8.0
    pause_sigma: float = 1.4
    pause_max: float = 600.0
    tool_median: float = 400.0
    tool_sigma: float = 1.0
    tool_tokens: tuple[int, int] = (16, 8000)
    subagent_prob: float = 0.1
    subagents: tuple[int, int] = (1, 3)
    subagent_turns: tuple[int, int] = (2, 6)
    task_tokens: tuple[int, int] = (100, 400)
    oneshot_rate: float = 1.0
    oneshot_median: float = 1500.0
    oneshot_sigma: float = 0.8
    oneshot_tokens: tuple[int, int] = (16, 16000)
    prefill_tps: float = 50_000.0
    decode_tps: float = 50.0

    def __post_init__(self) -> None:
        zero_ok = ("seed", "system_tokens", "subagent_prob", "oneshot_rate", "reply_tokens")
        for f in fields(self):
            value, low = getattr(self, f.name), 0 if f.name in zero_ok else 1
            if f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int) or value < low:
                    raise ValueError(f"{f.name} must be an int >= {low}, got {value!r}")
            elif f.type == "float":
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not (number and math.isfinite(value) and (value > 0 or value == low == 0)):
                    bound = ">= 0" if low == 0 else "> 0"
                    raise ValueError(f"{f.name} must be a finite number {bound}, got {value!r}")
            else:
                _int_range(f.name, value, low)
        if self.subagent_prob > 1:
            raise ValueError(f"subagent_prob must be in [0, 1], got {self.subagent_prob!r}")

    def generate(self) -> list[AgentRequest]:
        """The requests, sorted by arrival (ties: lead turns, sub-agents, one-shots; then by
        session and turn)."""
        return _Generator(self).run()


class _Generator:
    """One pass of :meth:`AgentWorkload.generate`; draws in a fixed order."""

    def __init__(self, w: AgentWorkload) -> None:
        self.w = w
        self.rng = np.random.default_rng(w.seed)
        self.next_id = 0
        self.next_session = w.sessions
        self.out: list[AgentRequest] = []

    def fresh(self, n: int) -> np.ndarray:
        """``n`` token ids never used before."""
        if self.next_id + n > TOKEN_LIMIT:
            raise ValueError(f"the workload needs more than {TOKEN_LIMIT} distinct token ids")
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.uint32)
        self.next_id += n
        return ids

    def uniform(self, pair: tuple[int, int]) -> int:
        return int(self.rng.integers(pair[0], pair[1] + 1))

    def lognormal(self, median: float, sigma: float, low: float, high: float) -> float:
        return float(np.clip(self.rng.lognormal(math.log(median), sigma), low, high))

    def pause(self) -> float:
        w = self.w
        return self.lognormal(w.pause_median, w.pause_sigma, 0.0, w.pause_max)

    def tool_output(self) -> np.ndarray:
        w = self.w
        lo, hi = w.tool_tokens
        return self.fresh(round(self.lognormal(w.tool_median, w.tool_sigma, lo, hi)))

    def reply_seconds(self, prompt: int, reply: int) -> float:
        return prompt / self.w.prefill_tps + reply / self.w.decode_tps

    def run(self) -> list[AgentRequest]:
        w = self.w
        system = self.fresh(w.system_tokens)
        start = 0.0
        for s in range(w.sessions):
            start += float(self.rng.exponential(1.0 / w.session_rate))
            context = self.fresh(self.uniform(w.context_tokens))
            self.session(s, "lead", -1, [system, context], start, self.uniform(w.turns))
        end = max((r.arrival for r in self.out), default=0.0)
        if w.oneshot_rate > 0:
            t = float(self.rng.exponential(1.0 / w.oneshot_rate))
            while t <= end:
                lo, hi = w.oneshot_tokens
                n = round(self.lognormal(w.oneshot_median, w.oneshot_sigma, lo, hi))
                prompt = self.fresh(n)
                self.out.append(AgentRequest(t, prompt, self.uniform(w.reply_tokens)))
                t += float(self.rng.exponential(1.0 / w.oneshot_rate))
        kind = {k: i for i, k in enumerate(KINDS)}
        return sorted(self.out, key=lambda r: (r.arrival, kind[r.kind], r.session, r.turn))

    def session(
        self,
        sid: int,
        kind: str,
        parent: int,
        segments: list[np.ndarray],
        t: float,
        turns: int,
    ) -> float:
        """Appends the turns of one session whose history starts as ``segments`` and whose
        first turn arrives at ``t``; returns when its last reply is done."""
        w = self.w
        lengths, meta = [], []  # per turn: prompt length; (arrival, output length)
        for k in range(turns):
            n = sum(len(x) for x in segments)
            reply = self.uniform(w.reply_tokens)
            lengths.append(n)
            meta.append((t, reply))
            done = t + self.reply_seconds(n, reply)
            if k == turns - 1:
                break
            segments.append(self.fresh(reply))  # the reply, in the next prompt
            if kind == "lead" and self.rng.random() < w.subagent_prob:
                results, back = 0, done
                for _ in range(self.uniform(w.subagents)):
                    sub = self.next_session
                    self.next_session += 1
                    branch = [*segments, self.fresh(self.uniform(w.task_tokens))]
                    back = max(
                        back,
                        self.session(
                            sub, "subagent", sid, branch, done, self.uniform(w.subagent_turns)
                        ),
                    )
                    results += self.out[-1].output_length
                segments.append(self.fresh(max(results, 1)))
                t = back
            else:
                segments.append(self.tool_output())
                t = done + self.pause()
        history = np.concatenate(segments)
        history.flags.writeable = False
        for k, (n, (arrival, reply)) in enumerate(zip(lengths, meta)):
            self.out.append(
                AgentRequest(
                    arrival, history[:n], reply, None, sid, k, kind, parent, k == turns - 1
                )
            )
        return done


def live_history_tokens(requests: Sequence[AgentRequest]) -> float:
    """The mean, over the arrivals of agent turns, of the histories of the sessions live then
    (started and not past their last turn), each as long as its latest prompt: the prefixes a
    cache would have to hold to keep every paused session warm."""
    order = sorted(
        (r for r in requests if r.kind != "oneshot"), key=lambda r: (r.arrival, r.session, r.turn)
    )
    current: dict[int, int] = {}
    total = 0
    samples = []
    for r in order:
        total += len(r.tokens) - current.get(r.session, 0)
        current[r.session] = len(r.tokens)
        samples.append(total)
        if r.final:
            total -= current.pop(r.session)
    return float(np.mean(samples)) if samples else 0.0
