"""The model, KV cache and engine of ``radixkv serve``'s options, as every rank makes them (rank
0 in :func:`radixkv.apps.serve.cmd.build`, ranks 1 to N-1 of ``--tensor-parallel-size`` in
:mod:`radixkv.apps.serve.ranks`)."""

from __future__ import annotations

import argparse
from typing import Any

from radixkv.apps.common.args import UsageError, page_size_of


def shared_store_args(args: argparse.Namespace) -> dict[str, Any]:
    """``radixkv.hf.engine``'s ``shared_store`` and ``shared_store_key`` from ``--shared-store``
    and ``--shared-store-key-file`` (or ``$RADIXKV_SHARED_STORE_KEY``); ``UsageError`` naming
    the bad URL (credentials masked) or key file, before anything loads."""
    url = getattr(args, "shared_store", None)
    key_file = getattr(args, "shared_store_key_file", None)
    if url is None:
        if key_file is not None:
            raise UsageError("--shared-store-key-file needs --shared-store")
        return {}
    from radixkv.kv.tiers.shared import KEY_ENV, load_secret
    from radixkv.kv.tiers.store import check_url, is_local, redact

    try:
        check_url(url)
        key = load_secret(key_file)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if key is None and not is_local(url):
        raise UsageError(
            f"--shared-store {redact(url)} is not on a loopback address or a unix socket: "
            "anyone who can write to it could plant KV this server would serve; give "
            f"--shared-store-key-file FILE (or ${KEY_ENV}) so every page carries a MAC"
        )
    return {"shared_store": url, "shared_store_key": key}


#: The snapshots a hybrid model's cache keeps by default: a quarter of the KV pool's memory,
#: within these bounds.
STATE_SLOTS_BOUNDS = (8, 1024)


def state_slots_for(args: argparse.Namespace, model: Any, kv_bytes: int) -> int:
    """``--max-state-slots``, or what a quarter of ``kv_bytes`` holds of ``model``'s
    snapshots (within :data:`STATE_SLOTS_BOUNDS`)."""
    asked = getattr(args, "max_state_slots", None)
    if asked:
        return int(asked)
    from radixkv.hf._hybrid import snapshot_bytes

    lo, hi = STATE_SLOTS_BOUNDS
    return max(lo, min(hi, kv_bytes // 4 // max(snapshot_bytes(model), 1)))


def make_engine(args: argparse.Namespace, on_cache=None):
    """``(engine, model, tokenizer)`` of ``args``: the model loaded (this rank's shard with
    ``--tensor-parallel-size``), its cache and tiers, the engine over them; ``on_cache(cache)``
    is called once the cache is made, before the engine (the KV event publisher)."""
    shared = shared_store_args(args)
    try:
        import torch

        import radixkv
        import radixkv.hf
    except ImportError as e:
        raise UsageError(
            f"radixkv serve needs radixkv[serve] ({e}): pip install radixkv[serve]"
        ) from None
    tensor_parallel = getattr(args, "tensor_parallel_size", 1) > 1
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if tensor_parallel:
        device = args.device  # each rank on its own accelerator (or the CPU), as load says
    else:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model, tokenizer = radixkv.hf.load(
            args.model, dtype=dtype, device=device, tensor_parallel=tensor_parallel
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    spec = radixkv.hf.check_model(model)
    page = page_size_of(args)
    window_pages = getattr(args, "window_pages", 0)
    if window_pages and not spec.window_layers:
        raise UsageError(
            f"--window-pages needs a model with sliding-window layers; {args.model} has none"
        )
    num_pages = args.num_pages
    layers = spec.num_layers - (len(spec.window_layers) if window_pages else 0)
    per_token_bytes = 2 * max(layers, 1) * spec.num_kv_heads * spec.head_dim
    per_token_bytes *= torch.empty(0, dtype=spec.dtype).element_size()
    if num_pages is None:
        gib = args.kv_memory or 1.0
        num_pages = max(int(gib * 2**30 // (per_token_bytes * page)), 1)
    cls = radixkv.RadixCache if args.cache == "radix" else radixkv.BlockCache
    host_pages, disk_pages = args.host_pages, 0
    if getattr(args, "cache_dir", None):
        # Pages come back from disk through the host tier: one is needed, sized to the pool
        # unless given.
        host_pages = host_pages or num_pages
        disk_pages = args.disk_pages or 4 * num_pages
    elif getattr(args, "disk_pages", None):
        raise UsageError("--disk-pages needs --cache-dir")
    window = {}
    if window_pages:
        if disk_pages:
            raise UsageError(
                "--window-pages with --cache-dir is not supported in this version: window pages "
                "do not reach the disk"
            )
        window = {"window": spec.window, "window_pages": window_pages}
    if spec.kv_layers:  # a hybrid model: snapshots of its recurrent state beside the pages
        window["state_slots"] = state_slots_for(args, model, num_pages * page * per_token_bytes)
    elif getattr(args, "max_state_slots", None):
        raise UsageError(
            f"--max-state-slots is for hybrid models (recurrent layers); {args.model} has none"
        )
    try:
        cache = cls(
            num_pages, page_size=page, host_pages=host_pages, disk_pages=disk_pages, **window
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    if on_cache is not None:
        on_cache(cache)
    checks: dict[str, Any] = {"check_tokens": True} if tensor_parallel else {}
    try:
        engine = radixkv.hf.engine(
            model,
            cache,
            token_budget=args.token_budget,
            max_batch=args.max_batch,
            policy=args.policy,
            prefix_caching=not args.no_prefix_caching,
            tokenizer=tokenizer,
            disk_dir=getattr(args, "cache_dir", None),
            on_mismatch=getattr(args, "on_cache_mismatch", "error"),
            speculative=getattr(args, "speculative_config", None),
            **shared,
            # The ranks compare their sampled tokens every step (an all-gather of three
            # integers): a rank that sampled otherwise stops the server, not garbles replies.
            **checks,
        )
    except radixkv.Error as e:  # a directory written for another model or layout
        raise UsageError(str(e)) from None
    except ValueError as e:  # a model whose heads do not divide among the ranks
        if not tensor_parallel:
            raise
        raise UsageError(f"--tensor-parallel-size {args.tensor_parallel_size}: {e}") from None
    return engine, model, tokenizer
