"""Where a hybrid model's recurrent-state snapshots are kept decides the prefill a hit saves
(issue 51, "Measure"): prompt tokens recomputed under four rules on one agent workload.

    .venv/bin/python benches/bench_hybrid_snapshots.py [--quick] [--sessions N] [--seed S]
        [--mooncake-requests N] [--pool-fraction F] [--state-share S]

The workload (seeded): sessions of 3-15 turns on 4 shared system prompts of 1.2k-6k tokens, each
turn's prompt the previous prompt + the previous reply + a new user message, 20% of turns
branching two sub-agents (the parent's prompt + reply + a task of their own); sessions arrive
spread out and interleave. 80 sessions (about 1,000 requests, 9M prompt tokens), 8 with
``--quick``. Then the Mooncake conversation trace (``benches/data/``: hash ids that make
prefixes, replies not in later prompts), its first 1,000 requests (100 with ``--quick``).

Each request is admitted, its prompt computed, its reply appended and computed but for the last
token (whose KV nobody computes), then finished; one request at a time. The rules, all on the
real index (radixkv's state slots, ``docs/SEMANTICS.md``):

- full attention: a plain ``RadixCache`` (page 1, no state slots): every KV hit counts;
- token-exact: ``RadixCache(page 1, state_slots)``, snapshots taken with ``take_state`` at the
  end of the prompt, at the end of the request (its last computed token) and at the junction
  where ``kv_matched`` ran past the hit (prefill stops there to snapshot it): issue 51's policy;
- vLLM align: ``BlockCache(page 528, state_slots)``. Qwen3.5-4B's attention block is inflated to
  528 tokens so that a state page fits (vllm#40696); a hit is whole blocks, and only where a
  state was kept: the last block boundary of the prompt (vllm#45238, vllm PR #43628: one state
  per prefill chunk, at its last aligned boundary) and, generously, of the request;
- SGLang interval: ``RadixCache(page 1, state_slots)``, snapshots at the prompt's end and at the
  branching point floored to the 64-token FLA chunk (sglang PR #14792's ``extra_buffer``
  tracking, sglang#22935, #28222), and at the last multiple of the 256-token track interval the
  decode passed (``mamba_track_interval``; only the last one, so no slot goes to the others).

Two memory settings: unbounded (a pool for every token, a slot for every snapshot), and a pool
of ``--pool-fraction`` of the distinct tokens (so pages are evicted) with a state budget of 1/4
of the pool's KV bytes (``--state-share``), converted to slots with Qwen3.5-9B's figures (bf16
KV: 32 KiB a token, 31.2 MiB per 1k tokens; fp32 snapshot: 49.5 MiB,
``radixkv.hf._hybrid.snapshot_bytes``; bf16 snapshot: 25.5 MiB).

Which snapshot a full budget evicts: the core's own order for token-exact (superseded
snapshots first, then the warm ones by saving and level, hubs that 4 requests went past last;
``docs/SEMANTICS.md``); the bench's own orders through ``evict_state`` for the other rows: the
plain LRU the core had first (vLLM's and SGLang's rules run with it, LRU being theirs too), the
order it had next (superseded first, then the least recently used, hubs last), and Belady's
(the trace is known: evict the snapshot whose next use is furthest, a use being a later
request whose hit would end there; or take none when the new snapshot's own next use is
furthest) for fp32 and bf16 snapshots. Belady's order is the reference for what an eviction
order can reach, not a proven bound: it ignores how many tokens a hit saves and the pages
dropped under the pool.
Printed: recomputed tokens and their ratio to full attention in the same setting, the KV the
match found past the hit (what a snapshot at the match's end would have saved), snapshots
taken and evicted, snapshot memory per 1k cached tokens at the end, and issue 51's goals
(token-exact within 1.05x of full attention unbounded, within 1.25x under the budget).

What the simulation of vLLM and SGLang leaves out: their schedulers (chunked prefill and batching
add checkpoints at chunk ends in vLLM, and are absent here), vLLM's shared KV/state pool (states
here have their own slot budget, the same for every rule), SGLang's ping-pong buffers per
running request, the cap of a hit at ``prompt - 1`` landing mid-edge (sglang#22935: radixkv's
index and the simulation find the snapshot below it), and every policy of theirs about which
snapshot to evict (here: radixkv's LRU of snapshots for all three).
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# One BLAS thread: this measures one core, and OpenBLAS's idle threads spin on the others.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

import radixkv
from common import mooncake_records, pin_one_core, table
from radixkv.apps.common.trace import mooncake_tokens

KV_BYTES_PER_TOKEN = 8 * 2 * 4 * 256 * 2  # Qwen3.5-9B: 8 attention layers, K+V, 4 heads, 256, bf16
# Qwen3.5-9B: its 24 Gated DeltaNet layers' conv and delta-rule states, fp32
SNAPSHOT_BYTES = int(49.5 * 2**20)
# the same in bf16 (conv states bf16 already): issue 51's note, measured on the meta device
SNAPSHOT_BYTES_BF16 = int(25.5 * 2**20)
VLLM_BLOCK = 528  # vLLM's attention block for Qwen3.5-4B in align mode (vllm#40696)
SGLANG_CHUNK = 64  # SGLang's FLA chunk: prefill checkpoints floor to it
SGLANG_INTERVAL = 256  # SGLang's mamba_track_interval during decode
GOALS = {"unbounded": 1.05, "budget": 1.25}  # token-exact / full attention, issue 51

Trace = list[tuple[np.ndarray, np.ndarray]]  # (prompt, reply) token ids per request, in order


# ---- workloads ----------------------------------------------------------------------------------


class Fresh:
    """Token ids never seen before, from a counter: distinct text never matches by chance."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, n: int) -> np.ndarray:
        out = np.arange(self.next, self.next + n, dtype=np.uint32)
        self.next += n
        return out


