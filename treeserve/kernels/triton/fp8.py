"""e4m3fn codes for the FP8 KV cache in integer arithmetic (pages are passed as uint8): torch's
bits, in the interpreter and on any GPU (`tl.float8e4nv` needs sm_89+). Saturates at +-448.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn


def fp8_operands(
    k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The caches as the kernels take them (FP8 as uint8) and fp32 (k_scale, v_scale) or a placeholder."""
    if k_cache.dtype != FP8:
        return k_cache, v_cache, k_cache  # any pointer: KV_FP8 False never reads it
    assert kv_scales is not None and kv_scales.dtype == torch.float32 and kv_scales.shape == (2,), (
        "an FP8 cache is read and written with its layer's fp32 (k_scale, v_scale)"
    )
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), kv_scales.contiguous()


@triton.jit
def to_e4m3(x):
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal: drop 20 mantissa bits to nearest even, rebias the exponent (127 -> 7)
    normal = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    # subnormals: the nearest multiple of 2^-9
    exponent = (mag >> 23).to(tl.int32)
    mantissa = (mag & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0).to(tl.uint32)
    shift = tl.minimum(tl.maximum(141 - exponent, 1), 31).to(tl.uint32)
    rest = mantissa & ((tl.full(shift.shape, 1, tl.uint32) << shift) - 1)
    half = tl.full(shift.shape, 1, tl.uint32) << (shift - 1)
    sub = mantissa >> shift
    sub += ((rest > half) | ((rest == half) & ((sub & 1) == 1))).to(tl.uint32)
    code = tl.where(mag < (121 << 23), sub, normal)
    code = tl.where(mag >= 0x43E00000, 0x7E, code)  # 448 and above
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
    return (code | sign).to(tl.uint8)


@triton.jit
def from_e4m3(code):
    c = code.to(tl.uint32)
    mag = c & 0x7F
    normal = ((mag + (120 << 3)) << 20).to(tl.float32, bitcast=True)  # exponent + 120, mantissa in place
    value = tl.where(mag < 8, (mag & 7).to(tl.float32) * 0.001953125, normal)  # subnormal: m x 2^-9
    value = tl.where(mag == 0x7F, float("nan"), value)
    return tl.where(c >= 128, -value, value)


@triton.jit
def inverse(scale):
    """1 / scale rounded once (what the stores multiply by)."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
