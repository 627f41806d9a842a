#!/usr/bin/env bash
# Creates the llama.cpp peer virtualenv used by bench/generate.py --gemma (bench/README.md):
# llama-cpp-python built from source (about 11 minutes on 2 cores). ggml's default native
# build dies with SIGILL in its AMX matmul on this machine's CPU, so the instruction sets are
# listed explicitly and AMX is off.
set -euo pipefail
VENV=${LLAMACPP_VENV:-.venv-llamacpp}
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
  "$VENV/bin/pip" install --quiet --no-cache-dir "llama-cpp-python==0.3.36" numpy
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
