"""Speculative decoding under tensor parallelism: 2 processes over gloo on CPU, each with its
shard of the tiny model, rank 0 drafting and deciding how many tokens each request keeps, must
give what one process gives: greedy outputs equal plain decoding token for token, sampled ones
and the cache's state equal one process with the same speculation, with stop strings (which
only rank 0 sees) and a callback that raises ending requests in the middle of a verified draft,
preemption in a small pool, and a retried request drafted from the cache.

Both scenarios run in one pair of processes (starting torch twice costs seconds)."""

from __future__ import annotations

import traceback
from pathlib import Path

import numpy as np
import pytest
import torch

import radixkv
from ranks import end_rank, join_gloo, run_ranks
from tiny_model import ids, tiny_model

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

#: (cache, drafter): the radix cache drafts from what it holds, the block cache by prompt lookup.
SCENARIOS = [("radix", "suffix"), ("block", "ngram")]
CACHES = {
    # 128 tokens: every request fits alone, the workload does not fit at once (preemption).
    "radix": lambda: radixkv.RadixCache(32, page_size=4),
    "block": lambda: radixkv.BlockCache(16, page_size=8),
}
NEW = 24


class LetterTokenizer:
    """A stand-in tokenizer: token ``t`` decodes to one letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + int(t) % 26) for t in ids)


def prompts() -> list[np.ndarray]:
    """Prompts that repeat a random run of tokens three times (prompt lookup finds it)."""
    rng = np.random.default_rng(4)
    return [np.concatenate([ids(rng, 8)] * 3) for _ in range(4)]


def make_engine(model, cache: str, method: str | None, **kw) -> radixkv.Engine:
    spec = None if method is None else {"method": method, "num_speculative_tokens": 5}
    kv = model.make_kv_cache(CACHES[cache]())
    return radixkv.Engine(model, kv, token_budget=64, max_batch=4, speculative=spec, **kw)


def drive(eng: radixkv.Engine, stops: list[str]) -> None:
    """Rank 0's (and one process's) calls: greedy requests, each with a stop string met late in
    its reply, one whose callback raises at its 12th token, one sampled; then the first prompt
    again (the suffix drafter finds its reply in the cache)."""
    ps = prompts()
    events: list = []

    def bad(event):
        events.append(event)
        if len(events) == 12:
            raise RuntimeError("callback failed")

    eng.submit(ps[0], max_new_tokens=NEW, stop=(), stop_strings=[stops[0]])
    eng.submit(ps[1], max_new_tokens=NEW, stop=(), stop_strings=[stops[1]])
    eng.submit(ps[2], max_new_tokens=NEW, stop=(), on_token=bad)
    eng.submit(ps[3], max_new_tokens=NEW, stop=(), temperature=0.8, seed=3)
    eng.run()
    eng.submit(ps[0], max_new_tokens=NEW, stop=())
    eng.run()


def report(eng: radixkv.Engine) -> dict:
    return {
        "outputs": {
            str(i): [s.result().output, s.result().finish_reason] for i, s in eng.sequences.items()
        },
        "digest": eng.cache.state_digest(),
        "accepted": eng.stats.spec_accepted_tokens,
        "preemptions": eng.stats.preemptions,
    }


def _worker(rank: int, port: int, world: int, out_dir: str, stops: list[str]) -> None:
    rep: dict = {}
    try:
        group = join_gloo(rank, port, world)
        model = tiny_model(seed=3).shard(rank, world, group)
        for cache, method in SCENARIOS:
            kw = dict(group=group, digest_every=1, check_tokens=True)
            if rank == 0:  # the tokenizer is rank 0's alone
                eng = make_engine(model, cache, method, tokenizer=LetterTokenizer(), **kw)
                drive(eng, stops)
                eng.close()
            else:
                eng = make_engine(model, cache, method, **kw)
                eng.follow()
            rep[f"{cache}/{method}"] = report(eng)
    except BaseException:  # the test reads it
        rep["crash"] = traceback.format_exc()
    end_rank(rank, out_dir, rep)


def stop_strings(model) -> list[str]:
    """For the first two prompts: two letters that greedy decoding first writes late in its
    reply (at or past its 12th token, where drafts are accepted), from a plain run."""
    eng = make_engine(model, "radix", None, tokenizer=LetterTokenizer())
    out = []
    for r in eng.generate(prompts()[:2], max_new_tokens=NEW, stop=()):
        text = LetterTokenizer().decode(r.output)
        pair = next(text[j : j + 2] for j in range(11, NEW - 1) if text[j : j + 2] not in text[:j])
        out.append(pair)
    return out


def test_ranks_speculate_as_one_process_and_as_plain_decoding(tmp_path: Path):
    torch.set_num_threads(1)
    full = tiny_model(seed=3)
    stops = stop_strings(full)
    reports = run_ranks(
        _worker, (2, str(tmp_path), stops), tmp_path, 2, "the speculating ranks", watchdog_s=180
    )
    for cache, method in SCENARIOS:
        key = f"{cache}/{method}"
        plain = make_engine(full, cache, None, tokenizer=LetterTokenizer())
        drive(plain, stops)
        spec = make_engine(full, cache, method, tokenizer=LetterTokenizer())
        drive(spec, stops)
        want, got1 = report(plain)["outputs"], report(spec)
        reasons = [reason for _, reason in want.values()]
        assert reasons.count("stop") == 2 and reasons.count("error") == 1, (key, want)
        assert got1["accepted"] > 0 and got1["preemptions"] > 0, (key, got1)
        for i in ("0", "1", "2", "4"):  # greedy: as plain decoding
            assert got1["outputs"][i] == want[i], (key, i)
        for r, rep in enumerate(reports):
            got = rep[key]
            assert got["outputs"] == got1["outputs"], f"rank {r}, {key}"
            assert got["digest"] == got1["digest"], f"rank {r}, {key}"
        assert reports[0][key]["accepted"] == got1["accepted"], key
