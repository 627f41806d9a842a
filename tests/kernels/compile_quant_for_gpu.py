"""Compile the quantised-matmul kernels (`kernels/triton/quant_matmul.py`) to cubin for an A100
(sm_80) and an H100 (sm_90), with no GPU present, at every constexpr combination the launchers
use. Run with TRITON_INTERPRET unset (`test_triton_quant_matmul.py` does); prints one line per
configuration and exits 1 if any failed.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from treeserve.kernels.triton import quant_matmul as qm

TARGETS = {"sm80": GPUTarget("cuda", 80, 32), "sm90": GPUTarget("cuda", 90, 32)}
SHARED_BYTES = {"sm80": 166912, "sm90": 232448}  # the most shared memory a block may take
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def compiles(kernel: triton.JITFunction, args: dict, options: dict, label: str, targets: tuple[str, ...]) -> bool:
    signature, constants = {}, {}
    for param in kernel.params:
        value = args[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        else:
            signature[param.name] = value if isinstance(value, str) else "i32"
    ok = True
    for name in targets:
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constants), target=TARGETS[name], options=options)
            if compiled.metadata.shared > SHARED_BYTES[name]:
                raise RuntimeError(f"{compiled.metadata.shared} bytes of shared memory, {SHARED_BYTES[name]} at most")
            print(f"ok   {name} {label}")
        except Exception as e:  # noqa: BLE001 - report every failure, then exit 1
            print(f"FAIL {name} {label}: {type(e).__name__}: {str(e)[:1500]}")
            ok = False
    return ok


DEQUANT = [  # (dtype, FORMAT, zeros, partial, bias, rows, targets): each branch of the kernel once
    ("bf16", 4, True, True, False, 1, ("sm90",)),
    ("bf16", 4, False, False, True, 512, ("sm90",)),
    ("fp16", 8, True, False, True, 33, ("sm90",)),
    ("fp32", 8, False, True, False, 1, ("sm90",)),
    ("fp32", 4, True, False, True, 512, ("sm80",)),  # the largest tile's shared memory
    ("bf16", qm.FP8_FORMAT, False, False, True, 33, ("sm80", "sm90")),  # W8A16 is for cards without FP8
    ("fp16", qm.FP8_FORMAT, False, True, False, 1, ("sm80",)),
]


def main() -> int:
    ok = True
    sizes = dict(M=1, N=96, K=160, group_size=32, k_tiles=5, tiles_per_chunk=1, chunks_per_program=1)
    strides = dict(stride_xm=160, stride_wn=80, stride_sn=5, stride_zn=5, stride_om=96, stride_split=96)
    for dt, fmt, has_zeros, partial, bias, rows, targets in DEQUANT:
        block_m, block_n, warps = qm.tile_for(rows)
        args = dict(
            x_ptr=f"*{dt}",
            w_ptr="*u8",
            scales_ptr=f"*{dt}",
            zeros_ptr="*u8",
            bias_ptr=f"*{dt}",
            out_ptr="*fp32" if partial else f"*{dt}",
            **sizes,
            **strides,
            FORMAT=fmt,
            ZERO=2 ** (fmt - 1) if fmt else 0,
            HAS_ZEROS=has_zeros,
            HAS_BIAS=bias,
            PARTIAL=partial,
            UPCAST=False,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=128,
        )
        options = dict(num_warps=warps, num_stages=qm.pipeline_stages(DTYPES[dt]), enable_fp_fusion=False)
        label = f"dequant {dt} format={fmt} zeros={has_zeros} partial={partial} m<={rows}"
        ok &= compiles(qm._dequant_gemm, args, options, label, targets)
    args = dict(
        part_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", total=96, N=96, CHUNKS=5, HAS_BIAS=True, BLOCK=1024
    )
    ok &= compiles(qm._sum_chunks, args, dict(num_warps=4, enable_fp_fusion=False), "sum chunks bf16", ("sm90",))
    for dt, rows, targets in (("bf16", 1, ("sm80", "sm90")), ("fp16", 512, ("sm90",))):
        block_m, block_n, warps = qm.tile_for(rows)
        args = dict(
            xq_ptr="*i8",
            w_ptr="*i8",
            x_scale_ptr="*fp32",
            w_scale_ptr="*fp32",
            bias_ptr=f"*{dt}",
            out_ptr=f"*{dt}",
            M=1,
            N=96,
            K=160,
            stride_xm=160,
            stride_wn=160,
            stride_om=96,
            HAS_BIAS=True,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=qm.INT8_BLOCK_K,
        )
        options = dict(num_warps=warps, num_stages=3, enable_fp_fusion=False)
        ok &= compiles(qm._int8_gemm, args, options, f"int8 {dt} m<={rows}", targets)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
