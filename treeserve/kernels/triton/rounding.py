"""Rounding an fp32 value to a tensor dtype the way PyTorch does it: to nearest, ties to even.

The fused kernels (`norm`, `rope_kv`, `activation`) reproduce PyTorch's eager chains, which
round every intermediate to the activation dtype; `round_to` is that rounding, returned in
fp32 (exactly representable in the dtype, so the final `.to(dtype)` of a store is exact). bf16
is rounded on the bits because Triton's interpreter truncates in its fp32 -> bf16 cast
(triton 3.9), where a GPU rounds to nearest: done by hand, both give PyTorch's bits. NaN
payloads are not preserved (the models never round one).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype` (fp32, bf16 or fp16), as fp32."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
