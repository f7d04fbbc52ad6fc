"""What a GPU bench says about its engines' CUDA graphs: captured, failed, replayed, eager.

A decode figure measured on a GPU is a graph figure only if the graphs were captured and
replayed: a capture that fails leaves the engine decoding eagerly, with one warning. Every
bench that times an engine on a GPU prints :func:`line` and lets a failed capture fail its
target line (:func:`ok`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _zero() -> dict[str, Any]:
    return dict(on=0, captured=0, replayed=0, static=0, eager=0, failed=0, reasons=[])


def counters(engines: Iterable[Any]) -> dict[str, Any]:
    """The graph counters of ``engines`` summed: ``on`` (engines with graphs), ``captured``,
    ``failed`` (buckets whose capture failed: ``capture_failures``), ``replayed`` (steps that
    replayed a captured graph), ``static`` (steps on the graph buffers, replayed or not),
    ``eager`` (steps the graphs did not take), ``reasons`` (each failed capture's reason)."""
    out = _zero()
    for eng in engines:
        g = getattr(eng, "graphs", None)
        if g is None:
            continue
        out["on"] += 1
        out["captured"] += g.captures
        out["failed"] += g.capture_failures
        out["replayed"] += g.graph_replays
        out["static"] += g.replays
        out["eager"] += g.eager
        out["reasons"] += g.failures
    return out


def total(counts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Several :func:`counters` summed (of engines already let go)."""
    out = _zero()
    for c in counts:
        for k, v in c.items():
            out[k] = out[k] + v
    return out


def ok(c: dict[str, Any], device: str) -> bool:
    """Whether graphs ran as a GPU figure needs: no capture failed, on any device; on CUDA,
    also some captured and replayed (off CUDA nothing is captured)."""
    if c["failed"]:
        return False
    if not device.startswith("cuda"):
        return True
    return c["on"] > 0 and c["captured"] > 0 and c["replayed"] > 0


def line(c: dict[str, Any], device: str, what: str = "") -> str:
    """``graphs: ...``, one line for the bench's output and the GPU check's summary."""
    head = f"graphs{' ' + what if what else ''}:"
    if c["on"] == 0:
        return f"{head} off (no engine here runs CUDA graphs, on {device})"
    text = (
        f"{head} captured {c['captured']}, failed {c['failed']}, replayed {c['replayed']}, "
        f"static-buffer steps {c['static']}, eager steps {c['eager']}"
    )
    if c["reasons"]:
        text += f" (first failure: {c['reasons'][0]})"
    if device.startswith("cuda") or c["failed"]:
        text += " (ok)" if ok(c, device) else " (NOT captured and replayed: eager figures)"
    return text
