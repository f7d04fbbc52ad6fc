"""The disk tier end to end: ``KVCache(..., disk_dir=...)`` performs the index's disk copies, a
prompt's pages come back from disk as hits carrying exactly the KV computed for them, a new
process over the same directory finds what the last one saved, and a page torn, corrupted or
written for another model is recomputed, never served."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import radixkv
from radixkv.kv.kv_cache import KVCache
from radixkv.kv.tiers.disk_pool import DiskMismatchError
from radixkv.kv.tiers.fingerprint import model_fingerprint
from test_host_tier import check_cached_kv
from tiny_model import dense_greedy, ids, tiny_model

MODEL = tiny_model(seed=11)
CFG = MODEL.config
HEAD_DIM = CFG.hidden_size // CFG.num_heads
HERE = os.path.dirname(os.path.abspath(__file__))
#: The killed writer's environment: it imports tiny_model from the tests' support/ folder.
SUPPORT = os.path.join(os.path.dirname(HERE), "support")
ENV = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(p for p in (SUPPORT, os.environ.get("PYTHONPATH")) if p),
)

#: (factory(pool pages, host pages, disk pages) -> a cache with all three tiers).
CACHES = [
    pytest.param(lambda n, h, d: radixkv.RadixCache(n, 1, h, d), id="radix-p1"),
    pytest.param(lambda n, h, d: radixkv.RadixCache(n, 4, h, d), id="radix-p4"),
    pytest.param(lambda n, h, d: radixkv.BlockCache(n, 16, h, d), id="block-p16"),
]


def disk_kv(cache, path, fingerprint=None, on_mismatch="error") -> KVCache:
    return KVCache(
        cache,
        CFG.num_layers,
        CFG.num_kv_heads,
        HEAD_DIM,
        host_device="cpu",
        disk_dir=path,
        fingerprint=fingerprint,
        on_mismatch=on_mismatch,
    )


def sized(make, tokens: int, page_size: int):
    """A cache whose pool and host tier each hold about ``tokens`` tokens, and a disk 8x that."""
    pages = -(-tokens // page_size)
    return make(pages, pages, 8 * pages)


def page_of(make) -> int:
    return make(1, 1, 1).page_size


def run(engine, prompt, n=4) -> radixkv.Result:
    sid = engine.submit(prompt, max_new_tokens=n, stop=())
    (res,) = engine.run([sid], release=True)
    return res


@pytest.mark.parametrize("make", CACHES)
def test_pages_read_back_from_disk_hold_the_kv_computed_for_them(make, tmp_path):
    rng = np.random.default_rng(0)
    p = page_of(make)
    cache = sized(make, 96, p)
    kv = disk_kv(cache, tmp_path)
    engine = radixkv.Engine(MODEL, kv)
    a = ids(rng, 80)
    first = run(engine, a)
    assert first.output == dense_greedy(MODEL, a, 4)
    # Other prompts push a's pages off the device, then off the host, onto the disk.
    for _ in range(4):
        run(engine, ids(rng, 80))
    kv.apply_copies()
    s = cache.stats
    assert s.disk_written_pages > 0, s
    assert cache.match_prefix(a) < (len(a) - 1) // p * p  # not all in memory any more
    # a comes back from disk: prefetched into the host tier, loaded at admission.
    back = kv.prefetch(a)
    assert back > 0
    assert cache.stats.disk_fetched_pages == back // p
    req = cache.admit(a)
    assert req.num_cached >= back
    step = kv.plan([req])
    MODEL(step)
    kv.commit(step)
    check_cached_kv(MODEL, kv, req, req.num_cached, atol=1e-6)
    cache.finish(req)
    cache.check()
    # Through the engine: the same greedy tokens, the pages a hit.
    again = run(engine, np.concatenate([a, ids(rng, 5)]))
    assert again.cached_tokens >= (len(a) - 1) // p * p - p
    kv.close()


@pytest.mark.parametrize("make", CACHES)
def test_a_new_cache_over_the_directory_finds_what_was_saved(make, tmp_path):
    rng = np.random.default_rng(1)
    p = page_of(make)
    a = ids(rng, 70)
    cache = sized(make, 128, p)
    kv = disk_kv(cache, tmp_path)
    engine = radixkv.Engine(MODEL, kv)
    out = run(engine, a, 6)
    written = kv.save()
    assert written > 0
    kv.close()
    # Another cache, another KVCache (zeroed pools): the pages come back from disk alone.
    cache2 = sized(make, 128, p)
    kv2 = disk_kv(cache2, tmp_path)
    assert kv2.disk.restored_pages == written
    assert cache2.match_prefix(a) == 0
    engine2 = radixkv.Engine(MODEL, kv2)
    turn = np.concatenate([a, np.asarray(out.output, np.uint32), ids(rng, 3)])
    res = run(engine2, turn, 5)
    assert res.output == dense_greedy(MODEL, turn, 5)
    assert res.cached_tokens >= (len(a) + 6 - 1) // p * p - p
    assert engine2.stats.disk_tokens == res.cached_tokens
    kv2.close()


def test_a_corrupted_page_is_recomputed_and_never_served(tmp_path):
    rng = np.random.default_rng(2)
    a = ids(rng, 64)
    cache = radixkv.RadixCache(24, 4, 16, 64)
    kv = disk_kv(cache, tmp_path)
    run(radixkv.Engine(MODEL, kv), a)
    kv.save()
    keys, slots = cache.disk_entries()
    slot_bytes = kv.disk.pool.slot_bytes
    kv.close()
    # Damage one payload byte of the page holding tokens 16..20 (its key is the 5th block key).
    target = radixkv.block_hashes(a[:20], 4)[-1]
    slot = int(slots[[keys[32 * i : 32 * i + 32] for i in range(len(slots))].index(target)])
    pool_file = tmp_path / "pages.bin"
    with open(pool_file, "r+b") as f:
        f.seek(slot * slot_bytes + 1000)
        byte = f.read(1)
        f.seek(slot * slot_bytes + 1000)
        f.write(bytes([byte[0] ^ 0x40]))
    cache2 = radixkv.RadixCache(24, 4, 16, 64)
    kv2 = disk_kv(cache2, tmp_path)
    engine = radixkv.Engine(MODEL, kv2)
    turn = np.concatenate([a, ids(rng, 3)])
    res = run(engine, turn)
    assert res.output == dense_greedy(MODEL, turn, 4)
    assert cache2.stats.disk_bad_pages == 1
    # Only the pages before the damaged one came back.
    assert res.cached_tokens == 16
    cache2.check()
    kv2.close()


def test_a_directory_of_another_model_is_refused_or_reset(tmp_path):
    rng = np.random.default_rng(3)
    a = ids(rng, 40)
    cache = radixkv.RadixCache(32, 4, 16, 64)
    kv = disk_kv(cache, tmp_path, model_fingerprint(MODEL))
    run(radixkv.Engine(MODEL, kv), a)
    assert kv.save() > 0
    kv.close()
    other = tiny_model(seed=12)
    fp = model_fingerprint(other)
    assert fp["weights"] != model_fingerprint(MODEL)["weights"]
    with pytest.raises(DiskMismatchError, match="weights"):
        disk_kv(radixkv.RadixCache(32, 4, 16, 64), tmp_path, fp)
    cache2 = radixkv.RadixCache(32, 4, 16, 64)
    with pytest.warns(RuntimeWarning):
        kv2 = disk_kv(cache2, tmp_path, fp, on_mismatch="reset")
    assert kv2.disk.restored_pages == 0
    engine = radixkv.Engine(other, kv2)
    assert run(engine, a).cached_tokens == 0
    kv2.close()
    # Another dtype is another layout: refused too.
    with pytest.raises(DiskMismatchError, match="dtype"):
        KVCache(
            radixkv.RadixCache(32, 4, 16, 64),
            CFG.num_layers,
            CFG.num_kv_heads,
            HEAD_DIM,
            dtype=torch.bfloat16,
            host_device="cpu",
            disk_dir=tmp_path,
            fingerprint=model_fingerprint(MODEL),
        )


def test_arguments_that_do_not_fit_are_refused(tmp_path):
    with pytest.raises(ValueError, match="pass disk_dir"):
        KVCache(radixkv.RadixCache(8, 1, 8, 8), 2, 2, 16, host_device="cpu")
    with pytest.raises(ValueError, match="disk_pages=0"):
        KVCache(radixkv.RadixCache(8, 1, 8), 2, 2, 16, host_device="cpu", disk_dir=tmp_path)
    with pytest.raises(ValueError, match="needs a host tier"):
        radixkv.RadixCache(8, 1, 0, 8)
    with pytest.raises(ValueError, match="disk tier"):
        KVCache(radixkv.RadixCache(8, 1, 8), 2, 2, 16, host_device="cpu").save()
    with pytest.raises(TypeError, match="fingerprint"):
        disk_kv(radixkv.RadixCache(8, 1, 8, 8), tmp_path, fingerprint=["not", "a", "map"])


WRITER = textwrap.dedent(
    """
    import numpy as np
    import radixkv
    from radixkv.kv.kv_cache import KVCache
    from tiny_model import ids, tiny_model
    model = tiny_model(seed=11)
    cfg = model.config
    cache = radixkv.RadixCache(24, 4, 8, 48)
    kv = KVCache(cache, cfg.num_layers, cfg.num_kv_heads, cfg.hidden_size // cfg.num_heads,
                 host_device="cpu", disk_dir={path!r})
    engine = radixkv.Engine(model, kv)
    rng = np.random.default_rng({seed})
    base = [ids(np.random.default_rng(100 + i), 40) for i in range(6)]
    print("ready", flush=True)
    i = 0
    while True:
        prompt = np.concatenate([base[int(rng.integers(0, 6))], ids(rng, int(rng.integers(1, 30)))])
        sid = engine.submit(prompt, max_new_tokens=2, stop=())
        engine.run([sid], release=True)
        i += 1
        if i % 3 == 0:
            kv.save()
    """
)


def test_a_server_killed_at_any_moment_leaves_a_directory_that_serves_exact_kv(tmp_path):
    """kill -9 of a process that serves and saves, at random moments: every reopen gives a
    consistent cache whose hits are the KV computed for them (greedy tokens equal a dense
    recompute), whatever page or index write the kill cut."""
    rng = np.random.default_rng(4)
    path = str(tmp_path / "cache")
    hits = 0
    for trial in range(4):
        script = WRITER.format(path=path, seed=trial)
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=HERE, env=ENV
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.2, 1.2)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        cache = radixkv.RadixCache(24, 4, 8, 48)
        kv = disk_kv(cache, path)
        cache.check()
        engine = radixkv.Engine(MODEL, kv)
        for i in range(3):
            prompt = np.concatenate([ids(np.random.default_rng(100 + i), 40), ids(rng, 4)])
            res = run(engine, prompt, 3)
            assert res.output == dense_greedy(MODEL, prompt, 3), f"trial {trial}, prompt {i}"
            hits += res.cached_tokens
        cache.check()
        kv.close()
    assert hits > 0, "no restart found anything on disk: the test saw nothing come back"


def test_a_failing_disk_costs_hits_not_requests(tmp_path, monkeypatch):
    """A disk that fails to write (full) or to read: the forward passes go on, every request
    gets the tokens a dense recompute gives, and a warning says what happened."""
    rng = np.random.default_rng(5)
    cache = radixkv.RadixCache(24, 4, 8, 64)
    kv = disk_kv(cache, tmp_path)
    engine = radixkv.Engine(MODEL, kv)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv.disk.pool, "write", full)
    prompts = [ids(rng, 60) for _ in range(4)]
    with pytest.warns(RuntimeWarning, match="writing the disk tier failed"):
        for p in prompts:
            assert run(engine, p).output == dense_greedy(MODEL, p, 4)
    assert kv.disk.failed is not None
    assert cache.stats.disk_written_pages > 0  # the index sent pages there: they are lost

    def broken(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(kv.disk.pool, "read", broken)
    again = np.concatenate([prompts[0], ids(rng, 2)])
    with pytest.warns(RuntimeWarning, match="reading the disk tier failed"):
        assert run(engine, again).output == dense_greedy(MODEL, again, 4)
    assert engine.stats.disk_errors >= 1
    cache.check()


def test_the_disk_calls_name_their_bad_arguments_and_change_nothing():
    cache = radixkv.RadixCache(8, 4, 4, 32)
    for args, err, match in (
        ((1, -1), ValueError, "good must be >= 0, got -1"),
        ((-2, 0), ValueError, "id must be >= 0, got -2"),
        (("x", 0), TypeError, "id must be an int"),
        ((1, 1.5), TypeError, "good must be an int"),
        ((1, 0), ValueError, "no prefetch 1 is in progress"),
    ):
        with pytest.raises(err, match=match):
            cache.disk_confirm(*args)
    with pytest.raises(ValueError, match="at least one token"):
        cache.disk_prefetch([])
    with pytest.raises(ValueError, match="32 bytes for each of the 1 slots, got 31"):
        cache.disk_restore(b"x" * 31, [0])
    with pytest.raises(ValueError, match="slot 99, past disk_pages=32"):
        cache.disk_restore(b"x" * 32, [99])
    with pytest.raises(ValueError, match="no disk tier"):
        radixkv.RadixCache(8, 4, 4).disk_prefetch([1, 2, 3])
    cache.check()
    s = cache.stats
    assert (s.disk_free_pages, s.host_free_pages, len(cache.disk_entries()[1])) == (32, 4, 0)


def test_a_model_fingerprint_holds_what_the_kv_depends_on_not_where_it_came_from(tmp_path):
    """The same transformers model saved, moved and loaded again (another ``_name_or_path``),
    or by another transformers (``transformers_version``), has the same fingerprint, so a
    directory it wrote is found again; a config field that changes the math differs, and the
    mismatch names that field alone."""
    from hf_models import build_model, save_model

    transformers = pytest.importorskip("transformers")
    model = build_model("llama", seed=5)
    fp = model_fingerprint(model)
    saved = save_model(model, tmp_path / "here")
    moved = tmp_path / "elsewhere"
    os.rename(saved, moved)
    again = transformers.AutoModelForCausalLM.from_pretrained(moved, dtype=torch.float32)
    again.config.transformers_version = "0.0.1"
    assert again.config.to_dict()["_name_or_path"] == str(moved)
    assert model_fingerprint(again) == fp
    changed = build_model("llama", seed=5, rms_norm_eps=1e-3)
    other = model_fingerprint(changed)
    assert other["weights"] == fp["weights"] and other["config"] != fp["config"]
    kv = lambda fingerprint: KVCache(  # noqa: E731
        radixkv.RadixCache(8, 4, 8, 16),
        2,
        2,
        16,
        host_device="cpu",
        disk_dir=tmp_path / "d",
        fingerprint=fingerprint,
    )
    for fingerprint in (fp, model_fingerprint(again)):  # the moved model opens the directory
        k = kv(fingerprint)
        k.save()  # a manifest, with the fingerprint
        k.close()
    with pytest.raises(DiskMismatchError) as e:
        kv(other)
    assert list(e.value.differences) == ["fingerprint['model']['config']['rms_norm_eps']"]
