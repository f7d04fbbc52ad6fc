"""``radixkv serve``'s app in a thread of the test process (uvicorn on a free port), so a test or a
bench can read its engine and cache directly; and whether the real model it serves is here."""

from __future__ import annotations

import threading
import time

import openai
import uvicorn

import radixkv
import radixkv.hf
from radixkv.apps.serve import app as serve
from radixkv.hf._load import SMOLLM2_INSTALL, smollm2_path
from serve_process import free_port


def smollm2_unavailable() -> str | None:
    """Why the real model cannot be used here, or None."""
    if smollm2_path() is None:  # pragma: no cover - make test installs it
        return f"the real model is not installed: {SMOLLM2_INSTALL}"
    return None


class Server:
    """A radixkv server in a thread, on a free port."""

    def __init__(
        self, model, tokenizer, prefix_caching=True, max_waiting=64, wrap=None, num_pages=8192
    ):
        cache = radixkv.RadixCache(num_pages, page_size=1)
        self.engine = radixkv.hf.engine(
            model, cache, token_budget=1024, prefix_caching=prefix_caching, tokenizer=tokenizer
        )
        self.cache = cache
        self.loop = serve.EngineLoop(self.engine, max_waiting=max_waiting)
        config = serve.ServerConfig(model_name="smollm2", tenant_header="X-Tenant")
        self.app = serve.create_app(self.loop, tokenizer, config)
        if wrap is not None:  # an ASGI middleware around the app (the bench times requests)
            self.app = wrap(self.app)
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)

    def idle(self, timeout=30.0):
        """Waits until the engine has nothing to do."""
        deadline = time.monotonic() + timeout
        while self.engine.has_work or self.engine.sequences:
            assert time.monotonic() < deadline, "the engine never went idle"
            time.sleep(0.05)
