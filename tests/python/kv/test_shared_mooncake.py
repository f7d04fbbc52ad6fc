"""The shared tier on a real Mooncake Store (mark ``mooncake``): a ``mooncake_master`` and a
``mooncake_client`` memory holder started in a private network namespace (their transfer
listeners bind every address; ``unshare -n``, loopback up), two replicas on it
(``mooncake_replicas.py``). Skipped, saying why, without Mooncake's Python client
(``mooncake-transfer-engine-non-cuda``, Debian's ``libibverbs1``) or without ``unshare``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mooncake

SUPPORT = Path(__file__).resolve().parents[1] / "support"

SCRIPT = """
set -u
ip link set lo up
"$MASTER" -rpc_port 50051 -enable_http_metadata_server=false >"$LOGS/master.log" 2>&1 &
M=$!
"$HOLDER" -host 127.0.0.1 -master_server_address 127.0.0.1:50051 \
    -metadata_server P2PHANDSHAKE -global_segment_size 256MB -port 50052 -protocol tcp \
    >"$LOGS/holder.log" 2>&1 &
H=$!
trap 'kill $H $M 2>/dev/null; wait $H $M 2>/dev/null' EXIT
"$PYTHON" "$REPLICAS" "mooncake://127.0.0.1:50051" "$M"
"""


def test_two_replicas_share_pages_on_a_mooncake_store(tmp_path):
    store = pytest.importorskip(
        "mooncake.store",
        reason="Mooncake's client is not installed (pip install "
        "mooncake-transfer-engine-non-cuda; apt-get install libibverbs1)",
    )
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare and ip are needed for a private network namespace")
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -n is not permitted here (a private network namespace needs root)")
    package = Path(store.__file__).resolve().parent
    env = dict(
        os.environ,
        MASTER=str(package / "mooncake_master"),
        HOLDER=str(package / "mooncake_client"),
        LOGS=str(tmp_path),
        PYTHON=sys.executable,
        REPLICAS=str(SUPPORT / "mooncake_replicas.py"),
        PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        ["unshare", "-n", "bash", "-c", SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = "".join(
        f"\n--- {f.name}\n{f.read_text()[-2000:]}" for f in sorted(tmp_path.glob("*.log"))
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    assert "ok" in proc.stdout and "hung master ok" in proc.stdout, proc.stdout[-3000:]
