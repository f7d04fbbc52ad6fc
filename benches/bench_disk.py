"""bench_disk: the disk tier, in one run: an agent session across a server restart, the disk's
bandwidth here, a disk hit against recompute per context length, and the Mooncake trace's hit
rate by tier against a device pool of the same total size.

    .venv/bin/python benches/bench_disk.py [--quick] [--threads K] [--dir DIR]

1. Restart (real model: SmolLM2-135M-Instruct, float32, CPU; the real ``radixkv serve`` and the
   ``openai`` client): an agent session (a system prompt with tool schemas, tool outputs) runs
   its first turns on a server with ``--cache-dir``; the server gets SIGTERM (it saves its disk
   tier) and a new server starts on the directory; the next turn's ``cached_tokens`` and time to
   first token are printed beside the same turn on a server started cold (an empty directory).
2. Disk bandwidth: pages of SmolLM2's size (16 tokens, 720 KiB) written through a ``DiskPool``
   (checksummed, one ``pwrite`` each, then fsync) and read back cold (the file's pages dropped
   from the OS page cache with ``posix_fadvise``), pages/s and GB/s.
3. A disk hit against recompute, per context length (SmolLM2): the time to first token of a
   request whose context a previous process saved (read back, loaded, 8 new tokens computed),
   against the same request computed from scratch; where the disk starts to win here, and on a
   GPU from FLOPs and stated bandwidths (Llama-3-8B, bf16).
4. Replay of the Mooncake trace: a device pool with a host and a disk tier against one device
   pool holding as many pages, hit rates by tier (goal: the tiers keep >= 0.95x the big pool's
   hit rate), reads costed at a stated NVMe bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python" / "support"))
sys.path.insert(0, str(ROOT / "benches"))

import numpy as np  # noqa: E402

from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path  # noqa: E402
from radixkv.kv.tiers.disk_pool import DiskPool  # noqa: E402

#: Stated, not measured: the GPU projection's numbers (section 3).
GPU_FLOPS = 400e12  # H100/H200 bf16 dense at ~40% of its 989 TFLOP/s peak, a prefill's MFU
NVME_BPS = 5e9  # one PCIe 4.0 NVMe drive, sequential reads
PCIE_BPS = 25e9  # pinned host memory to the GPU over PCIe 4.0 x16
LLAMA8B = dict(params=8.03e9, layers=32, attn_dim=4096, kv_bytes=131_072)


# ---- 1. restart ------------------------------------------------------------------------------


def serve(port: int, cache_dir: Path, threads: int, num_pages: int) -> subprocess.Popen:
    """The real server on ``cache_dir``, once it answers."""
    import serve_process

    args = ["--num-pages", str(num_pages), "--page-size", "16", "--host-pages", str(num_pages)]
    return serve_process.start(
        port, *args, "--cache-dir", str(cache_dir), threads=threads, timeout=300
    )


def stop(proc: subprocess.Popen) -> float:
    """SIGTERM, then the seconds until it exited (it saves its disk tier first)."""
    import serve_process

    t0 = time.perf_counter()
    rc, err = serve_process.stop(proc, timeout=300)
    if rc != 0:
        raise RuntimeError(f"radixkv serve exited {rc}: {err}")
    return time.perf_counter() - t0


def turn(port: int, messages: list[dict], max_tokens: int) -> tuple[str, float, int, int]:
    """One streamed chat turn: (reply, ttft s, prompt tokens, cached tokens)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft, text, prompt, cached = None, [], 0, 0
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                ttft = ttft or time.perf_counter() - t0
                text.append(c.delta.content)
        if chunk.usage is not None:
            prompt = chunk.usage.prompt_tokens
            cached = chunk.usage.prompt_tokens_details.cached_tokens or 0
    return "".join(text), ttft or time.perf_counter() - t0, prompt, cached


