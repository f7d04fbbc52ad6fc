"""``radixkv serve --model DIR`` on a hybrid checkpoint: a tiny random Qwen3.5 (Gated DeltaNet
layers beside attention) over SmolLM2's vocabulary, saved with its tokenizer, built by the
command line's own ``build``: its cache has state slots (``--max-state-slots``, or a quarter of
the KV pool's memory), and its engine's tokens equal transformers' own, a turn re-sent whole
hitting the previous one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
if not hasattr(transformers, "Qwen3_5TextConfig"):  # requirements allow transformers 4.x
    pytest.skip(
        f"the hybrid families need transformers 5.x, found {transformers.__version__}",
        allow_module_level=True,
    )

from hf_models import greedy_reference, smollm2_tokenizer  # noqa: E402
from radixkv.apps import cli  # noqa: E402
from radixkv.apps.serve import cmd as serve_cmd  # noqa: E402
from radixkv.apps.serve import loading  # noqa: E402
from radixkv.hf._hybrid import snapshot_bytes  # noqa: E402
from tiny_hybrid import build  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tok = smollm2_tokenizer()
    model = build("qwen3_5", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    path = tmp_path_factory.mktemp("qwen3_5-tiny")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model


def parse(*argv):
    args, extra = cli.build_parser().parse_known_args(["serve", *argv])
    assert not extra
    return args


def test_a_hybrid_checkpoint_is_served_with_the_state_slots_asked(checkpoint):
    path, model = checkpoint
    args = parse("--model", str(path), "--num-pages", "512", "--max-state-slots", "6")
    loop, _app, _config = serve_cmd.build(args)
    eng = loop.engine
    assert eng.cache.stats.state_slots == eng.states.snapshots.n_slots == 6
    assert "6 state snapshots" in eng.states.describe()
    prompt = list(range(100, 130))
    (first,) = eng.generate([prompt], max_new_tokens=5, stop=())
    assert first.output == greedy_reference(model, prompt, 5)
    again = prompt + first.output + list(range(200, 210))
    (second,) = eng.generate([again], max_new_tokens=5, stop=())
    assert second.output == greedy_reference(model, again, 5)
    assert second.cached_tokens == len(prompt) + 4
    eng.cache.check()


def test_by_default_a_quarter_of_the_kv_memory_holds_snapshots(checkpoint):
    path, model = checkpoint
    loop, _app, _config = serve_cmd.build(parse("--model", str(path), "--kv-memory", "0.01"))
    spec = loop.engine.model.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    kv_bytes = loop.engine.cache.stats.num_pages * loop.engine.cache.stats.page_size * per_token
    lo, hi = loading.STATE_SLOTS_BOUNDS
    want = max(lo, min(hi, kv_bytes // 4 // snapshot_bytes(model)))
    assert loop.engine.cache.stats.state_slots == want > lo
