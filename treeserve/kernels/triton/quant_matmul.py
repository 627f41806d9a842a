"""Quantised-weight matmuls on a GPU: W4A16 / W8A16 grouped int weights, FP8 and int8 W8A8.

* `int_weight_matmul`: a Triton GEMM dequantising each weight tile in registers (code - zero is
  exact in x's dtype; each tile's fp32 dot times its group's scale). K is cut into chunks that
  depend on (n, k, group size) only, summed in chunk order: split-K programs plus a second kernel
  at m <= 16, one program walking them above, so a row's result does not depend on m.
* `fp8_matmul`: `torch._scaled_mm` with per-row activation scales on FP8 cards (sm >= 8.9), else
  Triton W8A16. `int8_matmul`: `torch._int_mm` where its shapes allow, else Triton; one epilogue.
CPU tensors take `kernels/quant_reference.py` (the `*_triton` functions run in the interpreter).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from treeserve.kernels.quant_reference import (
    channel_scales,
    check_int_weight,
    check_scaled_weight,
    dequantize_int,
    fp8_matmul_reference,
    fp8_token_scales,
    int8_epilogue,
    int8_matmul_reference,
    int8_token_scales,
    int_weight_matmul_reference,
    unpack_int4,
)
from treeserve.kernels.triton.rounding import round_to

__all__ = [
    "dequantize_int",
    "fp8_matmul",
    "fp8_matmul_reference",
    "int8_matmul",
    "int8_matmul_reference",
    "int_weight_matmul",
    "int_weight_matmul_reference",
    "unpack_int4",
]

DECODE_ROWS = 16  # m up to this splits K
DECODE_BLOCK_N = 64
DECODE_PROGRAMS = 256  # programs a decode GEMM aims at: ~2 waves of an H100's 132 SMs
TILES = [  # (rows up to, BLOCK_M, BLOCK_N, num_warps)
    (16, 16, 64, 4),
    (32, 32, 64, 4),
    (64, 64, 64, 4),
    (128, 64, 128, 4),
    (math.inf, 128, 128, 8),
]
FP8_FORMAT = 0  # `_dequant_gemm`'s FORMAT for e4m3 bytes; 4 and 8 are unsigned int codes
INT8_BLOCK_K = 64


def tile_for(m: int) -> tuple[int, int, int]:
    return next(t[1:] for t in TILES if m <= t[0])


def pipeline_stages(x_dtype: torch.dtype) -> int:
    """3 stages, or 2 for fp32 x (128 x 128 tiles at 3 need 192 KiB of shared memory; an A100 has 163)."""
    return 2 if x_dtype == torch.float32 else 3


def block_k(group_size: int) -> int:
    """The widest of 128, 64, 32 dividing the group: a tile never spans two groups."""
    return next(b for b in (128, 64, 32) if group_size % b == 0)


def k_chunks(n: int, k_tiles: int) -> tuple[int, int]:
    """(chunks, tiles per chunk): enough chunks that a decode GEMM's chunks x column tiles reach
    DECODE_PROGRAMS, at most one a tile. Depends on the weight's shape only, never on m."""
    splits = max(1, min(k_tiles, triton.cdiv(DECODE_PROGRAMS, triton.cdiv(n, DECODE_BLOCK_N))))
    per_chunk = triton.cdiv(k_tiles, splits)
    return triton.cdiv(k_tiles, per_chunk), per_chunk


