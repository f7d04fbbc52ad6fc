"""``radixkv demo``: an agent session on the built-in model, run with the prefix cache and without.
(``--random``, ``--checkpoint`` and ``--model``; the default real-model session in real text is
:mod:`radixkv.apps.demo.real`.)

The scenario (synthetic token ids, the same for both runs):

```text
  system prompt + tool schemas (thousands of tokens)
  turn 1: user message -> reply -> tool output
  ...
  turn k: N sub-agents branch from the whole context (each: task + document -> report);
          their reports join the context as tool output
  ...
  turn T: the prompt is the whole conversation so far (it grows past the pool's comfort)
```

"Caching off" is the same engine with ``prefix_caching=False``: every admission gets a private
namespace (nothing is ever found cached), so each branch computes the whole context again.
Greedy decoding makes both runs produce the same tokens, which the demo checks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import radixkv
from radixkv.apps.common.args import table_header
from radixkv.engine.engine import Engine
from radixkv.engine.sequence import Result
from radixkv.engine.session import Session
from radixkv.models import CausalLM, ModelConfig, load_checkpoint

#: Ids below this are left alone (special tokens of a real vocabulary).
FIRST_ID = 16


@dataclass(frozen=True)
class Scenario:
    """Sizes of the agent session (token counts)."""

    system: int = 2000
    turns: int = 8
    message: tuple[int, int] = (60, 140)
    tool_output: tuple[int, int] = (150, 300)
    reply: int = 16
    branch_turn: int = 4
    branches: int = 4
    branch_task: int = 60
    branch_doc: int = 256
    seed: int = 0

    @classmethod
    def quick(cls) -> Scenario:
        """A few seconds' worth, for tests."""
        return cls(
            system=320,
            turns=3,
            message=(20, 40),
            tool_output=(30, 60),
            reply=6,
            branch_turn=1,
            branches=2,
            branch_task=16,
            branch_doc=40,
        )


@dataclass
class Script:
    """The token ids of every message, drawn once so that both runs see the same ones."""

    system: np.ndarray
    messages: list[np.ndarray]
    tool_outputs: list[np.ndarray]
    branch_prompts: list[np.ndarray]

    @classmethod
    def draw(cls, sc: Scenario, vocab_size: int) -> Script:
        """Random token ids in ``[FIRST_ID, vocab_size)``."""
        rng = np.random.default_rng(sc.seed)

        def ids(n: int) -> np.ndarray:
            return rng.integers(FIRST_ID, vocab_size, n, dtype=np.int64).astype(np.uint32)

        def between(lo_hi: tuple[int, int]) -> np.ndarray:
            return ids(int(rng.integers(lo_hi[0], lo_hi[1] + 1)))

        return cls(
            system=ids(sc.system),
            messages=[between(sc.message) for _ in range(sc.turns)],
            tool_outputs=[between(sc.tool_output) for _ in range(sc.turns)],
            branch_prompts=[ids(sc.branch_task + sc.branch_doc) for _ in range(sc.branches)],
        )


#: Namespace of the warm-up request (:func:`warm_up`), which no request of a session shares.
WARMUP_NAMESPACE = "radixkv.demo.warmup"


@dataclass
class Run:
    """What one pass over the script reported, per request in script order. ``evicted``: pages
    evicted so far after each request; ``hit_rate`` and ``evicted_pages``: the cache's token hit
    rate and evictions over the pass (what came before it, a warm-up, left out); ``stats``: the
    cache's counters at its end, since the cache was made."""

    labels: list[str] = field(default_factory=list)
    results: list[Result] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    stats: radixkv.CacheStats | None = None
    hit_rate: float = 0.0
    evicted_pages: int = 0


class Counters:
    """The cache's counters from now on: a snapshot taken when made, subtracted later."""

    def __init__(self, cache: radixkv.Cache) -> None:
        self.cache, self.base = cache, cache.stats

    def evicted(self) -> int:
        """Pages evicted since the snapshot."""
        return self.cache.stats.evicted_pages - self.base.evicted_pages

    def close(self, run: Run) -> None:
        """Fills ``run``'s ``stats``, ``hit_rate`` and ``evicted_pages`` (since the snapshot)."""
        s, b = self.cache.stats, self.base
        queried = s.query_tokens - b.query_tokens
        run.stats = s
        run.hit_rate = (s.hit_tokens - b.hit_tokens) / queried if queried else 0.0
        run.evicted_pages = s.evicted_pages - b.evicted_pages


def warm_up(engine: Engine, prompt: np.ndarray) -> None:
    """One throwaway request of ``prompt`` (the size of the session's first prefill) in a
    namespace of its own, so that one-time costs (the allocator, kernels for that shape, thread
    pools) are paid before anything is timed; then its pages are dropped (``cache.reset()``), so
    the timed session starts on an empty pool. The demo warms both engines, cache on and off,
    before it times either."""
    seq = engine.submit(prompt, max_new_tokens=2, namespace=WARMUP_NAMESPACE)
    engine.run([seq], release=True)
    engine.cache.reset()