def restart(args, work: Path) -> None:
    from bench_serve import system_prompt, tool_output
    from serve_process import free_port

    turns, tools, lines, max_tokens = (1, 4, 4, 4) if args.quick else (3, 12, 12, 12)
    messages = [
        {"role": "system", "content": system_prompt(tools)},
        {"role": "user", "content": "Session 0: fix the failing tests."},
    ]
    port = free_port()
    proc = serve(port, work / "restart", args.threads, 2048)
    try:
        for t in range(turns):
            reply, _, _, _ = turn(port, messages, max_tokens)
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Tool output:\n" + tool_output(0, t, lines)},
            ]
        stop_s = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Allocated bytes: the data file is preallocated sparse, so its size is not what it holds.
    saved = sum(f.stat().st_blocks * 512 for f in (work / "restart").iterdir())
    rows = {}
    for name, d in (("restarted on the directory", work / "restart"), ("cold", work / "cold")):
        port = free_port()
        t0 = time.perf_counter()
        proc = serve(port, d, args.threads, 2048)
        up = time.perf_counter() - t0
        try:
            rows[name] = (*turn(port, messages, max_tokens), up)
            stop(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
    print(
        f"== 1. restart: an agent session's turn {turns + 1} after the server restarted "
        f"(SmolLM2-135M float32, {args.threads} threads; SIGTERM and save took {stop_s:.2f} s, "
        f"the directory holds {saved / 2**20:.0f} MiB)"
    )
    print(f"{'':30}{'prompt':>8}{'cached':>8}{'TTFT s':>9}{'start s':>9}{'same text':>11}")
    cold_text = rows["cold"][0]
    for name, (text, ttft, prompt, cached, up) in rows.items():
        same = "yes" if text == cold_text else "NO"
        print(f"{name:30}{prompt:>8}{cached:>8}{ttft:>9.3f}{up:>9.1f}{same:>11}")
    warm, cold = rows["restarted on the directory"], rows["cold"]
    print(f"TTFT cold / restarted: {cold[1] / warm[1]:.2f}x")


# ---- 2. bandwidth ----------------------------------------------------------------------------


def drop_page_cache(path: Path) -> bool:
    """Asks the OS to drop ``path``'s cached pages (they are clean after an fsync)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def bandwidth(args, work: Path) -> None:
    page_bytes = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: 30 layers, K and V, 16 tokens, 3 x 64, f32
    n = 32 if args.quick else 1024
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(min(n, 64))]
    keys = [i.to_bytes(4, "little") * 8 for i in range(n)]
    path = work / "bandwidth"
    with DiskPool(path, n, page_bytes, {"bench": 1}) as pool:
        t0 = time.perf_counter()
        for i in range(n):
            pool.write(i, keys[i], payloads[i % len(payloads)])
        pool.flush()
        write_s = time.perf_counter() - t0
        cold = drop_page_cache(path / "pages.bin")
        t0 = time.perf_counter()
        got = pool.read(np.arange(n), b"".join(keys))
        read_s = time.perf_counter() - t0
        assert all(g is not None for g in got), "a page written here read back bad"
        t0 = time.perf_counter()
        pool.read(np.arange(n), b"".join(keys))
        warm_s = time.perf_counter() - t0
    mb = n * page_bytes / 1e9
    print(
        f"== 2. disk bandwidth here: {n} pages of {page_bytes / 2**10:.0f} KiB (SmolLM2, 16 "
        "tokens), checksummed"
    )
    print(f"write + fsync : {n / write_s:>9.0f} pages/s  {mb / write_s:>6.2f} GB/s")
    label = "read, cold    " if cold else "read (cached?)"
    print(f"{label}: {n / read_s:>9.0f} pages/s  {mb / read_s:>6.2f} GB/s")
    print(f"read, cached  : {n / warm_s:>9.0f} pages/s  {mb / warm_s:>6.2f} GB/s")


# ---- 3. disk hit against recompute -----------------------------------------------------------


def hit_vs_recompute(args, work: Path) -> None:
    import torch

    import radixkv.hf
    from radixkv.kv.tiers.fingerprint import model_fingerprint

    torch.set_num_threads(args.threads)
    model, _ = radixkv.hf.load("smollm2")
    fp = model_fingerprint(model)
    lengths = (256, 1024) if args.quick else (256, 1024, 2048, 4096)
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    print(
        "== 3. time to first token: the context read back from disk (saved by another cache) "
        "against computed again, + 8 new tokens, 1 output token (SmolLM2 float32, "
        f"{args.threads} threads)"
    )
    print(f"{'context':>8}{'disk hit s':>12}{'of it: read':>12}{'recompute s':>13}{'ratio':>8}")
    crossover = None
    for n in lengths:
        ctx = rng.integers(0, vocab, n).astype(np.uint32)
        new = rng.integers(0, vocab, 8).astype(np.uint32)
        d = work / f"ttft-{n}"
        pages = n // 16 + 8
        cache = radixkv.RadixCache(pages, 16, pages, 2 * pages)
        eng = radixkv.hf.engine(model, cache, disk_dir=d)
        eng.run([eng.submit(ctx, max_new_tokens=1, stop=())], release=True)
        eng.kv.save()
        eng.kv.close()
        drop_page_cache(d / "pages.bin")
        cache = radixkv.RadixCache(pages, 16, pages, 2 * pages)
        from radixkv.hf._adapter import HFCausalLM, make_kv_cache

        kv = make_kv_cache(HFCausalLM(model).spec, cache, d, fp)
        eng = radixkv.Engine(HFCausalLM(model), kv)
        t0 = time.perf_counter()
        (res,) = eng.run([eng.submit(np.concatenate([ctx, new]), 1, stop=())], release=True)
        hit = time.perf_counter() - t0
        read = eng.stats.disk_s
        kv.close()
        cold = radixkv.hf.engine(model, radixkv.RadixCache(pages, 16))
        t0 = time.perf_counter()
        cold.run([cold.submit(np.concatenate([ctx, new]), 1, stop=())], release=True)
        recompute = time.perf_counter() - t0
        assert res.cached_tokens >= n - 16, (res.cached_tokens, n)
        if crossover is None and hit < recompute:
            crossover = n
        print(f"{n:>8}{hit:>12.3f}{read:>12.3f}{recompute:>13.3f}{recompute / hit:>7.1f}x")
    here = f"from {crossover} tokens on (the shortest tried)" if crossover else "at none tried"
    print(f"here a disk hit wins {here}")
    m = LLAMA8B
    per_token_read = m["kv_bytes"] / NVME_BPS + m["kv_bytes"] / PCIE_BPS
    for n in (1024, 32768):
        # Recomputing a prefix of n tokens: 2 FLOPs a parameter a token, plus attention's
        # QK^T and AV over an average of n/2 earlier tokens (4 FLOPs a key a dim a layer).
        flops = n * (2 * m["params"] + 4 * (n / 2) * m["attn_dim"] * m["layers"])
        compute = flops / GPU_FLOPS
        read = n * per_token_read
        print(
            f"GPU projection, Llama-3-8B bf16, {n}-token context: recompute {compute * 1e3:.1f} ms "
            f"at {GPU_FLOPS / 1e12:.0f} TFLOP/s, read back {read * 1e3:.1f} ms at "
            f"{NVME_BPS / 1e9:g} GB/s NVMe + {PCIE_BPS / 1e9:g} GB/s PCIe: "
            f"{compute / read:.1f}x"
        )
    print(
        f"(per token: read {per_token_read * 1e6:.1f} us against at least "
        f"{2 * m['params'] / GPU_FLOPS * 1e6:.1f} us of compute, so with these numbers a disk "
        "hit wins on a GPU at every length; the attention term only widens the gap)"
    )


# ---- 4. replay -------------------------------------------------------------------------------


def replay_tiers(args) -> None:
    from radixkv.apps.common.trace import SAMPLE_TRACE, read_trace
    from radixkv.apps.replay.simulate import ReplayConfig, replay

    # The whole trace where this checkout sits beside it, else the sample in the package.
    trace = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    if args.quick or not trace.exists():
        trace = SAMPLE_TRACE
    requests = list(read_trace(trace, limit=400 if args.quick else None))
    dev, host, disk = (2048, 2048, 16384) if args.quick else (32768, 32768, 196608)
    total = dev + host + disk
    rows = [
        ("device only, same total", ReplayConfig(num_pages=total)),
        (
            "device + host + disk",
            ReplayConfig(num_pages=dev, host_pages=host, disk_pages=disk),
        ),
        ("device + host, no disk", ReplayConfig(num_pages=dev, host_pages=host)),
        ("device only, small", ReplayConfig(num_pages=dev)),
    ]
    print(
        f"== 4. replay: {len(requests)} Mooncake requests, lpm, page 16; tiers "
        f"{dev}+{host}+{disk} pages against one pool of {total}; reads at "
        f"{ReplayConfig().disk_bandwidth / 1e9:g} GB/s, loads at "
        f"{ReplayConfig().host_bandwidth / 1e9:g} GB/s (stated), 128 KiB/token"
    )
    print(
        f"{'':26}{'hit rate':>9}{'device':>8}{'host':>8}{'disk':>8}{'ttft p50':>10}{'ttft p99':>10}"
    )
    results = {}
    for name, cfg in rows:
        r = replay(requests, cfg)
        results[name] = r
        print(
            f"{name:26}{r.hit_rate:>9.2%}{r.device_hit_rate:>8.2%}{r.host_hit_rate:>8.2%}"
            f"{r.disk_hit_rate:>8.2%}{r.percentile('ttfts', 50):>9.2f}s"
            f"{r.percentile('ttfts', 99):>9.2f}s"
        )
    big, tiers = results["device only, same total"], results["device + host + disk"]
    ratio = tiers.hit_rate / big.hit_rate if big.hit_rate else float("nan")
    verdict = "met" if ratio >= 0.95 else "short"
    if args.quick:  # pools this small queue most of 400 requests: the ratio says nothing
        verdict = "not judged with --quick"
    print(f"tiers / same-size device pool, hit rate: {ratio:.3f}x (goal >= 0.95x: {verdict})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few seconds' worth (smoke runs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the disk tiers go (default: a temp dir)")
    args = ap.parse_args(argv)
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-disk-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        real = smollm2_path() is not None
        if real:
            restart(args, work)
        else:
            print(f"== 1. restart: skipped: the real model is not installed: {SMOLLM2_INSTALL}")
        bandwidth(args, work)
        if real:
            hit_vs_recompute(args, work)
        else:
            print("== 3. disk hit against recompute: skipped (no real model)")
        replay_tiers(args)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
