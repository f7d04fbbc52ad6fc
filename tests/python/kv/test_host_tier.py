"""The host tier in the torch layer: ``KVCache(host_device=...)`` performs the copies the index
logs, so a tiered cache under heavy eviction gives the logits and greedy tokens of a dense
recompute, and every token's KV that went to the host and came back is the KV computed for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.tiers.host import COPY_LOAD, COPY_OFFLOAD, copy_runs
from tiny_model import cuda, dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=7)
CFG = MODEL.config
HEAD_DIM = CFG.hidden_size // CFG.num_heads

#: (factory(device tokens, host pages) -> a tiered cache): every index and page size.
TIERED = [
    pytest.param(lambda n, h: radixkv.RadixCache(n, page_size=1, host_pages=h), id="radix-p1"),
    pytest.param(
        lambda n, h: radixkv.RadixCache(-(-n // 4), page_size=4, host_pages=h), id="radix-p4"
    ),
    pytest.param(
        lambda n, h: radixkv.BlockCache(-(-n // 16), page_size=16, host_pages=h), id="block-p16"
    ),
]


def host_pages_of(size: str, page_size: int) -> int:
    """A host tier of a few pages ("small") or one that holds every token these tests make."""
    return 3 if size == "small" else -(-2048 // page_size)


def tiered_kv(cache, model=MODEL, device="cpu") -> KVCache:
    """A KVCache shaped for ``model`` with its host pool on the CPU."""
    cfg = model.config
    return KVCache(
        cache,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.hidden_size // cfg.num_heads,
        dtype=model.embed_tokens.weight.dtype,
        device=device,
        host_device="cpu",
    )


def reference_kv(model, tokens) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the K and V rows (``[n, Hkv, D]``) a fresh prefill of ``tokens`` computes,
    read out of a scratch pool without a tier."""
    device = model.embed_tokens.weight.device
    cache = radixkv.RadixCache(len(tokens) + 1)
    kv = model.make_kv_cache(cache)
    req = cache.admit(tokens)
    model(kv.plan([req]))
    slots = torch.from_numpy(req.slots.astype(np.int64)).to(device)
    ks = [kv.k[layer].index_select(0, slots) for layer in range(kv.num_layers)]
    vs = [kv.v[layer].index_select(0, slots) for layer in range(kv.num_layers)]
    return ks, vs


def check_cached_kv(model, kv: KVCache, req, n: int, atol: float) -> None:
    """The pool rows of ``req``'s first ``n`` tokens hold the KV computed for those tokens.
    Called after a step of ``req``: its plan performed every copy the index had logged."""
    assert len(kv.cache.drain_copies()) == 0
    if n == 0:
        return
    ks, vs = reference_kv(model, req.tokens[:n])
    slots = torch.from_numpy(req.slots[:n].astype(np.int64)).to(kv.device)
    for layer in range(kv.num_layers):
        got_k = kv.k[layer].index_select(0, slots)
        got_v = kv.v[layer].index_select(0, slots)
        torch.testing.assert_close(got_k.cpu(), ks[layer].cpu(), atol=atol, rtol=0)
        torch.testing.assert_close(got_v.cpu(), vs[layer].cpu(), atol=atol, rtol=0)


def check_step(model, kv: KVCache, reqs, atol: float) -> torch.Tensor:
    """One step whose every planned token's logits must equal the dense forward's; commits it
    and returns each request's last-token logits."""
    starts = [r.num_computed for r in reqs]
    step = kv.plan(reqs)
    logits = model(step, all_logits=True)
    row = 0
    for req, start, n in zip(reqs, starts, step.q_len_list):
        want = model.forward_dense(req.tokens)[start:]
        torch.testing.assert_close(logits[row : row + n].cpu(), want.cpu(), atol=atol, rtol=0)
        row += n
    kv.commit(step)
    return logits[step.last_token_index]


