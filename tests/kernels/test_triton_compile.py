"""The Triton kernels compile for an H100 (sm_90, to cubin) on this GPU-less machine.

The interpreter tests prove the kernels' numbers; this proves a GPU compiler takes them
(see compile_for_gpu.py). It runs in a subprocess because the interpreter is chosen when
triton is imported, and this process has TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compile_for_gpu.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "ptxas" in done.stdout and "not found" in done.stdout:
        pytest.skip("this triton build has no ptxas to compile with")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert done.stdout.count("ok ") == 60  # three cache dtypes (fp32, bf16, FP8 bytes); the sampler is two kernels
