"""radixkv.hf.engine(..., compile=...): the model's forward compiled by torch.compile around
radixkv's attention (the custom op ``radixkv::paged_attention``) gives the eager engine's greedy
tokens through prefill, decode and mixed steps of several batch sizes, compiles a bounded number
of graphs, and never traces into the paged attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import radixkv
import radixkv.hf
from hf_models import VOCAB, build_model, greedy_reference

torch.set_num_threads(1)

#: The most graphs a workload of any batch sizes and lengths compiles: one-token steps,
#: longer decode steps, prefills of one request and of several (sizes 0 and 1 are
#: specialised by Dynamo; every other size is dynamic).
MAX_GRAPHS = 4


class Recorder:
    """A torch.compile backend that keeps each graph Dynamo hands it, then runs it through
    AOTAutograd (which runs the custom op's fake implementation) without Inductor."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)


@pytest.fixture(scope="module")
def model():
    return build_model("llama", seed=3)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing (graphs cached by an earlier test's model are not
    counted against it)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


def workload(eng: radixkv.Engine, seed: int, batches: tuple[int, ...]) -> list[list[int]]:
    """For each batch size: that many prompts of different lengths run together (a prefill
    step, then decode steps), and once they decode, one more prompt joins (a mixed step).
    Every request's tokens, in order."""
    rng = np.random.default_rng(seed)
    out: list[list[int]] = []
    for b in batches:
        ids = [eng.submit(prompt(rng, 5 + 3 * i), max_new_tokens=6) for i in range(b)]
        eng.step()  # the prefill; every request now decodes
        eng.step()
        late = eng.submit(prompt(rng, 7), max_new_tokens=3)  # prefilled beside their decodes
        results = {r.id: r for r in eng.run([*ids, late], release=True)}
        out += [list(results[i].output) for i in [*ids, late]]
    return out


def attention_ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    op = torch.ops.radixkv.paged_attention
    return [n for n in gm.graph.nodes if n.target in (op, op.default)]


def test_compiled_tokens_equal_eager_graphs_bounded(model):
    eager = radixkv.hf.engine(model, radixkv.RadixCache(1024, page_size=1), max_batch=8)
    want = workload(eager, 1, (1, 3))
    rec = Recorder()
    eng = radixkv.hf.engine(model, radixkv.RadixCache(1024, page_size=1), max_batch=8, compile=rec)
    assert workload(eng, 1, (1, 3)) == want
    first = len(rec.graphs)
    assert 2 <= first <= MAX_GRAPHS, f"{first} graphs compiled"
    # New batch sizes and lengths: nothing more to compile (the sizes are dynamic).
    assert workload(eng, 2, (2, 5, 4)) == workload(eager, 2, (2, 5, 4))
    assert len(rec.graphs) == first
    # Every graph has the attention as one opaque op a layer, and nothing of the paged
    # attention traced in (no pool writes, no SDPA).
    for gm in rec.graphs:
        assert len(attention_ops(gm)) == model.config.num_hidden_layers
        traced = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert not any("index_copy" in t or "scaled_dot_product" in t for t in traced), traced
    eng.cache.check()
    # The model itself is left eager on its own attention: transformers' generate still runs
    # it, and gives the compiled engine's tokens.
    ids = prompt(np.random.default_rng(3), 9)
    rid = eng.submit(ids, max_new_tokens=4)
    assert eng.run([rid], release=True)[0].output == greedy_reference(model, ids, 4)


def test_inductor_tokens_equal_eager(model):
    """Inductor itself (C++ kernels on the CPU) on a prefill, decode and mixed workload."""
    eager = radixkv.hf.engine(model, radixkv.BlockCache(64, page_size=16), max_batch=4)
    eng = radixkv.hf.engine(model, radixkv.BlockCache(64, page_size=16), max_batch=4, compile=True)
    assert workload(eng, 4, (3,)) == workload(eager, 4, (3,))


def test_sliding_window_reaches_the_op():
    """A sliding-window layer's window goes through the op to the step: tokens equal the
    eager engine's past the window."""
    model = build_model("mistral", seed=4, sliding_window=6)
    eager = radixkv.hf.engine(model, radixkv.RadixCache(512, page_size=1), max_batch=4)
    eng = radixkv.hf.engine(
        model, radixkv.RadixCache(512, page_size=1), max_batch=4, compile="aot_eager"
    )
    assert workload(eng, 5, (2,)) == workload(eager, 5, (2,))


def test_bad_compile_values_are_refused(model):
    cache = radixkv.RadixCache(64, page_size=1)
    with pytest.raises(ValueError, match="'no-such-backend'"):
        radixkv.hf.engine(model, cache, compile="no-such-backend")
    with pytest.raises(ValueError, match=r"compile must be .* got 3"):
        radixkv.hf.engine(model, cache, compile=3)


def test_op_outside_a_forward_is_refused():
    x = torch.zeros(2, 4, 16)
    with pytest.raises(RuntimeError, match=r"outside a radixkv\.hf forward"):
        torch.ops.radixkv.paged_attention(x, x[:, :2], x[:, :2], 0, None, None, None, None)
