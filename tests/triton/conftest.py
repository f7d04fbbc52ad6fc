"""The Triton kernel tests: on a GPU (``pytest -m cuda tests/triton``) they run the compiled
kernels on CUDA tensors; without one, under Triton's interpreter on CPU tensors (``make
test-triton`` sets ``TRITON_INTERPRET=1``, which must be set before triton is imported: a
process of their own). Without either, every test here is skipped, saying how to run them."""

from __future__ import annotations

from pathlib import Path

import pytest

from triton_device import DEVICE


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().parent != here:
            continue
        if DEVICE is None:
            item.add_marker(
                pytest.mark.skip(
                    reason="the Triton kernels need a GPU, or TRITON_INTERPRET=1 set before "
                    "triton is imported (make test-triton)"
                )
            )