def agent_trace(sessions: int, seed: int) -> tuple[Trace, float]:
    """Issue 51's agent workload: ``sessions`` sessions on 4 shared system prompts, interleaved
    by arrival time; 20% of turns branch two sub-agents. Also returns how many sessions were
    live (begun, not ended) at a turn, on average: what a state budget must cover."""
    rng = np.random.default_rng(seed)
    fresh = Fresh(1)
    systems = [fresh.take(int(rng.integers(1200, 6001))) for _ in range(4)]
    # (time, session): a session's next turn; start times spread over the run
    queue = [(float(rng.uniform(0, 60 * sessions)), s) for s in range(sessions)]
    heapq.heapify(queue)
    context = {s: systems[int(rng.integers(0, 4))] for s in range(sessions)}
    turns_left = {s: int(rng.integers(3, 16)) for s in range(sessions)}
    out: Trace = []
    live: set[int] = set()
    live_sum = turns = 0
    while queue:
        t, s = heapq.heappop(queue)
        live.add(s)
        live_sum += len(live)
        turns += 1
        prompt = np.concatenate([context[s], fresh.take(int(rng.integers(50, 1001)))])
        reply = fresh.take(int(rng.integers(50, 701)))
        out.append((prompt, reply))
        if rng.random() < 0.2:
            for _ in range(2):
                task = fresh.take(int(rng.integers(50, 501)))
                out.append(
                    (np.concatenate([prompt, reply, task]), fresh.take(int(rng.integers(50, 701))))
                )
        context[s] = np.concatenate([prompt, reply])
        turns_left[s] -= 1
        if turns_left[s]:
            heapq.heappush(queue, (t + float(rng.exponential(60.0)), s))
        else:
            live.discard(s)
    return out, live_sum / max(1, turns)


def mooncake_trace(n: int) -> Trace:
    """The first ``n`` requests of the Mooncake conversation trace; each reply is fresh ids
    (the trace's later prompts do not contain the replies' tokens)."""
    fresh = Fresh(2**31)
    return [
        (mooncake_tokens(r["hash_ids"], r["input_length"]), fresh.take(max(1, r["output_length"])))
        for r in mooncake_records(n)
    ]


