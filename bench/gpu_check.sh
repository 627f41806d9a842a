#!/usr/bin/env bash
# The GPU checks, one invocation on a machine with a CUDA GPU and treeserve importable:
# the CUDA/Triton tests (kernels against their references, the engine against transformers
# and the CPU path, the slow search-equivalence test included), the README's main job on
# the GPU, then bench/gpu.py with the arguments given here. Everything lands in $OUT
# (default bench/out/gpu): tests.log, eval.log, bench.log and bench/gpu.py's JSON files.
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
  tests/engine/test_triton_engine.py tests/engine/test_device.py 2>&1 | tee "$OUT/tests.log"
timeout "${EVAL_TIMEOUT:-120}" $PY -m treeserve.cli eval --device cuda 2>&1 | tee "$OUT/eval.log"
$PY bench/gpu.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
