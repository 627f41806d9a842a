#!/usr/bin/env bash
# The GPU checks, one invocation on a machine with a CUDA GPU and treeserve importable:
# the CUDA/Triton tests (kernels against their references, the engine against transformers
# and the CPU path, the slow search-equivalence test included), the README's main job on
# the GPU, bench/gpu.py with the arguments given here, then the thesis's shapes (1B
# generator + 8B PRM, random weights: bench/thesis_shapes.py). Everything lands in $OUT
# (default bench/out/gpu): tests.log, eval.log, bench.log, thesis.log, bench/gpu.py's JSON
# files and thesis/thesis_shapes.json.
#
# The whole script keeps within GPU_CHECK_BUDGET seconds (default 540: a device call may run
# 600): bench/gpu.py gets what the first steps left, less THESIS_TIMEOUT (default 240), which
# is kept for the thesis shapes. Both write their JSON as each part finishes.
#
#   bash bench/gpu_check.sh --repeats 3 --skip-gemma          # arguments go to bench/gpu.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# Each test file in its own worker: Triton compiles in parallel, the GPU is shared.
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-6}" -m "slow or not slow" \
  tests/kernels/test_triton_attention.py tests/kernels/test_triton_sampling.py \
  tests/engine/test_triton_engine.py tests/engine/test_device.py tests/engine/test_cuda_graphs.py \
  tests/kernels/test_triton_fused.py 2>&1 | tee "$OUT/tests.log"
timeout "${EVAL_TIMEOUT:-120}" $PY -m treeserve.cli eval --device cuda 2>&1 | tee "$OUT/eval.log"
BUDGET=${GPU_CHECK_BUDGET:-540}
THESIS_TIMEOUT=${THESIS_TIMEOUT:-240}
BENCH_LEFT=$(( BUDGET - SECONDS - THESIS_TIMEOUT ))
if [ "$BENCH_LEFT" -ge 30 ]; then
  timeout "$BENCH_LEFT" $PY bench/gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
else
  echo "bench/gpu.py skipped: ${BENCH_LEFT}s left of the budget" | tee "$OUT/bench.log"
fi
THESIS_LEFT=$(( BUDGET - SECONDS < THESIS_TIMEOUT ? BUDGET - SECONDS : THESIS_TIMEOUT ))
timeout "$(( THESIS_LEFT > 1 ? THESIS_LEFT : 1 ))" $PY bench/thesis_shapes.py --device cuda --out "$OUT/thesis" 2>&1 \
  | tee "$OUT/thesis.log"
