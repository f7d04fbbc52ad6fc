"""``radixkv serve --window-pages`` on a model with sliding-window layers: a tiny random
Mistral with a 16-token window and the real SmolLM2 tokenizer (its chat template), saved as a
checkpoint directory and served from it by the command line's own ``build``, driven by the
``openai`` client over HTTP. Greedy replies equal transformers' own, later turns are cached,
and the window layers' KV lives in the window pool; bad combinations exit with a usage error."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import radixkv  # noqa: E402
import radixkv.hf  # noqa: E402
from hf_models import smollm2_tokenizer  # noqa: E402
from radixkv.apps import cli  # noqa: E402
from radixkv.apps.common.args import UsageError  # noqa: E402
from radixkv.apps.serve import cmd as serve_cmd  # noqa: E402
from serve_process import free_port  # noqa: E402
from test_serve import SYSTEM, reference_text  # noqa: E402

WINDOW = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer Mistral with sliding_window=16 over SmolLM2's vocabulary, saved with the
    tokenizer."""
    tok = smollm2_tokenizer()
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("mistral-swa")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def parse(*argv):
    args, extra = cli.build_parser().parse_known_args(["serve", *argv])
    assert not extra
    return args


def test_a_window_pool_serves_the_chat_as_transformers_does(checkpoint):
    torch.set_num_threads(2)
    args = parse("--model", str(checkpoint), "--num-pages", "2048", "--window-pages", "256")
    loop, app, config = serve_cmd.build(args)
    cache = loop.engine.cache
    assert (cache.window, cache.window_pages) == (WINDOW, 256)
    assert loop.engine.kv.window_layers == frozenset({0, 1})  # every layer of a Mistral-SWA
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        real = radixkv.hf.load(str(checkpoint))
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
        cached = []
        for turn in range(2):
            r = client.chat.completions.create(
                model=config.model_name, messages=messages, max_tokens=6, temperature=0
            )
            assert r.choices[0].message.content == reference_text(real, messages, 6), turn
            details = r.usage.prompt_tokens_details
            cached.append(details.cached_tokens if details else 0)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "And then?"},
            ]
        # The second turn starts from the first one's cached prefix, window included.
        assert cached[0] == 0 and cached[1] > WINDOW, cached
        s = cache.stats
        assert s.window_pages == 256 and s.window_free_pages < 256
        cache.check()
    finally:
        server.should_exit = True
        thread.join(30)


def test_window_pages_needs_a_windowed_model_and_no_disk(checkpoint, tmp_path):
    with pytest.raises(UsageError, match="--window-pages with --cache-dir is not supported"):
        serve_cmd.build(
            parse("--model", str(checkpoint), "--window-pages", "64", "--cache-dir", str(tmp_path))
        )
    with pytest.raises(UsageError, match="needs a model with sliding-window layers; smollm2"):
        serve_cmd.build(parse("--model", "smollm2", "--window-pages", "64"))
