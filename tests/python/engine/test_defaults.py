"""One default each (``radixkv.engine.defaults``): the admission policy and the new tokens per
request agree across every entry point that takes them, and the in-batch prefix sharing
threshold the docs state is what the scheduler does."""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

import radixkv
from radixkv.apps import cli
from radixkv.engine import defaults
from radixkv.engine.batcher import Batcher
from radixkv.engine.engine import _submit_defaults
from tiny_model import tiny_model

SCHEDULING = Path(__file__).resolve().parents[3] / "docs" / "SCHEDULING.md"


def default(func, name: str):
    return inspect.signature(func).parameters[name].default


def cli_default(command: str, dest: str):
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    (action,) = [a for a in sub.choices[command]._actions if a.dest == dest]
    return action.default


def test_one_admission_policy_default():
    sched = default(radixkv.Scheduler, "policy")
    assert defaults.DEFAULT_POLICY == sched == "lpm"
    assert default(radixkv.Engine.__init__, "policy") == sched
    assert default(Batcher.__init__, "policy") == sched
    assert cli_default("demo", "policy") == cli_default("serve", "policy") == sched
    model = tiny_model(seed=1)
    engine = radixkv.Engine(model, model.make_kv_cache(radixkv.RadixCache(64)))
    assert engine.batcher.scheduler.policy == sched
    assert "Why" in inspect.getsource(defaults).split("DEFAULT_POLICY =")[0].split("\n\n")[-1]


def test_one_max_new_tokens_default():
    n = defaults.DEFAULT_MAX_NEW_TOKENS
    assert n == 16
    for func in (radixkv.Engine.submit, radixkv.Engine.branch):
        assert default(func, "max_new_tokens") == n, func
    for func in (radixkv.Session.send, radixkv.Session.branch):
        assert default(func, "max_new_tokens") == n, func
    assert _submit_defaults({})["max_new_tokens"] == n  # Engine.generate
    model = tiny_model(seed=1)
    engine = radixkv.Engine(model, model.make_kv_cache(radixkv.RadixCache(256)))
    turn = radixkv.Session(engine, system=np.arange(1, 20)).send([5, 6], stop=())
    assert len(turn.output) == n
    (sub,) = radixkv.Session(engine, system=[3, 4]).branch([[7, 8]], stop=())
    assert len(sub.output) == n


@pytest.mark.parametrize("page_size", [1, 16, 48])
def test_in_batch_sharing_starts_at_the_stated_threshold(page_size):
    """Two waiting requests sharing an uncached prefix: admitted in one call below the
    threshold, one call apart from it on (lpm, dfs-weight), always together with fcfs."""
    threshold = defaults.sharing_threshold(page_size)
    assert threshold == page_size * -(-64 // page_size) >= 64

    def admitted_together(shared: int, policy: str) -> int:
        cls = radixkv.RadixCache if page_size == 1 else radixkv.BlockCache
        sched = radixkv.Scheduler(cls(10_000, page_size), policy)
        for i in range(2):
            tail = np.arange(1000 * (i + 1), 1000 * (i + 1) + 200)
            sched.add(np.concatenate([np.arange(1, shared + 1), tail]).astype(np.uint32))
        return len(sched.schedule(100_000))

    for policy in ("lpm", "dfs-weight"):
        assert admitted_together(threshold - 1, policy) == 2
        assert admitted_together(threshold, policy) == 1
    assert admitted_together(threshold, "fcfs") == 2


def test_the_sharing_threshold_is_documented():
    text = " ".join(SCHEDULING.read_text().split())
    assert "uncached prefix of at least 64 tokens" in text
    doc = " ".join((radixkv.Engine.__doc__ or "").split())
    assert "uncached prefix of at least 64 tokens" in doc
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        defaults.sharing_threshold(0)
