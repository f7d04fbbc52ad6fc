"""The contract every attention backend keeps: :class:`Backend`.

A step (:class:`~radixkv.kv.step.Step`) splits its requests into groups (:class:`.Group`: the
decode requests, the prefill ones, or all of them) and hands each group to one backend, twice:

```text
  plan:       backend.prepare(step, group)        once per step: masks, tables, compiled blocks
  each layer: backend.attend(step, group, layer,  the layer's queries and new K/V (already in
                             q, k_new, v_new,     the pool) -> [rows, Hq, D] in the pool's dtype
                             scale, window,
                             softcap, sinks)
```

``supports(window, softcap, sinks)`` says whether ``attend`` takes those extras; a layer whose
extras a group's backend does not take runs through the SDPA backend's groups instead. A
backend object belongs to one ``KVCache`` (``KVCache.backend(name)`` makes it on first use and
keeps it), so what ``prepare`` builds for a step may be cached on it across steps.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from radixkv.kv.backends.group import Group


@runtime_checkable
class Backend(Protocol):
    """One attention backend (see the module): ``name``, ``supports``, ``prepare``, ``attend``."""

    #: Its name in ``KVCache(attention=...)`` and in ``Step.backends``.
    name: str
    #: Whether its decode steps may run as a :class:`~radixkv.kv.static_step.StaticDecodeStep`
    #: (the fixed-address step CUDA graphs replay: the same kernels, so the same results).
    static_decode: bool
    #: Whether it attends the window layers over their window pool (a window group's page
    #: table); a step whose backends do not hands those layers to SDPA.
    window_pool: bool

    def supports(
        self, window: int | None, softcap: float | None, sinks: torch.Tensor | None
    ) -> bool:
        """Whether :meth:`attend` takes a sliding ``window``, a ``softcap`` and ``sinks``."""
        ...

    def prepare(self, step: Any, g: Group) -> None:
        """Builds what every layer of ``step`` needs to attend group ``g`` (into ``g.state``)."""
        ...

    def attend(
        self,
        step: Any,
        g: Group,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        scale: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attends the group's queries ``q`` (``[rows, Hq, D]``) to their requests' keys in the
        pool of ``layer`` (``k_new``/``v_new``, the rows' own K/V, are already there)."""
        ...
