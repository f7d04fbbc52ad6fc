"""What a GPU bench says about its engines' CUDA graphs: captured, failed, replayed, eager.

A decode figure measured on a GPU is a graph figure only if the graphs were captured and
replayed: a capture that fails leaves the engine decoding eagerly, with one warning. Every
bench that times an engine on a GPU prints :func:`line` and lets a failed capture fail its
target line (:func:`ok`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def counters(engines: Iterable[Any]) -> dict[str, Any]:
    """The graph counters of ``engines`` summed: ``on`` (engines with graphs), ``captured``,
    ``replayed`` (steps that replayed a captured graph), ``static`` (steps on the graph
    buffers, replayed or not), ``eager`` (steps the graphs did not take), ``failed`` (each
    failed capture's reason)."""
    out: dict[str, Any] = dict(on=0, captured=0, replayed=0, static=0, eager=0, failed=[])
    for eng in engines:
        g = getattr(eng, "graphs", None)
        if g is None:
            continue
        out["on"] += 1
        out["captured"] += g.captures
        out["replayed"] += g.graph_replays
        out["static"] += g.replays
        out["eager"] += g.eager
        if g.failed is not None:
            out["failed"].append(g.failed)
    return out


def total(counts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Several :func:`counters` summed (of engines already let go)."""
    out: dict[str, Any] = dict(on=0, captured=0, replayed=0, static=0, eager=0, failed=[])
    for c in counts:
        for k, v in c.items():
            out[k] = out[k] + v
    return out


def ok(c: dict[str, Any], device: str) -> bool:
    """Whether graphs ran as a GPU figure needs: on CUDA, captured and replayed, no capture
    failed; elsewhere always (nothing is captured off CUDA)."""
    if not device.startswith("cuda"):
        return True
    return c["on"] > 0 and not c["failed"] and c["captured"] > 0 and c["replayed"] > 0


def line(c: dict[str, Any], device: str, what: str = "") -> str:
    """``graphs: ...``, one line for the bench's output and the GPU check's summary."""
    head = f"graphs{' ' + what if what else ''}:"
    if c["on"] == 0:
        return f"{head} off (no engine here runs CUDA graphs, on {device})"
    text = (
        f"{head} captured {c['captured']}, replayed {c['replayed']}, static-buffer steps "
        f"{c['static']}, eager steps {c['eager']}, failed {len(c['failed'])}"
    )
    if c["failed"]:
        text += f" ({c['failed'][0]})"
    if device.startswith("cuda"):
        text += " (ok)" if ok(c, device) else " (NOT captured and replayed: eager figures)"
    return text