# ---- the rules ----------------------------------------------------------------------------------


def floor_to(x: int, step: int) -> int:
    return x // step * step


@dataclass(frozen=True)
class Rule:
    """A snapshot rule: the cache it runs on and where it takes snapshots. Each ``where``
    function gets (hit, kv_matched, prompt length, last computed token) and names a position,
    or 0 for none."""

    name: str
    make: Callable[[int, int], radixkv.Cache]  # (pool tokens, state slots) -> cache
    junction: Callable[[int, int], int]  # (hit, kv_matched)
    prompt_end: Callable[[int], int]  # (prompt length)
    request_end: Callable[[int, int], int]  # (prompt length, last computed token)
    stateful: bool = True


def _block_cache(pool: int, slots: int) -> radixkv.Cache:
    return radixkv.BlockCache(-(-pool // VLLM_BLOCK) + 2, VLLM_BLOCK, state_slots=slots)


def _sglang_decode(n_p: int, end: int) -> int:
    pos = floor_to(end, SGLANG_INTERVAL)
    return pos if pos > n_p else 0


RULES = [
    Rule(
        "full attention",
        lambda pool, slots: radixkv.RadixCache(pool, 1),
        lambda hit, kv: 0,
        lambda n_p: 0,
        lambda n_p, end: 0,
        stateful=False,
    ),
    Rule(
        "token-exact (radixkv)",
        lambda pool, slots: radixkv.RadixCache(pool, 1, state_slots=slots),
        lambda hit, kv: kv,
        lambda n_p: n_p,
        lambda n_p, end: end,
    ),
    Rule(
        f"vLLM align ({VLLM_BLOCK})",
        _block_cache,
        lambda hit, kv: 0,
        lambda n_p: floor_to(n_p, VLLM_BLOCK),
        lambda n_p, end: floor_to(end, VLLM_BLOCK),
    ),
    Rule(
        f"SGLang ({SGLANG_INTERVAL}/{SGLANG_CHUNK})",
        lambda pool, slots: radixkv.RadixCache(pool, 1, state_slots=slots),
        lambda hit, kv: floor_to(kv, SGLANG_CHUNK),
        lambda n_p: floor_to(n_p, SGLANG_CHUNK),
        _sglang_decode,
    ),
]


@dataclass
class Result:
    recomputed: int
    past_hit: int  # KV matched past the hit: prefill a state at the KV match's end would save
    taken: int
    evicted_states: int
    live_states: int
    cached_tokens: int

    @property
    def mib_per_1k(self) -> float:
        """Snapshot memory per 1k cached tokens at the end of the run."""
        if not self.cached_tokens:
            return 0.0
        return self.live_states * SNAPSHOT_BYTES / 2**20 / (self.cached_tokens / 1000)


# ---- eviction orders the bench chooses itself (the core's own is the default) -----------------


class Chooser:
    """An eviction order of the bench's own, through ``evict_state``: before each take with no
    free slot it evicts its own victim (or declines the take), so the core's order never acts.
    Told of every snapshot taken and hit, and of the slots the core freed."""

    def __init__(self, cache: radixkv.Cache, trace: Trace) -> None:
        self.cache = cache
        self.trace = trace
        self.live: dict[int, int] = {}  # slot -> position of its snapshot

    def start(self, t: int, planned: list[int]) -> None:
        """Request ``t`` begins; it means to snapshot at ``planned`` (positions)."""

    def end(self, t: int) -> None:
        """Request ``t`` finished."""

    def hit(self, slot: int) -> None:
        """A hit ended at the snapshot in ``slot`` (released at once)."""

    def took(self, slot: int, t: int, pos: int) -> None:
        """Request ``t`` took ``slot`` for its state at ``pos`` (published at once)."""
        self.live[slot] = pos

    def forget(self, slot: int) -> None:
        del self.live[slot]

    def declined(self, pos: int) -> None:
        """The running request takes no snapshot at ``pos`` after all."""

    def victim(self, t: int, pos: int) -> int | None:
        """The slot to evict before request ``t`` takes one at ``pos``; None: take none."""
        raise NotImplementedError

    def make_room(self, t: int, pos: int) -> bool:
        """Frees a slot of this order's choice if none is free; False: take none."""
        for slot in self.cache.drain_freed_states():
            if slot in self.live:
                self.forget(slot)
        while self.cache.stats.state_free_slots == 0:
            slot = self.victim(t, pos)
            if slot is None:
                return False
            self.forget(slot)
            self.cache.evict_state(slot)  # False: the core dropped it already (drained next)
        return True


class OldLru(Chooser):
    """The core's first order, before superseded snapshots went cold: least recently published
    or hit first (what vLLM's and SGLang's rules are run with, LRU being theirs too)."""

    def __init__(self, cache: radixkv.Cache, trace: Trace) -> None:
        super().__init__(cache, trace)
        self.order: dict[int, None] = {}  # slots, least recent first

    def hit(self, slot: int) -> None:
        self.order.pop(slot, None)
        self.order[slot] = None

    def took(self, slot: int, t: int, pos: int) -> None:
        super().took(slot, t, pos)
        self.order[slot] = None

    def forget(self, slot: int) -> None:
        super().forget(slot)
        del self.order[slot]

    def victim(self, t: int, pos: int) -> int | None:
        return next(iter(self.order), None)


class Superseded(Chooser):
    """The core's order before the saving-by-level one (2026-12-06's): superseded snapshots
    first (a request's own earlier ones cold, the one its hit continued from cool, each only if
    no other request went past it), then the least recently published or hit, hubs that
    ``HUB`` requests went past last (the least recent hub first while more than a quarter of the
    slots are hubs). Reproduces that core's figures exactly."""

    COLD, COOL, WARM, HOT = range(4)
    HUB = 4

    def __init__(self, cache: radixkv.Cache, trace: Trace) -> None:
        super().__init__(cache, trace)
        self.slots = cache.stats.state_slots
        self.clock = 0
        self.snap: dict[int, list[int]] = {}  # slot -> [part, last use, requests past, serial]
        self.serial = 0
        self.junction = 0
        self.came_from: tuple[int, int] | None = None  # (slot, serial) of the request's hit
        self.own: list[tuple[int, int, int]] = []  # (position, slot, serial) it took

    def start(self, t: int, planned: list[int]) -> None:
        self.junction, self.came_from, self.own = planned[0], None, []

    def hit(self, slot: int) -> None:
        self.clock += 1
        s = self.snap[slot]
        s[0], s[1] = (self.HOT if s[2] >= self.HUB else self.WARM), self.clock
        self.came_from = (slot, s[3])

    def took(self, slot: int, t: int, pos: int) -> None:
        super().took(slot, t, pos)
        self.clock += 1
        self.serial += 1
        self.snap[slot] = [self.WARM, self.clock, int(0 < pos <= self.junction), self.serial]
        self.own.append((pos, slot, self.serial))

    def forget(self, slot: int) -> None:
        super().forget(slot)
        del self.snap[slot]

    def superseded(self, slot: int, serial: int, to: int) -> None:
        self.clock += 1
        s = self.snap.get(slot)
        if s is None or s[3] != serial:
            return
        s[2] += 1
        if s[0] != self.WARM:
            return
        if s[2] == 1:
            s[0], s[1] = to, self.clock
        elif s[2] >= self.HUB:
            s[0] = self.HOT

    def end(self, t: int) -> None:
        if not self.own:
            return
        deepest = max(pos for pos, _, _ in self.own)
        for pos, slot, serial in self.own:
            if pos < deepest:
                self.superseded(slot, serial, self.COLD)
        if self.came_from is not None:
            slot, serial = self.came_from
            if slot in self.live and self.snap[slot][3] == serial and self.live[slot] < deepest:
                self.superseded(slot, serial, self.COOL)

    def victim(self, t: int, pos: int) -> int | None:
        hubs = sorted((s[1], slot) for slot, s in self.snap.items() if s[0] == self.HOT)
        if len(hubs) > max(self.slots // 4, 1):
            return hubs[0][1]
        return min(self.snap, key=lambda slot: self.snap[slot][:2], default=None)


class Belady(Chooser):
    """Belady's order, the trace being known: evict the snapshot whose next use is furthest
    (or decline the new one if its own is). A use is a later request whose hit would end at
    it: the snapshot is a prefix of its prompt and no deeper live snapshot is, counting the
    running request's planned ones. A reference, not a proven bound: it ignores what a hit
    saves (tokens) and the pages dropped under the pool."""

    NEVER = 1 << 62

    def __init__(self, cache: radixkv.Cache, trace: Trace) -> None:
        super().__init__(cache, trace)
        self.limit = [(len(p) - 1) // cache.page_size * cache.page_size for p, _ in trace]
        self.users: dict[int, list[int]] = {}  # request -> positions of snapshots it could hit
        self.uses_of: dict[int, list[int]] = {}  # slot -> later requests it is a prefix of
        self.planned: list[tuple[int, list[int]]] = []

    def tokens(self, t: int, pos: int) -> np.ndarray:
        prompt, reply = self.trace[t]
        return prompt[:pos] if pos <= len(prompt) else np.concatenate([prompt, reply])[:pos]

    def uses(self, t: int, pos: int) -> list[int]:
        """The requests after ``t`` whose hit could end at ``t``'s prefix of ``pos`` tokens."""
        toks = self.tokens(t, pos)
        last = toks[-1]
        out = []
        for i in range(t + 1, len(self.trace)):
            p = self.trace[i][0]
            if self.limit[i] >= pos and p[pos - 1] == last and np.array_equal(p[:pos], toks):
                out.append(i)
        return out

    def add(self, pos: int, uses: list[int]) -> None:
        for i in uses:
            self.users.setdefault(i, []).append(pos)

    def drop(self, pos: int, uses: list[int]) -> None:
        for i in uses:
            self.users[i].remove(pos)

    def next_use(self, pos: int, uses: list[int], t: int) -> int:
        return next(
            (i for i in uses if i > t and max(self.users[i]) == pos),
            self.NEVER,
        )

    def start(self, t: int, planned: list[int]) -> None:
        self.planned = [(pos, self.uses(t, pos)) for pos in sorted(set(planned)) if pos]
        for pos, uses in self.planned:
            self.add(pos, uses)

    def end(self, t: int) -> None:
        for pos, uses in self.planned:
            self.drop(pos, uses)
        self.planned = []

    def declined(self, pos: int) -> None:
        (uses,) = [u for p, u in self.planned if p == pos]
        self.drop(pos, uses)
        self.planned = [(p, u) for p, u in self.planned if p != pos]

    def took(self, slot: int, t: int, pos: int) -> None:
        super().took(slot, t, pos)
        uses = next(u for p, u in self.planned if p == pos)
        self.uses_of[slot] = uses
        self.add(pos, uses)

    def forget(self, slot: int) -> None:
        self.drop(self.live[slot], self.uses_of.pop(slot))
        super().forget(slot)

    def victim(self, t: int, pos: int) -> int | None:
        new = next(u for p, u in self.planned if p == pos)
        best, far = None, self.next_use(pos, new, t)
        for slot, at in self.live.items():
            n = self.next_use(at, self.uses_of[slot], t)
            if n > far:
                best, far = slot, n
        return best


def run(
    rule: Rule,
    trace: Trace,
    pool: int,
    slots: int,
    order: type[Chooser] | None = None,
) -> Result:
    """Drives ``trace`` through a fresh cache of ``rule``; counts the prompt tokens recomputed.
    ``order``: an eviction order of the bench's own, else the core's."""
    cache = rule.make(pool, slots)
    chooser = order(cache, trace) if order and rule.stateful else None
    recomputed = past_hit = 0

    def snapshot(t: int, req: radixkv.Request, pos: int, computed: int) -> int:
        # A state exists only from where this request computes: past what it has computed.
        if rule.stateful and pos > computed and pos % cache.page_size == 0:
            slot = None
            if chooser is None or chooser.make_room(t, pos):
                slot = cache.take_state(req, pos)  # None (slots busy, or one there): none kept
            elif chooser is not None:
                chooser.declined(pos)
            cache.commit(req, pos)
            if chooser is not None and slot is not None:
                chooser.took(slot, t, pos)
            return pos
        return computed

    for t, (prompt, reply) in enumerate(trace):
        n_p = len(prompt)
        end = n_p + len(reply) - 1  # the last token's KV is never computed
        req = cache.admit(prompt)
        hit = req.num_cached
        recomputed += n_p - hit
        computed = hit
        if rule.stateful:
            kv = req.kv_matched
            if chooser is not None:
                junction = rule.junction(hit, kv) if kv > hit else 0
                chooser.start(t, [junction, rule.prompt_end(n_p), rule.request_end(n_p, end)])
            if req.state_slot is not None:
                if chooser is not None:
                    chooser.hit(req.state_slot)
                cache.release_state(req)  # the engine copied it into the request's own slot
            past_hit += kv - hit
            if kv > hit:
                computed = snapshot(t, req, rule.junction(hit, kv), computed)
        computed = snapshot(t, req, rule.prompt_end(n_p), computed)
        cache.commit(req, n_p)
        cache.extend(req, reply)
        snapshot(t, req, rule.request_end(n_p, end), n_p)
        cache.commit(req, end)
        cache.finish(req)
        if chooser is not None:
            chooser.end(t)
    s = cache.stats
    live = s.state_slots - s.state_free_slots if rule.stateful else 0
    return Result(
        recomputed,
        past_hit,
        s.taken_states if rule.stateful else 0,
        s.evicted_states if rule.stateful else 0,
        live,
        (s.evictable_pages + s.used_pages) * s.page_size,
    )


# ---- report -------------------------------------------------------------------------------------


def measure(label: str, trace: Trace, pool_fraction: float, state_share: float) -> dict[str, float]:
    """Runs every rule unbounded and under the budget; prints a table; returns token-exact's
    ratios to full attention per setting."""
    prompt_tokens = sum(len(p) for p, _ in trace)
    longest = max(len(p) + len(r) for p, r in trace)
    everything = sum(len(p) + len(r) for p, r in trace)
    distinct = run(RULES[0], trace, everything + 1, 0).cached_tokens
    pool = max(int(distinct * pool_fraction), 2 * longest)
    budget_slots = max(1, int(state_share * pool * KV_BYTES_PER_TOKEN / SNAPSHOT_BYTES))
    bf16_slots = max(1, int(state_share * pool * KV_BYTES_PER_TOKEN / SNAPSHOT_BYTES_BF16))
    settings = {
        "unbounded": (everything + 1, 3 * len(trace) + 1),
        "budget": (pool, budget_slots),
    }
    exact = RULES[1]
    # Under the budget, beside the core's order: the old one, Belady's, and bf16 snapshots;
    # vLLM's and SGLang's rules keep the plain LRU they have themselves.
    extra = [
        ("token-exact, old LRU", exact, budget_slots, OldLru),
        ("token-exact, superseded+LRU", exact, budget_slots, Superseded),
        ("token-exact, Belady", exact, budget_slots, Belady),
        (f"token-exact, bf16 ({bf16_slots} slots)", exact, bf16_slots, None),
        ("token-exact, bf16, Belady", exact, bf16_slots, Belady),
    ]
    print(
        f"== {label}: {len(trace):,} requests, {prompt_tokens:,} prompt tokens, "
        f"{distinct:,} distinct tokens computed"
    )
    print(
        f"   unbounded: pool {everything + 1:,} tokens, {3 * len(trace) + 1:,} state slots; "
        f"budget: pool {pool:,} tokens ({pool_fraction:g} of the distinct, "
        f"{pool * KV_BYTES_PER_TOKEN / 2**30:.1f} GiB of KV), {budget_slots:,} state slots "
        f"({budget_slots * SNAPSHOT_BYTES / 2**30:.1f} GiB, {state_share:g} of the KV)"
    )
    ratios: dict[str, float] = {}
    rows = []
    for setting, (pages, slots) in settings.items():
        base = None
        runs = [(rule.name, rule, slots, None) for rule in RULES]
        if setting == "budget":
            runs = [(n, r, k, None if r is exact else OldLru) for n, r, k, _ in runs] + extra
        for name, rule, k, order in runs:
            t0 = time.perf_counter()
            r = run(rule, trace, pages, k, order)
            secs = time.perf_counter() - t0
            base = r.recomputed if base is None else base
            x = r.recomputed / base if base else float("nan")
            if name == exact.name:
                ratios[setting] = x
            rows.append(
                [
                    setting,
                    name,
                    f"{r.recomputed:,}",
                    f"{r.recomputed / prompt_tokens:.1%}",
                    f"{x:.3f}x",
                    f"{r.past_hit:,}" if rule.stateful else "-",
                    f"{r.taken:,}" if rule.stateful else "-",
                    f"{r.evicted_states:,}" if rule.stateful else "-",
                    f"{r.mib_per_1k:.2f}" if rule.stateful else "-",
                    f"{secs:.1f}",
                ]
            )
    table(
        [
            "memory",
            "rule",
            "recomputed",
            "of prompts",
            "x full attn",
            "KV past hit",
            "snapshots",
            "evicted",
            "snap MiB/1k cached",
            "s",
        ],
        rows,
    )
    kv_per_1k = KV_BYTES_PER_TOKEN * 1000 / 2**20
    print(f"   (the KV itself: {kv_per_1k:.1f} MiB per 1k cached tokens)")
    for setting, goal in GOALS.items():
        got = ratios[setting]
        verdict = "met" if got <= goal else "NOT met"
        print(
            f"   goal {setting}: token-exact within {goal}x of full attention: "
            f"{got:.3f}x, {verdict}"
        )
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small fraction of the workload")
    ap.add_argument("--sessions", type=int, default=None, help="agent sessions (80; 8 quick)")
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument(
        "--mooncake-requests",
        type=int,
        default=None,
        help="requests of the Mooncake trace (1,000; 100 quick; 0: skip it)",
    )
    ap.add_argument(
        "--pool-fraction",
        type=float,
        default=0.25,
        help="the budget's pool, a share of the distinct tokens (0.25)",
    )
    ap.add_argument(
        "--state-share",
        type=float,
        default=0.25,
        help="the budget's state slots, a share of the pool's KV bytes (0.25)",
    )
    args = ap.parse_args(argv)
    sessions = args.sessions if args.sessions is not None else (8 if args.quick else 80)
    moon = args.mooncake_requests
    if moon is None:
        moon = 100 if args.quick else 1000
    for flag, value in (("--sessions", sessions), ("--mooncake-requests", moon)):
        if value < 0:
            ap.error(f"{flag} must be >= 0, got {value}")
    if not 0 < args.pool_fraction <= 1:
        ap.error(f"--pool-fraction must be in (0, 1], got {args.pool_fraction}")
    if args.state_share <= 0:
        ap.error(f"--state-share must be > 0, got {args.state_share}")
    print(f"hybrid snapshots: {pin_one_core()}, seed {args.seed}")
    if sessions:
        trace, live = agent_trace(sessions, args.seed)
        measure(
            f"agent workload, {sessions} sessions ({live:.1f} live at a turn on average)",
            trace,
            args.pool_fraction,
            args.state_share,
        )
    if moon:
        print(
            "Mooncake: its hash ids name 512-token blocks, so a turn's shared prefix ends at a\n"
            "block boundary, never where the previous turn ended: only junction snapshots hit."
        )
        measure(
            f"Mooncake conversation trace, first {moon}",
            mooncake_trace(moon),
            args.pool_fraction,
            args.state_share,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