def turn(model, kv, cache, tokens, namespace, atol, decode=2, fork_suffix=None):
    """Admits ``tokens``, checks the reloaded KV of its cached prefix, prefills it, decodes
    ``decode`` greedy tokens (each the dense argmax) with a fork of it alongside when
    ``fork_suffix`` is given; finishes. Returns the request's tokens."""
    req = cache.admit(tokens, namespace)
    cached = req.num_cached
    last = check_step(model, kv, [req], atol)
    check_cached_kv(model, kv, req, cached, atol)
    reqs = [req]
    if fork_suffix is not None:
        child = cache.fork(req)
        cache.extend(child, fork_suffix)
        reqs.append(child)
    for _ in range(decode):
        for r, row in zip(reqs, last):
            t = int(row.argmax())
            assert t == int(model.forward_dense(r.tokens)[-1].argmax())
            cache.extend(r, [t])
        last = check_step(model, kv, reqs, atol)
    tokens = req.tokens
    for r in reqs:
        cache.finish(r)
    return tokens


def scenario(model, make_cache, host_size, atol, device="cpu"):
    """Four conversations in two namespaces (two with the same system prompt in each) growing
    turn by turn in a pool of 128 tokens, so every turn evicts what others need; a fork, an
    abort of a request whose prefix came back from the host, and a reset in between."""
    probe = make_cache(128, 1)
    cache = make_cache(128, host_pages_of(host_size, probe.page_size))
    kv = tiered_kv(cache, model, device)
    rng = np.random.default_rng(1)
    system = ids(rng, 30)
    convs = [(ns, system.copy()) for ns in ("a", "b") for _ in range(2)]
    for t in range(3):
        for i, (ns, hist) in enumerate(convs):
            tokens = np.concatenate([hist, ids(rng, 6 + 3 * i)])
            if (t, i) == (0, 2):
                # Namespace "a" has computed the system prompt; "b" shares nothing of it.
                assert cache.match_prefix(system, "a") > 0 and cache.match_prefix(tokens, "b") == 0
            fork = ids(rng, 3) if (t, i) == (1, 2) else None
            convs[i] = (ns, turn(model, kv, cache, tokens, ns, atol, fork_suffix=fork))
        if t == 1:
            # Admit (its prefix loads from the host), then abort before any step: the loads stay
            # in the log and the next plan performs them before the next turn reads the pages.
            ns, hist = convs[0]
            loaded = cache.stats.loaded_pages
            req = cache.admit(np.concatenate([hist, ids(rng, 5)]), ns)
            cache.abort(req)
            if host_size == "large":
                assert cache.stats.loaded_pages > loaded
    stats = cache.stats
    assert stats.host_hit_tokens > 0 and stats.loaded_pages > 0 and stats.offloaded_pages > 0
    cache.check()
    dropped = cache.reset()
    assert dropped > 0 and cache.stats.host_free_pages == cache.stats.host_pages
    kv.apply_copies()
    ns, hist = convs[1]
    req = cache.admit(np.concatenate([hist, ids(rng, 4)]), ns)
    assert req.num_cached == 0
    cache.abort(req)
    # After the reset the conversations go on from nothing cached, still through the tier.
    for i in (1, 3):
        ns, hist = convs[i]
        convs[i] = (ns, turn(model, kv, cache, np.concatenate([hist, ids(rng, 5)]), ns, atol))
    cache.check()
    assert cache.stats.used_pages == 0


@pytest.mark.parametrize("host_size", ["small", "large"])
@pytest.mark.parametrize("make_cache", TIERED)
def test_offloaded_and_reloaded_kv_gives_dense_logits(make_cache, host_size):
    scenario(MODEL, make_cache, host_size, atol=1e-4)


