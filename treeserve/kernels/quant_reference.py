"""Quantised matmuls in plain PyTorch: the references `triton/quant_matmul.py` is tested against,
and the CPU fallback (never imports triton). Layouts as `layers/group_quant.py` hands them:
int codes uint8 [n, k // 2] (4 bits, column 2j low) or [n, k], scales and zeros [n, k // g],
w = scale * (code - zero), `input_order`: y = x[:, input_order] @ W.T; FP8 e4m3 [n, k] with fp32
scales [n] or one; int8 [n, k] with fp32 [n]. Sums in fp32 (int8: exact in fp64), cast once.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512)  # vLLM's floor on a dynamic scale (an all-zero row)
INT8_MIN_SCALE = 1e-12


def check_int_weight(
    x: torch.Tensor,
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    input_order: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[int, int]:
    """(n, k) of a grouped int weight, or a ValueError naming what does not fit the layout."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    k = x.shape[1]
    n = codes.shape[0]
    if codes.dtype != torch.uint8 or codes.dim() != 2 or codes.shape[1] * (8 // bits) != k:
        raise ValueError(
            f"codes must be uint8 [n, {k * bits // 8}] for {bits}-bit weights of {k} inputs, "
            f"got {codes.dtype} of shape {tuple(codes.shape)}"
        )
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"group_size must be a positive multiple of 32 dividing k={k}, got {group_size}")
    groups = (n, k // group_size)
    if tuple(scales.shape) != groups or not scales.is_floating_point():
        raise ValueError(f"scales must be float {list(groups)}, got {scales.dtype} of shape {tuple(scales.shape)}")
    if zeros is not None and (tuple(zeros.shape) != groups or zeros.dtype != torch.uint8):
        raise ValueError(f"zeros must be uint8 {list(groups)} or None, got {zeros.dtype} of shape {tuple(zeros.shape)}")
    if input_order is not None and (tuple(input_order.shape) != (k,) or input_order.dtype != torch.int64):
        raise ValueError(
            f"input_order must be int64 [{k}], got {input_order.dtype} of shape {tuple(input_order.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got shape {tuple(bias.shape)}")
    return n, k


def unpack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k // 2] of nibble pairs -> uint8 [n, k] of codes 0..15 (low nibble first)."""
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)


def dequantize_int(
    codes: torch.Tensor, bits: int, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    q = (unpack_int4(codes) if bits == 4 else codes).to(torch.float32)
    zero = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.float32) if zeros is None else zeros.float()
    return scales.float().repeat_interleave(group_size, dim=1) * (q - zero.repeat_interleave(group_size, dim=1))


def int_weight_matmul_reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    input_order: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [m, k] @ the dequantised weight's transpose, in fp32, as [m, n] in x's dtype."""
    check_int_weight(x, codes, bits, scales, zeros, group_size, input_order, bias)
    if input_order is not None:
        x = x.index_select(1, input_order)
    out = x.float() @ dequantize_int(codes, bits, scales, zeros, group_size).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def check_scaled_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> None:
    """A ValueError unless weight is `dtype` [n, k] for x [m, k] with an fp32 scale per row or one in all."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if weight.dtype != dtype or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be {dtype} [n, {x.shape[1]}], got {weight.dtype} of shape {tuple(weight.shape)}")
    if weight_scale.dtype != torch.float32 or weight_scale.numel() not in (1, weight.shape[0]):
        raise ValueError(
            f"weight_scale must be fp32 with 1 or {weight.shape[0]} values, "
            f"got {weight_scale.dtype} of shape {tuple(weight_scale.shape)}"
        )


def channel_scales(weight_scale: torch.Tensor, n: int) -> torch.Tensor:
    return weight_scale.reshape(-1).expand(n) if weight_scale.numel() == 1 else weight_scale.reshape(n)


def fp8_token_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row FP8 quantisation, as vLLM's: scale [m, 1] = max(amax / 448, 1 / (448 * 512))
    in fp32, and x / scale saturated to +-448 and rounded to float8_e4m3fn."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = (amax / FP8_MAX).clamp_(min=FP8_MIN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def int8_token_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row symmetric int8 quantisation: scale [m, 1] = amax / 127 in fp32, codes
    round(x / scale) (half to even) in -127..127."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = (amax / 127.0).clamp_(min=INT8_MIN_SCALE)
    return torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8), scale


def fp8_matmul_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """x @ (weight * scale).T in fp32, as x's dtype: W8A16, or with `quantize_activations` W8A8
    (x rounded to FP8 per row by `fp8_token_scales` first, what `torch._scaled_mm` multiplies)."""
    check_scaled_weight(x, weight, weight_scale, torch.float8_e4m3fn)
    w = weight.float() * channel_scales(weight_scale, weight.shape[0])[:, None]
    if quantize_activations:
        x_q, x_scale = fp8_token_scales(x)
        out = (x_q.float() * x_scale) @ w.T
    else:
        out = x.float() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def int8_epilogue(
    acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """int32 sums [m, n] -> (acc * x_scale) * weight_scale (+ bias), each step rounded in fp32,
    then cast to `dtype`: the one epilogue every int8 path uses, so all agree bit for bit."""
    out = acc.float() * x_scale * weight_scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def int8_matmul_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x quantised per row to int8, its exact integer products with weight (fp64 sums), then
    `int8_epilogue`."""
    check_scaled_weight(x, weight, weight_scale, torch.int8)
    x_q, x_scale = int8_token_scales(x)
    acc = (x_q.double() @ weight.double().T).to(torch.int32)
    return int8_epilogue(acc, x_scale, channel_scales(weight_scale, weight.shape[0]), bias, x.dtype)