def build_model(checkpoint: str | None, device: str, quick: bool) -> CausalLM:
    """The built-in random model (smaller with ``quick``), or a local HF checkpoint."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if checkpoint:
        return load_checkpoint(checkpoint, dtype=dtype, device=device)
    cfg = ModelConfig()
    if quick:
        cfg = cfg.replace(
            hidden_size=128, intermediate_size=344, num_layers=2, num_heads=4, vocab_size=4096
        )
    return CausalLM.random(cfg, seed=0, dtype=dtype, device=device)


def build_hf_model(directory: str, device: str) -> torch.nn.Module:
    """A local transformers checkpoint (``AutoModelForCausalLM``) wrapped for radixkv's engine
    (:class:`radixkv.hf.HFCausalLM`). ``ImportError`` without transformers; ``ValueError``
    saying why for a model radixkv.hf cannot serve; whatever transformers raises for a
    directory it cannot load."""
    import transformers

    import radixkv.hf

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    major = int(transformers.__version__.split(".")[0])
    kw = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(directory, **kw)
    model = model.to(device)
    return radixkv.hf.HFCausalLM(model.eval())


def describe_model(model: torch.nn.Module) -> str:
    """Layers, width, heads and vocabulary of the built-in model or a transformers one."""
    cfg: Any = model.config
    layers = getattr(cfg, "num_layers", None) or cfg.num_hidden_layers
    heads = getattr(cfg, "num_heads", None) or cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_kv_heads", None) or getattr(cfg, "num_key_value_heads", heads)
    kind = getattr(cfg, "model_type", "")
    name = f"{kind} " if isinstance(kind, str) and kind else ""
    return (
        f"{name}{layers} layers, hidden {cfg.hidden_size}, {heads} q / {kv_heads} kv heads, "
        f"vocab {cfg.vocab_size}"
    )


def run_script(engine: Engine, script: Script, sc: Scenario, progress=None) -> Run:
    """Plays the agent session on ``engine`` (warmed up first: :func:`warm_up`); one progress
    tick per request."""
    run = Run()
    counters = Counters(engine.cache)
    start = time.perf_counter()

    def record(label: str, result: Result) -> None:
        run.labels.append(label)
        run.results.append(result)
        run.evicted.append(counters.evicted())
        if progress is not None:
            progress.update(1)

    session = Session(engine, system=script.system)
    for turn in range(sc.turns):
        if turn == sc.branch_turn and sc.branches:
            reports = session.branch(script.branch_prompts, max_new_tokens=sc.reply)
            for i, r in enumerate(reports):
                record(f"sub {i + 1}", r)
            session.append(np.concatenate([np.asarray(r.output, np.uint32) for r in reports]))
        record(f"turn {turn + 1}", session.send(script.messages[turn], max_new_tokens=sc.reply))
        session.append(script.tool_outputs[turn])
    run.seconds = time.perf_counter() - start
    counters.close(run)
    return run


def format_table(on: Run, off: Run) -> str:
    """One line per request: tokens, and TTFT with the cache and without; each column's unit
    under its name (evicted: pages evicted so far in the run)."""
    lines = table_header(
        [
            ("request", "", -8),
            ("prompt", "tokens", 7),
            ("cached", "tokens", 7),
            ("computed", "tokens", 8),
            ("TTFT on", "ms", 9),
            ("TTFT off", "ms", 9),
            ("speedup", "x", 7),
            ("evicted", "pages", 7),
        ]
    )
    for label, a, b, ev in zip(on.labels, on.results, off.results, on.evicted):
        if a.ttft_s is None or b.ttft_s is None:
            lines.append(
                f"{label:<8} {a.prompt_tokens:>7}  no first token: on {a.finish_reason},"
                f" off {b.finish_reason}"
            )
            continue
        ta, tb = a.ttft_s * 1e3, b.ttft_s * 1e3
        lines.append(
            f"{label:<8} {a.prompt_tokens:>7} {a.cached_tokens:>7} "
            f"{a.computed_tokens:>8} {ta:>7.1f}ms {tb:>7.1f}ms "
            f"{tb / max(ta, 1e-9):>6.1f}x {ev:>7}"
        )
    return "\n".join(lines)


def draw_chart(on: Run, off: Run, path: Path, title: str) -> Path:
    """Bars of TTFT per request, cache on and off, as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = np.arange(len(on.labels))
    ms_on = [(r.ttft_s or 0.0) * 1e3 for r in on.results]
    ms_off = [(r.ttft_s or 0.0) * 1e3 for r in off.results]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(x) + 2), 4.2))
    ax.bar(x - 0.2, ms_off, 0.4, label="caching off", color="#b0b0b0")
    ax.bar(x + 0.2, ms_on, 0.4, label="radixkv prefix cache", color="#2a7ab9")
    ax.set_xticks(x, on.labels, rotation=45, ha="right")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
