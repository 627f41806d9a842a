#!/usr/bin/env bash
# Creates the llama.cpp peer virtualenv used by bench/generate.py --gemma (bench/README.md):
# llama-cpp-python built from source (about 11 minutes on 2 cores). ggml's default native
# build dies with SIGILL in its AMX matmul on some of these VMs, and a fixed list of
# instruction sets dies on a CPU without one of them (AVX-VNNI is absent on the AMD EPYC
# machines), so each GGML_* option is switched on exactly when /proc/cpuinfo lists its flag;
# AMX is always off.
set -euo pipefail
VENV=${LLAMACPP_VENV:-.venv-llamacpp}
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
opt() { if [[ "$flags" == *" $2 "* ]]; then echo "-DGGML_$1=ON"; else echo "-DGGML_$1=OFF"; fi; }
CMAKE_ARGS="-DGGML_NATIVE=OFF $(opt AVX avx) $(opt AVX2 avx2) $(opt FMA fma) $(opt F16C f16c) $(opt BMI2 bmi2) \
$(opt AVX_VNNI avx_vnni) $(opt AVX512 avx512f) $(opt AVX512_VBMI avx512vbmi) $(opt AVX512_VNNI avx512_vnni) \
$(opt AVX512_BF16 avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
echo "CMAKE_ARGS=$CMAKE_ARGS"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
CMAKE_ARGS="$CMAKE_ARGS" "$VENV/bin/pip" install --quiet --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
"$VENV/bin/pip" install --quiet "llama-cpp-python==0.3.36" numpy
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