@pytest.mark.parametrize("host_size", ["small", "large"])
@pytest.mark.parametrize("make_cache", TIERED)
def test_engine_sessions_through_the_tier_match_dense_greedy(make_cache, host_size):
    """Three sessions in two namespaces, a fork, a cancelled request and a reset on an engine
    whose device pool holds less than two conversations: greedy tokens equal a dense
    recompute."""
    probe = make_cache(128, 1)
    cache = make_cache(128, host_pages_of(host_size, probe.page_size))
    eng = radixkv.Engine(MODEL, tiered_kv(cache), token_budget=64)
    rng = np.random.default_rng(2)
    system = ids(rng, 40)
    sessions = [radixkv.Session(eng, system=system, namespace=ns) for ns in ("x", "y", "x")]
    for t in range(2):
        for s in sessions:
            s.append(ids(rng, 5 + 7 * t))
            r = s.send(ids(rng, 4), max_new_tokens=4)
            assert r.output == dense_greedy(MODEL, s.history[: r.prompt_tokens], 4)
    fork = sessions[0].fork()
    stray = eng.submit(np.concatenate([sessions[1].history, ids(rng, 9)]), 8, namespace="y")
    eng.step()
    assert eng.cancel(stray)
    for s in (fork, sessions[0]):
        r = s.send(ids(rng, 6), max_new_tokens=3)
        assert r.output == dense_greedy(MODEL, s.history[: r.prompt_tokens], 3)
    stats = cache.stats
    assert stats.host_hit_tokens > 0 and stats.loaded_pages > 0
    eng.run()
    cache.reset()
    r = sessions[1].send(ids(rng, 3), max_new_tokens=3)
    assert r.cached_tokens == 0
    assert r.output == dense_greedy(MODEL, sessions[1].history[: r.prompt_tokens], 3)
    cache.check()


def test_copy_constants_match_the_extension():
    assert (COPY_OFFLOAD, COPY_LOAD) == (radixkv.COPY_OFFLOAD, radixkv.COPY_LOAD) == (0, 1)


def test_host_device_is_required_with_a_tier_and_refused_without():
    tiered = radixkv.RadixCache(8, page_size=2, host_pages=5)
    with pytest.raises(ValueError, match=r"host_pages=5.*host_device"):
        KVCache(tiered, 2, 2, 16)
    with pytest.raises(ValueError, match=r"host_device='cpu'.*host_pages=0"):
        KVCache(radixkv.RadixCache(8), 2, 2, 16, host_device="cpu")
    with pytest.raises(ValueError, match="host_device='nowhere'"):
        KVCache(tiered, 2, 2, 16, host_device="nowhere")
    kv = KVCache(tiered, 3, 2, 16, dtype=torch.float16, host_device="cpu")
    assert len(kv.host_k) == len(kv.host_v) == 3
    for t in (*kv.host_k, *kv.host_v):
        assert t.shape == (10, 2, 16) and t.dtype == torch.float16 and t.device.type == "cpu"
        assert not t.is_pinned()  # pinned only for a CUDA pool
    assert kv.nbytes == 2 * 3 * 16 * 2 * 16 * 2
    assert kv.host_nbytes == 2 * 3 * 10 * 2 * 16 * 2
    plain = KVCache(radixkv.RadixCache(8), 2, 2, 16)
    assert plain.host_k == [] and plain.host_nbytes == 0 and plain.apply_copies() == 0


#: A crafted log over 8 device and 6 host pages, and the runs it must make.
LOG = [
    (0, 1, 0),
    (0, 2, 1),
    (0, 3, 2),  # device 1..3 -> host 0..2: one slice
    (0, 6, 4),  # same run, a new slice
    (0, 7, 0),  # host 0 again: a new run (it must land after the first write)
    (1, 0, 1),
    (1, 1, 2),  # load host 0..1 -> device 1..2: one slice, reading what the runs above wrote
    (1, 5, 0),  # new slice (not contiguous)
    (0, 1, 5),  # offload of a page just loaded: a new run (the kind changes)
]
RUNS = [
    (0, [(1, 0, 3), (6, 4, 1)]),
    (0, [(7, 0, 1)]),
    (1, [(0, 1, 2), (5, 0, 1)]),
    (0, [(1, 5, 1)]),
]


