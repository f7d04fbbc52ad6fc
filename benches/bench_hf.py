"""radixkv.hf on a transformers model: a 10-turn agent session, time to first token per turn.

    .venv/bin/python benches/bench_hf.py [--quick] [--threads N] [--device cpu|cuda]

One conversation (a system prompt; each turn a user message, a generated reply and a tool
output appended), on a small Llama-shaped transformers model with random weights built locally.
Every turn's prompt is the whole conversation so far. Each turn is served, in the same run, by:

- ``plain``: ``model.generate`` with no reuse: the baseline every ratio divides by;
- ``prefix``: :class:`radixkv.hf.PrefixCache` ``.generate`` (transformers' own forward, the
  cached prefix handed to it as a DynamicCache);
- ``engine``: :func:`radixkv.hf.engine` (radixkv's paged attention and batching);
- ``cb``: transformers' continuous batching (``generate_batch``, one persistent manager, block
  sharing on, pages of 16 tokens), when the installed transformers has it.

The methods take turns within each turn of the conversation (``plain`` first, whose reply then
extends it), so every method sees the same prompts and a slow moment of a shared machine hits
them alike. Printed per turn: TTFT of each method over ``plain``'s, and two bounds of what
reuse can save at best: the tokens computed over the prompt's, and the FLOPs (``flops``: the
linear layers' per token, plus attention's, which grows with each token's position, so a
computed token late in a long context costs more than the average one). Replies are
checked token for token against ``plain``. Benchmarks are not tests: nothing asserts a time.
Turn 1 has nothing cached: its ratios show each method's fixed cost.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from typing import Any, ClassVar

import numpy as np

try:
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    import radixkv
    import radixkv.hf
    from shapes import NAMES, build, dtype_of
except ImportError as e:  # an install without the [hf] extra: nothing to measure
    print(f"bench_hf: skipped ({e}); pip install radixkv[hf]")
    sys.exit(0)

import graph_counters
from common import table


class FirstToken(BaseStreamer):
    """Records when ``generate`` emits its first new token (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def flops(cfg: Any, start: int, end: int) -> float:
    """Forward FLOPs of the prompt tokens at positions ``start .. end - 1`` with the KV of the
    positions before them at hand: per token the linear layers (2 a weight: q, k, v, o, the
    gated MLP) and attention's QK and AV over the ``i + 1`` keys of position ``i``."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    linear = 2 * layers * (h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size)
    n = end - start
    keys = (start + 1 + end) * n / 2  # the sum of i + 1 over the positions
    return n * linear + layers * 4 * q * keys


def build_model(args: argparse.Namespace) -> Any:
    """A Llama-shaped model with random weights (seeded), in eval mode: ``--shape`` by name
    (``benches/shapes.py``, built on the device), or of ``--hidden``/``--layers``/``--vocab``."""
    dtype = dtype_of(args.dtype)
    if args.shape is not None:
        return build(args.shape, args.device, dtype)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64 or 1,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=8192,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.to(args.device).eval()


def conversation(args: argparse.Namespace) -> tuple[np.ndarray, list[tuple[np.ndarray, ...]]]:
    """The system prompt and each turn's (user message, tool output)."""
    rng = np.random.default_rng(0)
    system = rng.integers(0, args.vocab, args.system)
    turns = [
        (rng.integers(0, args.vocab, args.message), rng.integers(0, args.vocab, args.tool))
        for _ in range(args.turns)
    ]
    return system, turns


def timed_generate(fn: Any, ids: torch.Tensor, reply: int) -> tuple[float, list[int]]:
    """(TTFT in seconds, the new tokens) of one ``generate``-like call."""
    streamer = FirstToken()
    sync()
    t0 = time.perf_counter()
    out = fn(ids, max_new_tokens=reply, do_sample=False, streamer=streamer)
    sync()
    assert streamer.first is not None
    return streamer.first - t0, out[0, ids.shape[1] :].tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Plain:
    """The baseline: ``model.generate`` recomputing the whole prompt every turn."""

    def __init__(self, model, args) -> None:
        self.model, self.args = model, args

    def turn(self, prompt: np.ndarray) -> tuple[float, list[int], int]:
        ids = torch.as_tensor(prompt, device=self.args.device)[None]
        t, out = timed_generate(self.model.generate, ids, self.args.reply)
        return t, out, 0


class Prefix:
    """:class:`radixkv.hf.PrefixCache` ``.generate``."""

    def __init__(self, model, args, tokens: int) -> None:
        cache = radixkv.RadixCache(tokens, page_size=1)
        self.prefix, self.args = radixkv.hf.PrefixCache(model, cache), args

    def turn(self, prompt: np.ndarray) -> tuple[float, list[int], int]:
        ids = torch.as_tensor(prompt, device=self.args.device)[None]
        t, out = timed_generate(self.prefix.generate, ids, self.args.reply)
        return t, out, self.prefix.last_cached


class EngineRun:
    """:func:`radixkv.hf.engine`: radixkv's engine and paged attention."""

    #: Every engine made (their CUDA graph counters are printed at the end).
    made: ClassVar[list[Any]] = []

    def __init__(self, model, args, tokens: int) -> None:
        cache = radixkv.RadixCache(tokens, page_size=1)
        self.eng, self.args = radixkv.hf.engine(model, cache, token_budget=tokens), args
        EngineRun.made.append(self.eng)

    def turn(self, prompt: np.ndarray) -> tuple[float, list[int], int]:
        (r,) = self.eng.generate([prompt], max_new_tokens=self.args.reply, release=True)
        sync()
        return r.ttft_s, r.output, r.cached_tokens


class ContinuousBatching:
    """transformers' continuous batching (``generate_batch``), one persistent manager for the
    whole session, block sharing on, pages of 16 tokens. TTFT: from the call to the first
    token's timestamp (the manager's start included: that is what a caller of this API waits)."""

    def __init__(self, model, args, tokens: int) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        for name in ("ContinuousBatchingLogger", "transformers"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        transformers.logging.set_verbosity_error()
        page = 16
        self.model, self.args = model, args
        self.gen = GenerationConfig(max_new_tokens=args.reply, do_sample=False, eos_token_id=-1)
        self.cb = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=2 * (tokens // page + 1) + 64,
            max_batch_tokens=tokens,
            allow_block_sharing=True,
        )

    def turn(self, prompt: np.ndarray) -> tuple[float, list[int], int]:
        sync()
        t0 = time.perf_counter()
        res = self.model.generate_batch(
            [prompt.tolist()],
            generation_config=self.gen,
            continuous_batching_config=self.cb,
            record_timestamps=True,
            persistent_manager=True,
            warmup=False,
            max_new_tokens=self.args.reply,
        )
        (out,) = res.values()
        if out.error is not None or not out.timestamps:
            raise RuntimeError(f"generate_batch failed: {out.error}")
        return out.timestamps[0] - t0, list(out.generated_tokens), -1

    def close(self) -> None:
        if hasattr(self.model, "destroy_cached_continuous_batching_manager"):
            self.model.destroy_cached_continuous_batching_manager()


def session(model, system, turns, args) -> dict[str, Any]:
    """Plays the session, the methods interleaved turn by turn (so that a slow moment of a
    shared machine hits them alike): ``plain`` first, whose reply extends the conversation,
    then each other method on the same prompt. Returns per method: ttft, outputs, cached."""
    longest = len(system) + len(turns) * (args.message + args.reply + args.tool) + 64
    wanted = set(args.methods.split(",")) | {"plain"}
    methods: dict[str, Any] = {"plain": Plain(model, args)}
    if "prefix" in wanted:
        methods["prefix"] = Prefix(model, args, longest)
    if "engine" in wanted:
        methods["engine"] = EngineRun(model, args, longest)
    notes: list[str] = []
    if "cb" not in wanted:
        pass
    elif hasattr(model, "generate_batch"):
        methods["cb"] = ContinuousBatching(model, args, longest)
    else:
        notes.append(f"cb: transformers {transformers.__version__} has no generate_batch")
    got: dict[str, dict[str, list]] = {k: {"ttft": [], "out": [], "cached": []} for k in methods}
    history, prompts = system, []
    try:
        for message, tool in turns:
            prompt = np.concatenate([history, message])
            prompts.append(prompt)
            for name, method in list(methods.items()):
                try:
                    t, out, cached = method.turn(prompt)
                except Exception as e:  # an API that changed, a device it does not support
                    notes.append(f"{name}: failed: {type(e).__name__}: {e}")
                    del methods[name], got[name]
                    continue
                got[name]["ttft"].append(t)
                got[name]["out"].append(out)
                got[name]["cached"].append(cached)
            history = np.concatenate([prompt, got["plain"]["out"][-1], tool])
    finally:
        if "cb" in methods:
            methods["cb"].close()
    return {"prompts": prompts, "runs": got, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model and 3 turns (smoke run)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system", type=int, default=1024, help="system prompt tokens")
    ap.add_argument("--message", type=int, default=64, help="user message tokens per turn")
    ap.add_argument("--reply", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--tool", type=int, default=128, help="tool output tokens per turn")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument(
        "--shape",
        default=None,
        choices=NAMES,
        help="a named model instead (benches/shapes.py; smollm2: the real weights)",
    )
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--methods", default="prefix,engine,cb", help="besides plain, comma-separated")
    args = ap.parse_args(argv)
    if args.quick:
        args.turns, args.system, args.message, args.reply, args.tool = 3, 64, 16, 4, 16
        args.hidden, args.layers, args.vocab = 128, 2, 512
    torch.set_num_threads(args.threads)
    model = build_model(args)
    cfg = model.config
    args.vocab = cfg.vocab_size
    system, turns = conversation(args)
    print(
        f"bench_hf: transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{args.device}, {args.threads} thread(s); Llama-shaped model"
        f"{' (' + args.shape + ')' if args.shape else ''}: {cfg.num_hidden_layers} layers, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.dtype}"
    )
    print(
        f"session: system {args.system} tokens, {args.turns} turns of message {args.message} + "
        f"reply {args.reply} + tool output {args.tool}"
    )
    # Warm-up: first calls pay one-off costs (allocator, kernels) that no method should carry.
    warm = np.arange(48) % args.vocab
    session(model, warm[:16], [(warm[16:], warm[:0])] * 2, args)

    res = session(model, system, turns, args)
    prompts, runs = res["prompts"], res["runs"]
    plain = runs["plain"]["ttft"]
    cached = runs["prefix" if "prefix" in runs else "engine"]["cached"]
    others = [k for k in ("prefix", "engine", "cb") if k in runs]

    headers = [
        "turn",
        "prompt",
        "cached",
        "plain",
        *(f"{k}/plain" for k in others),
        "token bound",
        "FLOP bound",
    ]
    rows = []
    for i, prompt in enumerate(prompts):
        bound = (len(prompt) - cached[i]) / len(prompt)
        fbound = flops(cfg, cached[i], len(prompt)) / flops(cfg, 0, len(prompt))
        ratios = [f"{runs[k]['ttft'][i] / plain[i]:.3f}" for k in others]
        row = [str(i + 1), str(len(prompt)), str(cached[i]), f"{plain[i] * 1e3:.1f} ms"]
        rows.append([*row, *ratios, f"{bound:.3f}", f"{fbound:.3f}"])
    print("\nTTFT per turn over plain model.generate (no reuse), and what the tokens and the FLOPs")
    print("computed with the cache are of the whole prompt's")
    table(headers, rows)
    later = slice(1, None)
    bound = sum(flops(cfg, c, len(p)) for p, c in zip(prompts[later], cached[later])) / sum(
        flops(cfg, 0, len(p)) for p in prompts[later]
    )
    plain_sum = sum(plain[later])
    parts = [f"{k} {sum(runs[k]['ttft'][later]) / plain_sum:.3f}" for k in others]
    print(
        f"turns 2-{len(prompts)}, summed TTFT over plain: {', '.join(parts)}; "
        f"FLOP bound {bound:.3f}"
    )
    for note in res["notes"]:
        print(note)
    if "engine" in runs:
        graphs = graph_counters.counters(EngineRun.made)
        print(graph_counters.line(graphs, args.device, "(the engine's decode steps)"))
        over = sum(runs["engine"]["ttft"][later]) / plain_sum / bound
        verdict = "holds" if over <= 1.1 else "short"
        if not graph_counters.ok(graphs, args.device):
            verdict = "short: CUDA graphs not captured and replayed"
        print(
            f"target: engine TTFT of turns 2+ within 1.1x of the FLOP bound (summed TTFT over "
            f"plain's, over the share of the FLOPs computed): {over:.2f}x ({verdict})"
        )
    replies = runs["plain"]["out"]
    same = ", ".join(f"{k} {'yes' if runs[k]['out'] == replies else 'NO'}" for k in others)
    print(f"replies identical to plain: {same}")
    print(f"median plain TTFT {statistics.median(plain) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