@triton.jit
def _dequant_gemm(
    x_ptr,
    w_ptr,
    scales_ptr,
    zeros_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    group_size,
    k_tiles,
    tiles_per_chunk,
    chunks_per_program,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_om,
    stride_split,
    FORMAT: tl.constexpr,
    ZERO: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[rows, cols] = x[rows] @ W[cols].T over this program's K chunks; W[c, k] =
    scale[c, group] * (code - zero) (FORMAT 4 or 8) or scale[c, 0] * e4m3 (FORMAT 0). PARTIAL:
    fp32 sums into out[program_id(2)]; else bias added and rounded to out's dtype."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    cols64 = cols.to(tl.int64)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + cols64[None, :] * stride_wn
    first = tl.program_id(2) * chunks_per_program
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for chunk in range(first, first + chunks_per_program):
        chunk_sum = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(chunk * tiles_per_chunk, tl.minimum((chunk + 1) * tiles_per_chunk, k_tiles)):
            ks = t * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            group = (t * BLOCK_K) // group_size
            scale = tl.load(scales_ptr + cols64 * stride_sn + group, mask=col_ok, other=0.0).to(tl.float32)
            if FORMAT == 0:
                byte = tl.load(w_cols + ks[:, None], mask=w_mask, other=0).to(tl.uint16)
                half = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)  # e4m3 as fp16 bits, 2^-8 of its value
                w = half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            else:
                if FORMAT == 4:
                    byte = tl.load(w_cols + (ks // 2)[:, None], mask=w_mask, other=0).to(tl.int32)
                    code = (byte >> ((ks[:, None] & 1) * 4)) & 0xF
                else:
                    code = tl.load(w_cols + ks[:, None], mask=w_mask, other=0).to(tl.int32)
                if HAS_ZEROS:
                    zero = tl.load(zeros_ptr + cols64 * stride_zn + group, mask=col_ok, other=0).to(tl.int32)
                    w = (code - zero[None, :]).to(tl.float32)
                else:
                    w = (code - ZERO).to(tl.float32)
            if UPCAST:
                a = a.to(tl.float32)  # the interpreter's bf16 tl.dot is wrong (triton 3.9); values stay exact
            else:
                w = w.to(x_ptr.dtype.element_ty)
            chunk_sum += tl.dot(a, w, input_precision="ieee") * scale[None, :]
        acc += chunk_sum
    mask = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:
        out = out_ptr + tl.program_id(2) * stride_split + rows[:, None].to(tl.int64) * stride_om + cols64[None, :]
        tl.store(out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols64[None, :]
        tl.store(out, round_to(acc, dtype).to(dtype), mask=mask)


@triton.jit
def _sum_chunks(
    part_ptr,
    bias_ptr,
    out_ptr,
    total,
    N,
    CHUNKS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out = ((part[0] + part[1]) + ...) + bias, in chunk order, rounded to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, CHUNKS):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, round_to(acc, dtype).to(dtype), mask=mask)


def _weight_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    fmt: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    n: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The launches of `_dequant_gemm` (and `_sum_chunks` at m <= DECODE_ROWS) for x [m, k]."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    x = x if x.stride(1) == 1 else x.contiguous()
    weight, scales = weight.contiguous(), scales if scales.stride(1) == 1 else scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    bk = block_k(group_size) if fmt != FP8_FORMAT else min(128, max(32, triton.next_power_of_2(k)))
    k_tiles = triton.cdiv(k, bk)
    chunks, per_chunk = k_chunks(n, k_tiles)
    block_m, block_n, warps = tile_for(m)
    split = m <= DECODE_ROWS and chunks > 1
    part = torch.empty(chunks, m, n, dtype=torch.float32, device=x.device) if split else out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), chunks if split else 1)
    pointers = (x, weight, scales, scales if zeros is None else zeros, out if bias is None else bias, part)
    sizes = (m, n, k, group_size, k_tiles, per_chunk, 1 if split else chunks)
    strides = (x.stride(0), weight.stride(0), scales.stride(0), 0 if zeros is None else zeros.stride(0), n, m * n)
    flags = dict(FORMAT=fmt, ZERO=2 ** (fmt - 1) if fmt else 0, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None)
    flags.update(PARTIAL=split, UPCAST=x.device.type == "cpu", enable_fp_fusion=False)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, num_warps=warps, num_stages=pipeline_stages(x.dtype))
    _dequant_gemm[grid](*pointers, *sizes, *strides, **flags, **tiles)
    if split:
        block, bias_or_out = 1024, out if bias is None else bias
        flags = dict(CHUNKS=chunks, HAS_BIAS=bias is not None, BLOCK=block, enable_fp_fusion=False)
        _sum_chunks[(triton.cdiv(m * n, block),)](part, bias_or_out, out, m * n, n, **flags)
    return out


