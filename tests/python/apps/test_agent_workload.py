"""The synthetic agent workload: deterministic, histories that grow by prefix, sub-agents that
branch from their lead, heavy-tailed pauses, and requests the replay takes as they are."""

import dataclasses
import itertools

import numpy as np
import pytest

from radixkv.apps.common.trace import TraceRequest
from radixkv.apps.replay.agent_workload import AgentWorkload, live_history_tokens
from radixkv.apps.replay.simulate import ReplayConfig, replay

SMALL = AgentWorkload(sessions=12, seed=3, subagent_prob=0.3, oneshot_rate=0.5)


def by_session(reqs):
    out = {}
    for r in reqs:
        out.setdefault(r.session, []).append(r)
    return out


def test_same_seed_same_requests_other_seed_others():
    a, b = SMALL.generate(), SMALL.generate()
    assert len(a) == len(b) > 50
    for x, y in zip(a, b):
        assert (x.arrival, x.session, x.turn, x.kind, x.output_length) == (
            y.arrival,
            y.session,
            y.turn,
            y.kind,
            y.output_length,
        )
        assert np.array_equal(x.tokens, y.tokens)
    c = dataclasses.replace(SMALL, seed=4).generate()
    assert [len(r.tokens) for r in c] != [len(r.tokens) for r in a]


def test_sessions_grow_by_prefix_and_share_the_system_prompt():
    reqs = SMALL.generate()
    assert all(isinstance(r, TraceRequest) for r in reqs)
    assert [r.arrival for r in reqs] == sorted(r.arrival for r in reqs)
    system = SMALL.system_tokens
    sessions = by_session(reqs)
    leads = [s for s in sessions if s >= 0 and sessions[s][0].kind == "lead"]
    assert sorted(leads) == list(range(SMALL.sessions))
    for sid, turns in sessions.items():
        if sid < 0:
            continue
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert [r.final for r in turns] == [False] * (len(turns) - 1) + [True]
        for prev, nxt in itertools.pairwise(turns):
            # The next prompt is the previous one plus the reply and a tool output.
            assert len(nxt.tokens) > len(prev.tokens) + prev.output_length
            assert np.array_equal(nxt.tokens[: len(prev.tokens)], prev.tokens)
            assert nxt.arrival > prev.arrival + prev.output_length / SMALL.decode_tps
        first = turns[0].tokens
        lead0 = sessions[0][0].tokens
        assert np.array_equal(first[:system], lead0[:system])
        lo, hi = SMALL.turns if turns[0].kind == "lead" else SMALL.subagent_turns
        assert lo <= len(turns) <= hi


def test_subagents_branch_from_their_lead_history():
    reqs = SMALL.generate()
    sessions = by_session(reqs)
    subs = [s for s in sessions if s >= 0 and sessions[s][0].kind == "subagent"]
    assert subs, "seed 3 at probability 0.3 spawns sub-agents"
    for sid in subs:
        first = min(sessions[sid], key=lambda r: r.turn)
        lead = sorted(sessions[first.parent], key=lambda r: r.turn)
        # It starts after the lead turn it branches from, with that turn's whole prompt.
        before = [r for r in lead if r.arrival < first.arrival]
        parent_turn = before[-1]
        assert np.array_equal(first.tokens[: len(parent_turn.tokens)], parent_turn.tokens)
        # The lead's next turn waits for it.
        after = [r for r in lead if r.turn == parent_turn.turn + 1]
        last = max(sessions[sid], key=lambda r: r.turn)
        assert after and after[0].arrival >= last.arrival


def test_one_shots_share_nothing_and_pauses_are_heavy_tailed():
    w = AgentWorkload(sessions=30, seed=1, subagent_prob=0.0, oneshot_rate=0.2)
    reqs = w.generate()
    shots = [r for r in reqs if r.kind == "oneshot"]
    assert len(shots) > 50 and all(r.session == -1 and r.final for r in shots)
    seen = np.concatenate([r.tokens for r in shots])
    assert len(np.unique(seen)) == len(seen)
    sessions = {s: sorted(t, key=lambda r: r.turn) for s, t in by_session(reqs).items() if s >= 0}
    agents = np.concatenate([turns[-1].tokens for turns in sessions.values()])  # every history
    assert not np.intersect1d(seen, agents).size
    # Pauses: the gap between turns less the modelled reply time.
    gaps = []
    for turns in sessions.values():
        for prev, nxt in itertools.pairwise(turns):
            reply = len(prev.tokens) / w.prefill_tps + prev.output_length / w.decode_tps
            gaps.append(nxt.arrival - prev.arrival - reply)
    gaps = np.asarray(gaps)
    assert gaps.min() >= 0 and gaps.max() <= w.pause_max + 1e-9
    assert np.median(gaps) == pytest.approx(w.pause_median, rel=0.25)
    assert np.percentile(gaps, 99) > 10 * np.median(gaps)  # minutes against seconds


def test_live_histories_and_the_replay_take_the_workload():
    reqs = AgentWorkload(sessions=6, seed=2, oneshot_rate=0.2, turns=(3, 5)).generate()
    live = live_history_tokens(reqs)
    longest = max(len(r.tokens) for r in reqs)
    assert longest < live < sum(len(r.tokens) for r in reqs if r.kind != "oneshot")
    res = replay(reqs, ReplayConfig(num_pages=int(live // 16), prefill_tps=1e5))
    assert res.requests == len(reqs) and res.dropped == 0
    assert res.cached_tokens > 0 and set(res.request_ttfts) == set(range(len(reqs)))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("sessions", 0, "sessions must be an int >= 1, got 0"),
        ("pause_median", -1.0, "pause_median must be a finite number > 0, got -1.0"),
        ("oneshot_rate", float("nan"), "oneshot_rate must be a finite number >= 0, got nan"),
        ("turns", (5, 2), r"turns must be a pair of ints \(low, high\) with 1 <= low <= high"),
        ("subagent_prob", 1.5, r"subagent_prob must be in \[0, 1\], got 1.5"),
    ],
)
def test_bad_parameters_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        AgentWorkload(**{field: value})
