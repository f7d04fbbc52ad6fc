#!/usr/bin/env bash
# On a machine with a CUDA GPU: the CUDA tests, then the attention bench in bf16, then a
# summary. Meant to finish in under 8 minutes. Usage: benches/gpu_check.sh [python]
set -u
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu_check: no CUDA device visible to torch; nothing run" >&2
    exit 2
}
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
mkdir -p target
start=$(date +%s)
timeout 300 "$PY" -m pytest -q -m cuda tests/python/test_attention.py \
    tests/python/test_attention_backends.py tests/python/test_host_tier.py 2>&1 | tail -15
tests_rc=${PIPESTATUS[0]}
timeout 180 "$PY" benches/bench_attention.py --device cuda --dtypes bfloat16 --repeat 10 \
    --threads 1 2>&1 | tee target/gpu_check_bench.txt
bench_rc=${PIPESTATUS[0]}
echo "=== summary ==="
echo "cuda tests: exit ${tests_rc} (0 = passed)"
echo "attention bench (bf16): exit ${bench_rc}; targets: decode <= 1.1x, prefill+prefix <= 1.1x"
echo "took $(( $(date +%s) - start )) s"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
