#!/usr/bin/env bash
# The GPU checks as one prepared run that fits a 10-minute device call (issue 62), most
# important first, each step given what the budget has left, everything written to $OUT as it
# finishes (a run cut short still returns what it measured):
#   1. the card and versions, then the tests that prove the GPU path correct: the Triton kernels
#      against their PyTorch lines, CUDA graphs (replay == the padded eager forward, bit for
#      bit), the engine against transformers and the CPU path, optimised == reference search,
#      both models on two streams == in turn;
#   2. bench/gpu_kernels.py: decode attention GB/s, prefill attention TFLOP/s, sampler µs at
#      the thesis's shapes, each against the card's peak, with the tile/warp/stage sweep (and
#      the kernels in $BEFORE, when that folder holds an earlier version);
#   3. bench/thesis_shapes.py at N=16 (1B generator + 8B PRM, random weights): CUDA graphs with
#      the models on two streams, on one stream, then eager, in one invocation (load, capture,
#      replay share, host syncs, ms per step, problems/min against the roofline floors);
#   4. bench/gpu_quant.py (W4A16 decode GB/s, FP8 prefill against bf16), at most QUANT_TIMEOUT
#      seconds (default 90), if 60 are left; its lines are appended to kernels.log;
#   5. the same with graphs at N=64, if GPU_CHECK_BUDGET leaves time;
#   6. the README's main job on the GPU (`treeserve eval --device cuda`), if time is left.
# Files ($OUT, default bench/out/gpu; 8 at most, the device tool's limit): tests.log,
# kernels.log, kernels.json, thesis.log, thesis/thesis_shapes.json, thesis64.log,
# thesis64/thesis_shapes.json, eval.log.
#
#   GPU_CHECK_BUDGET=420 BEFORE=.before bash bench/gpu_check.sh      # on the GPU machine
#   bash bench/gpu_check.sh --dry-run                                # a CPU, tiny shapes: the script end to end
#
# Needs treeserve importable and pytest-xdist (the GPU image has it). Budget: GPU_CHECK_BUDGET
# seconds in all (default 540); TEST_TIMEOUT (default 120) and KERNEL_TIMEOUT (default 120) cap
# steps 1-2; THESIS_PROBLEMS (default 16) problems per N, all in flight.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/gpu}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-540}
DEVICE=cuda TINY=() TESTS=(tests/kernels/test_triton_attention.py tests/kernels/test_triton_decode_shapes.py
  tests/kernels/test_triton_prefill_shapes.py tests/kernels/test_triton_sampling.py tests/kernels/test_triton_fused.py
  tests/kernels/test_triton_quant_matmul.py
  tests/engine/test_cuda_graphs.py tests/engine/test_triton_engine.py tests/engine/test_device.py
  tests/runtime/test_overlap_models.py)
PROBLEMS=${THESIS_PROBLEMS:-16} WORKERS=(-n "${TEST_WORKERS:-8}")  # test files in parallel workers (pytest-xdist)
if [ "${1:-}" = "--dry-run" ]; then
  DEVICE=cpu TINY=(--tiny) TESTS=(tests/engine/test_cuda_graphs.py) PROBLEMS=${THESIS_PROBLEMS:-4} WORKERS=()
fi
mkdir -p "$OUT"
left() { echo $(( BUDGET - SECONDS )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : (l > 1 ? l : 1) )); }  # a step's timeout: its cap or what is left

{
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  timeout "$(cap "${TEST_TIMEOUT:-120}")" $PY -m pytest -q -p no:cacheprovider "${WORKERS[@]}" \
    -m "slow or not slow" "${TESTS[@]}"
} 2>&1 | tee "$OUT/tests.log"

timeout "$(cap "${KERNEL_TIMEOUT:-120}")" $PY bench/gpu_kernels.py --device "$DEVICE" "${TINY[@]}" \
  ${BEFORE:+--before "$BEFORE"} --out "$OUT" 2>&1 | tee "$OUT/kernels.log"

timeout "$(cap 100000)" $PY bench/thesis_shapes.py --device "$DEVICE" "${TINY[@]}" --configs graphs,one-stream,eager \
  --ns "$([ "$DEVICE" = cuda ] && echo 16 || echo 4)" --problems "$PROBLEMS" --out "$OUT/thesis" 2>&1 \
  | tee "$OUT/thesis.log"

if [ "$(left)" -ge 60 ]; then
  timeout "$(cap "${QUANT_TIMEOUT:-90}")" $PY bench/gpu_quant.py --device "$DEVICE" "${TINY[@]}" 2>&1 \
    | tee -a "$OUT/kernels.log"
fi

if [ "$(left)" -ge 90 ] && [ "$DEVICE" = cuda ]; then
  timeout "$(cap 100000)" $PY bench/thesis_shapes.py --configs graphs --ns 64 --problems "$PROBLEMS" \
    --out "$OUT/thesis64" 2>&1 | tee "$OUT/thesis64.log"
fi

if [ "$(left)" -ge 45 ]; then
  timeout "$(cap 120)" $PY -m treeserve.cli eval --device "$DEVICE" --output "$(mktemp -d)/results.json" \
    $([ "$DEVICE" = cuda ] || echo --limit 2) 2>&1 | tee "$OUT/eval.log"
fi
echo "gpu_check: $SECONDS s of $BUDGET"
