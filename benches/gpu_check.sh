#!/usr/bin/env bash
# The check for a machine with a CUDA GPU, in one script that finishes in under 8 minutes on
# one H200 and needs only the working tree and an installed radixkv wheel (no download: the
# 8B-shaped model is built on the GPU with random weights).
#
#   benches/gpu_check.sh [--dry-run] [python]
#
# Steps, each with its own time limit and log:
#   1. the CUDA tests (the Triton kernels compiled, against SDPA over gathered keys; attention
#      backends against SDPA, the host tier's pinned pools and side stream, the hf adapter in
#      bfloat16);
#   2. the attention bench in bfloat16 with Llama-3-8B's heads (decode and prefill over a
#      cached prefix against SDPA on contiguous KV; triton's GB/s and TFLOPS against their
#      targets; varlen and flashinfer where present);
#   3. a 10-turn agent session with an 8k-token system prompt on a Llama-3-8B-shaped model in
#      bfloat16: TTFT with the prefix cache against model.generate recomputing;
#   4. decode tokens/s at 1-64 requests against model.generate with its static cache;
#   5. the host tier's load bandwidth against recomputing the same context;
#   6. where a decode step goes, part by part, at 1 and 32 requests (every part synchronized).
# Then a summary: each step's exit status, its CUDA graph counters ("graphs: captured N,
# replayed M, ... (ok)" or "(NOT captured and replayed: eager figures)") and its target lines
# ("target: ... (holds|short)"; a failed capture makes them short), written to
# $GPU_CHECK_OUT/summary.txt (default target/gpu_check/) beside every step's log; its last line
# says whether every engine's graphs were captured and replayed.
#
# --dry-run: the same steps on the CPU with tiny shapes (the tests collected, not run), so that
# CI proves the script and every command in it still work. Figures of a dry run say nothing.
set -u
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY=1
    shift
fi
PY=${1:-.venv/bin/python}
OUTDIR=${GPU_CHECK_OUT:-target/gpu_check}
mkdir -p "$OUTDIR"
: >"$OUTDIR/summary.txt"
export PYTHONPATH="benches${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" -eq 0 ]; then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "gpu_check: no CUDA device visible to torch; nothing run (--dry-run runs on the CPU)" >&2
        exit 2
    }
    DEV=cuda
    "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" |
        tee -a "$OUTDIR/summary.txt"
else
    DEV=cpu
    echo "gpu_check --dry-run: the CPU, tiny shapes; the figures say nothing" |
        tee -a "$OUTDIR/summary.txt"
fi
"$PY" -c "import radixkv, transformers; print('radixkv', radixkv.__version__, 'transformers', transformers.__version__)" |
    tee -a "$OUTDIR/summary.txt"

start=$(date +%s)
failed=0

# step NAME LIMIT_SECONDS COMMAND...: runs it with a time limit, its output to NAME.log (and
# the terminal), its exit status and target lines to the summary.
step() {
    local name=$1 limit=$2
    shift 2
    local t0 rc
    t0=$(date +%s)
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUTDIR/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || failed=1
    {
        echo "$name: exit $rc$([ "$rc" -eq 124 ] && echo ' (over its time limit)') in $(($(date +%s) - t0)) s"
        grep -E '^(graphs|target)[ :]' "$OUTDIR/$name.log" | sed 's/^/    /'
    } >>"$OUTDIR/summary.txt"
}

CUDA_TESTS="tests/triton tests/python/kv/test_attention.py tests/python/kv/test_attention_backends.py
    tests/python/kv/test_attention_choice.py tests/python/kv/test_host_tier.py
    tests/python/hf/test_hf_engine.py tests/python/models/test_paged_forward.py"
if [ "$DRY" -eq 0 ]; then
    # shellcheck disable=SC2086
    step cuda_tests 300 "$PY" -m pytest -q -m cuda $CUDA_TESTS
    step attention 120 "$PY" benches/bench_attention.py --device cuda --dtypes bfloat16 \
        --repeat 10 --threads 1 --heads 32/8/128 --prefill 800 \
        --shapes 1x512,32x544,64x4096,8x16384,1x12288
    step session_8b 150 "$PY" benches/bench_hf.py --device cuda --shape llama3-8b \
        --dtype bfloat16 --system 8192 --turns 10 --message 256 --tool 512 --reply 32 \
        --methods prefix,engine
    step decode_8b 150 "$PY" benches/bench_decode.py --device cuda --model llama3-8b \
        --dtype bfloat16 --batches 1,8,32,64 --prompt 512 --new 64 --repeat 2
    step host_load_8b 60 "$PY" benches/bench_host_load.py --device cuda --model llama3-8b \
        --dtype bfloat16 --tokens 2048,8192,32768
    step step_8b 60 "$PY" benches/bench_step.py --device cuda --model llama3-8b \
        --dtype bfloat16 --batches 1,32 --prompt 512 --steps 8
else
    # Collected, not run: proves the files import and that the marker still selects tests.
    # shellcheck disable=SC2086
    step cuda_tests 120 "$PY" -m pytest -q --collect-only -m cuda $CUDA_TESTS
    step attention 120 "$PY" benches/bench_attention.py --device cpu --dtypes bfloat16 --quick \
        --shapes 2x64,32x544 --prefill 8 --repeat 1
    step session_8b 120 "$PY" benches/bench_hf.py --device cpu --quick --shape tiny \
        --dtype bfloat16 --methods prefix,engine
    step decode_8b 120 "$PY" benches/bench_decode.py --device cpu --quick --model tiny \
        --dtype bfloat16
    step host_load_8b 60 "$PY" benches/bench_host_load.py --device cpu --quick --model tiny \
        --dtype bfloat16
    step step_8b 60 "$PY" benches/bench_step.py --device cpu --quick --model tiny \
        --dtype bfloat16
fi

# Graphs: every bench that ran engines on CUDA printed a "graphs ...:" line; any that is not
# "(ok)" means its decode figures are eager ones.
{
    total=$(cat "$OUTDIR"/*.log | grep -cE '^graphs[ :]')
    bad=$(grep -hE '^graphs[ :]' "$OUTDIR"/*.log | grep -c 'NOT captured')
    if [ "$DRY" -eq 1 ]; then
        echo "graphs: not captured on the CPU (dry run); $total graph counter lines printed"
    elif [ "${total:-0}" -eq 0 ]; then
        echo "graphs: NO bench printed graph counters: nothing shows the graphs ran"
        failed=1
    elif [ "$bad" -gt 0 ]; then
        echo "graphs: NOT captured and replayed in $bad of $total benches' engines (their figures are eager)"
        failed=1
    else
        echo "graphs: captured and replayed in all $total benches' engines"
    fi
    echo "took $(($(date +%s) - start)) s"
} >>"$OUTDIR/summary.txt"
echo "=== summary ($OUTDIR/summary.txt)"
cat "$OUTDIR/summary.txt"
exit "$failed"
