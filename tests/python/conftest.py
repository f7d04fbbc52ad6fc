"""Fixtures shared by the Python tests' folders (their helper modules are in ``support/``, on
pytest's ``pythonpath``).

- ``engine``: builds :class:`radixkv.Engine` objects over the requesting module's tiny model
  (its ``MODEL``), the way the engine tests each used to spell out for themselves.
- ``served``: starts ``radixkv serve`` processes for a test module and stops them after its last
  test, each of which must then exit 0 (SIGTERM drains and exits cleanly).
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Callable, Iterator

import pytest

import radixkv


def _radix_p1(num_tokens: int) -> radixkv.RadixCache:
    return radixkv.RadixCache(num_tokens, page_size=1)


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> Callable[..., radixkv.Engine]:
    """``engine(make_cache=RadixCache page 1, tokens=4096, *, model=MODEL, caching=True, **kw)``:
    a new engine over ``model`` (default: the test module's ``MODEL``) whose cache is
    ``make_cache(tokens)`` (a factory of ``tiny_model.CACHES``), ``prefix_caching=caching``,
    and the other keywords as :class:`radixkv.Engine` takes them."""

    def make(
        make_cache: Callable[[int], object] = _radix_p1,
        tokens: int = 4096,
        *,
        model=None,
        caching: bool = True,
        **kw,
    ) -> radixkv.Engine:
        model = request.module.MODEL if model is None else model
        kv = model.make_kv_cache(make_cache(tokens))
        kw.setdefault("prefix_caching", caching)  # its own name, as Engine spells it, too
        return radixkv.Engine(model, kv, **kw)

    return make


@dataclasses.dataclass
class Served:
    """One ``radixkv serve`` process the ``served`` fixture started."""

    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (the OpenAI routes are under ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def served() -> Iterator[Callable[..., Served]]:
    """``served(*args, **start_kw)``: ``radixkv serve --port PORT ARGS...`` on a free port, once it
    answers ``/health`` (``start_kw`` as :func:`serve_process.start` takes them). Every server
    started is stopped with SIGTERM after the module's last test and must exit 0."""
    import serve_process

    started: list[Served] = []

    def start(*args: str, **start_kw) -> Served:
        port = serve_process.free_port()
        started.append(Served(port, serve_process.start(port, *args, **start_kw)))
        return started[-1]

    yield start
    failed = []
    for s in started:
        rc, err = serve_process.stop(s.proc)
        if rc != 0:
            failed.append(f"radixkv serve on port {s.port} exited {rc}:\n{err[-3000:]}")
    assert not failed, "\n".join(failed)
