"""Where the Triton kernel tests run: ``"cuda"`` on a GPU, ``"cpu"`` under Triton's interpreter
(``TRITON_INTERPRET=1``), or None (every test here skipped). A module of its own, not the
conftest: the tests import it by name, and ``conftest`` names tests/python's too when one pytest
run collects both folders."""

from __future__ import annotations


def _device() -> str | None:
    import torch

    from radixkv.kv.backends.choice import interpreted

    if interpreted():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


DEVICE = _device()
