"""RMS norm over the last dim, alone or fused with the residual add before it (vLLM's
`fused_add_rms_norm`): residual += x in place, output norm(residual) in a new tensor.
One program a row (so `x` may alias `residual`, and rows are batch invariant), computed as
`layers/norm.py`'s PyTorch lines with FMA contraction off; only the sum of squares' order differs
(fp32 within a few ulp, bf16 at most one ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.rounding import round_to


@triton.jit
def _rms_norm(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    eps,
    x_stride_t,
    x_stride_h,
    residual_stride_t,
    residual_stride_h,
    out_stride_t,
    out_stride_h,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    FP32_WEIGHT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * x_stride_t + h * x_stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        residual = residual_ptr + t * residual_stride_t + h * residual_stride_h + cols
        x = round_to(x + tl.load(residual, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(residual, x.to(dtype), mask=mask)
    mean = tl.div_rn(tl.sum(x * x, 0), tl.full([], HIDDEN, tl.float32))
    r = tl.div_rn(tl.full([], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = x * r * weight if FP32_WEIGHT else weight * round_to(x * r, dtype)
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * out_stride_t + h * out_stride_h + cols, round_to(out, out_dtype).to(out_dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    fp32_weight: bool = False,
) -> torch.Tensor:
    hidden = x.shape[-1]
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and weight.shape == (hidden,) and weight.is_contiguous()
    dtype = x.dtype if fp32_weight or weight.dtype == x.dtype else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return out
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    rows = residual if residual is not None else x

    def strides(t: torch.Tensor) -> tuple[int, int]:
        return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)

    block = triton.next_power_of_2(hidden)
    _rms_norm[(x.shape[0], x.shape[1] if x.dim() == 3 else 1)](
        x,
        rows,
        weight,
        out,
        eps,
        *strides(x),
        *strides(rows),
        *strides(out),
        HIDDEN=hidden,
        BLOCK=block,
        ADD=residual is not None,
        FP32_WEIGHT=fp32_weight,
        num_warps=min(max(block // 256, 1), 16),
        enable_fp_fusion=False,
    )
    return out
