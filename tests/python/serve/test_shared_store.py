"""``radixkv serve --shared-store``: what is refused before anything loads (exit 2, one line
naming the bad value, credentials masked). The shared tier itself is tested on a real
redis-server in test_shared_tier.py."""

from __future__ import annotations

import pytest

# The server's own modules: a Python without the serve extra (make test-oldest) cannot start it.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import serve_process
from redis_server import free_port


@pytest.mark.parametrize(
    "args,says",
    [
        (["--shared-store", "http://127.0.0.1:1"], "has scheme 'http'"),
        (
            ["--shared-store", "redis://u:s3cret-pw@10.255.255.1:6379"],
            "--shared-store redis://***@10.255.255.1:6379 is not on a loopback address",
        ),
        (
            ["--shared-store", "redis://127.0.0.1:1", "--shared-store-key-file", "/nonexistent/k"],
            "shared store key file '/nonexistent/k' cannot be read",
        ),
        (["--shared-store-key-file", "/nonexistent/k"], "--shared-store-key-file needs"),
    ],
)
def test_a_bad_shared_store_is_a_usage_error(args, says):
    rc, err = serve_process.exit_of(free_port(), *args)
    assert rc == 2 and says in err and "Traceback" not in err, err
    assert "s3cret-pw" not in err