def fill(kv: KVCache, seed: int) -> None:
    """Distinct random values in every device and host row of every layer."""
    g = torch.Generator().manual_seed(seed)
    for t in (*kv.k, *kv.v, *kv.host_k, *kv.host_v):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def copies_one_by_one(kv: KVCache, log) -> list[list[torch.Tensor]]:
    """What performing ``log`` row by row, in order, leaves in (k, v, host_k, host_v), computed
    on clones of the pools."""
    pools = [[t.detach().cpu().clone() for t in p] for p in (kv.k, kv.v, kv.host_k, kv.host_v)]
    ps = kv.page_size
    for kind, src, dst in log:
        for layer in range(kv.num_layers):
            for dev, host in ((pools[0], pools[2]), (pools[1], pools[3])):
                a, b = (dev, host) if kind == COPY_OFFLOAD else (host, dev)
                b[layer][dst * ps : (dst + 1) * ps] = a[layer][src * ps : (src + 1) * ps]
    return pools


def check_crafted_log(device: str) -> None:
    cache = radixkv.RadixCache(8, page_size=2, host_pages=6)
    kv = KVCache(cache, 2, 2, 4, device=device, host_device="cpu")
    assert copy_runs(np.array(LOG, dtype=np.int32), 8, 6) == RUNS
    fill(kv, 0)
    want = copies_one_by_one(kv, LOG)
    # A copy that raises (layer 1's host pool made too short) leaves the rest queued: the next
    # call performs exactly those.
    host_k1 = kv.host_k[1]
    kv.host_k[1] = host_k1[:2]
    with pytest.raises(RuntimeError):
        kv.apply_copies(np.array(LOG, dtype=np.int32))
    kv.host_k[1] = host_k1
    assert kv.apply_copies() == len(LOG)
    if device == "cuda":
        torch.cuda.synchronize()  # the CPU reads the pinned host pools below
    got = [kv.k, kv.v, kv.host_k, kv.host_v]
    for want_pool, got_pool in zip(want, got):
        for w, g in zip(want_pool, got_pool):
            assert torch.equal(g.cpu(), w)
    # A bad row is refused before anything is performed.
    before = [t.clone() for t in (*kv.k, *kv.host_k)]
    for bad, name in (([(0, 8, 0)], "row 0"), ([(0, 1, 0), (1, 6, 0)], "row 1"), ([(2, 0, 0)], "")):
        with pytest.raises(ValueError, match=rf"{name}.*not a copy"):
            kv.apply_copies(np.array(bad, dtype=np.int32))
    assert all(torch.equal(a, b) for a, b in zip(before, (*kv.k, *kv.host_k)))
    with pytest.raises(ValueError, match=r"shaped \[N, 3\]"):
        copy_runs(np.zeros((2, 2), np.int32), 8, 6)
    assert copy_runs(np.zeros((0, 3), np.int32), 8, 6) == []


def test_apply_copies_coalesces_runs_and_keeps_log_order():
    check_crafted_log("cpu")


@pytest.mark.cuda
@cuda
def test_cuda_apply_copies_on_pinned_host_pools():
    check_crafted_log("cuda")
    cache = radixkv.RadixCache(8, page_size=2, host_pages=6)
    kv = KVCache(cache, 2, 2, 4, device="cuda", host_device="cpu")
    assert all(t.is_pinned() for t in (*kv.host_k, *kv.host_v))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("host_size", ["small", "large"])
@pytest.mark.parametrize("make_cache", TIERED)
def test_cuda_offloaded_and_reloaded_kv_gives_dense_logits(make_cache, host_size):
    """The same scenario on CUDA: copies on a side stream, attention waiting per layer."""
    scenario(tiny_model(seed=7, device="cuda"), make_cache, host_size, atol=1e-3, device="cuda")
