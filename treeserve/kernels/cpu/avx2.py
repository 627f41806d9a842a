"""bf16 linear layers on CPUs with AVX2 but no AVX512-BF16 (`avx2_linear.c`), and its loader.

There PyTorch emulates bf16 products, and its fp32 GEMM (MKL) runs at 5-18 GFLOP/s on the AVX2
AMD EPYC these machines draw, 0.5-2 GB/s of weights at 4-64 rows. This kernel keeps the weights
in bf16, widens them in registers, and sums each output in one fixed order whatever the rows
(batch invariant); `layers/linear.py` picks it for such layers at load.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from treeserve.kernels.cpu import ORDERED_FLAGS, _cpu_signature, build, native_bf16

SOURCE = Path(__file__).parent / "avx2_linear.c"
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@cache
def load() -> ctypes.CDLL | None:
    """The library where the CPU has AVX2 and FMA but does not multiply bf16 itself; else None."""
    flags = _cpu_signature().split()
    if native_bf16() or b"avx2" not in flags or b"fma" not in flags:
        return None
    lib = build(SOURCE, ORDERED_FLAGS)  # every row's sums in the order its header states
    if lib is None:
        return None
    lib.avx2_linear_bf16.argtypes = [_ptr, _i64, _int, _ptr, _ptr, _i64, _int, _ptr, _int]
    lib.avx2_linear_bf16.restype = None
    return lib


def supports(weight: torch.Tensor) -> bool:
    """A dense 2-D bf16 matrix on a CPU where this kernel is built."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and load() is not None
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of bf16 rows x [..., K] by weight [N, K] (bf16, contiguous): the fp32 sum of exact
    products rounded to bf16 once; `bias` is added in fp32 before the rounding (any float dtype)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows, k = flat.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    if rows:
        b = None if bias is None else bias.float().contiguous()
        load().avx2_linear_bf16(
            flat.data_ptr(),
            flat.stride(0),
            rows,
            weight.data_ptr(),
            None if b is None else b.data_ptr(),
            n,
            k,
            out.data_ptr(),
            torch.get_num_threads(),
        )
    return out.view(*shape[:-1], n)