def int_weight_matmul_triton(
    x: torch.Tensor,
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    input_order: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`int_weight_matmul` on the Triton kernel whatever the device (CPU tensors: the interpreter)."""
    n, _ = check_int_weight(x, codes, bits, scales, zeros, group_size, input_order, bias)
    if input_order is not None:
        x = x.index_select(1, input_order)
    return _weight_gemm(x, codes, bits, scales, zeros, group_size, n, bias)


def int_weight_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    input_order: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W4A16 / W8A16: x [m, k] @ the grouped int weight's transpose, [m, n] in x's dtype, fp32
    sums (layouts: `kernels/quant_reference.py`). CUDA: the Triton kernel; CPU: the reference."""
    if x.device.type != "cuda":
        return int_weight_matmul_reference(x, codes, bits, scales, zeros, group_size, input_order, bias)
    return int_weight_matmul_triton(x, codes, bits, scales, zeros, group_size, input_order, bias)


def fp8_weight_matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    check_scaled_weight(x, weight, weight_scale, torch.float8_e4m3fn)
    n, k = weight.shape
    scales = channel_scales(weight_scale, n)[:, None]
    return _weight_gemm(x, weight.view(torch.uint8), FP8_FORMAT, scales, None, max(k, 1), n, bias)


def fp8_backend(device: torch.device, n: int, k: int) -> str:
    """'scaled_mm' (CUDA with FP8 and k, n multiples of 16: `torch._scaled_mm`'s rule), 'triton'
    (other CUDA: W8A16) or 'reference' (CPU)."""
    if device.type != "cuda":
        return "reference"
    fp8_card = torch.cuda.get_device_capability(device) >= (8, 9)
    return "scaled_mm" if fp8_card and n % 16 == 0 and k % 16 == 0 else "triton"


def fp8_scaled_mm_args(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[dict, torch.Tensor | None]:
    """`torch._scaled_mm`'s keyword arguments for x @ (weight * scale).T with x quantised per row
    (`fp8_token_scales`), and the [m, 1] row scales when the caller still has to apply them.
    bf16 x: row-wise scales inside the GEMM (scale_a [m, 1], scale_b [1, n], bias in bf16: the
    only output row-wise scaling is built for on every torch we take). fp16 / fp32 x: unit
    tensor-wise scales and an fp32 result, which `fp8_matmul_scaled` scales and biases."""
    n = weight.shape[0]
    x_q, x_scale = fp8_token_scales(x)
    w_scale = channel_scales(weight_scale, n).reshape(1, n).contiguous()
    args = {"input": x_q, "mat2": weight.t()}
    if x.dtype == torch.bfloat16:
        bias = None if bias is None else bias.to(torch.bfloat16)
        return dict(args, scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=torch.bfloat16), None
    one = torch.ones((), dtype=torch.float32, device=x.device)
    return dict(args, scale_a=one, scale_b=one, out_dtype=torch.float32), x_scale


def fp8_matmul_scaled(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    check_scaled_weight(x, weight, weight_scale, torch.float8_e4m3fn)
    args, x_scale = fp8_scaled_mm_args(x, weight, weight_scale.to(x.device), bias)
    out = torch._scaled_mm(args.pop("input"), args.pop("mat2"), **args)
    if x_scale is None:
        return out
    out = out * x_scale * channel_scales(weight_scale, weight.shape[0]).reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(x.dtype)


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """FP8 weight [n, k] (float8_e4m3fn) with fp32 scales per channel [n] or per tensor: W8A8 on
    `torch._scaled_mm` on FP8 cards, W8A16 (Triton) on other GPUs, the W8A16 reference on a CPU."""
    check_scaled_weight(x, weight, weight_scale, torch.float8_e4m3fn)
    backend = fp8_backend(x.device, *weight.shape)
    if backend == "scaled_mm" and x.shape[0] > 0:
        return fp8_matmul_scaled(x, weight, weight_scale, bias)
    if backend == "triton":
        return fp8_weight_matmul_triton(x, weight, weight_scale, bias)
    return fp8_matmul_reference(x, weight, weight_scale, bias)


@triton.jit
def _int8_gemm(
    xq_ptr,
    w_ptr,
    x_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out = (int32 sum of xq @ w.T) * x_scale[row] * w_scale[col] (+ bias), `int8_epilogue`'s steps."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_rows = xq_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc += tl.dot(a, w, out_dtype=tl.int32)
    x_scale = tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    out_rows = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_rows, round_to(out, dtype).to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def int8_uses_int_mm(m: int, n: int, k: int) -> bool:
    """`torch._int_mm`'s CUDA shape rules: more than 16 rows, k and n multiples of 8."""
    return m > 16 and k % 8 == 0 and n % 8 == 0 and k > 0 and n > 0


def int8_matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`int8_matmul` on the Triton int8 kernel whatever the device (CPU tensors: the interpreter)."""
    check_scaled_weight(x, weight, weight_scale, torch.int8)
    (m, k), n = x.shape, weight.shape[0]
    x_q, x_scale = int8_token_scales(x)
    w_scale = channel_scales(weight_scale, n).contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    weight = weight.contiguous()
    block_m, block_n, warps = tile_for(m)
    pointers = (x_q, weight, x_scale, w_scale, out if bias is None else bias, out)
    sizes = (m, n, k, x_q.stride(0), weight.stride(0), out.stride(0))
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=INT8_BLOCK_K, num_warps=warps, num_stages=3)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm[grid](*pointers, *sizes, HAS_BIAS=bias is not None, **tiles, enable_fp_fusion=False)
    return out


def int8_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Int8 W8A8: weight int8 [n, k] with fp32 scales [n]; x quantised per row (symmetric, dynamic).
    CUDA: `torch._int_mm` where its shape rules allow, else the Triton kernel; CPU: the reference."""
    check_scaled_weight(x, weight, weight_scale, torch.int8)
    (m, k), n = x.shape, weight.shape[0]
    if x.device.type != "cuda":
        return int8_matmul_reference(x, weight, weight_scale, bias)
    if not int8_uses_int_mm(m, n, k):
        return int8_matmul_triton(x, weight, weight_scale, bias)
    x_q, x_scale = int8_token_scales(x)
    acc = torch._int_mm(x_q, weight.t())
    return int8_epilogue(acc, x_scale, channel_scales(weight_scale, n), bias, x.dtype)
