"""Quantised checkpoints' weights (GPTQ, AWQ, compressed-tensors) in two canonical forms:
- `GroupQuantWeight`: `bits`-bit codes [n, k] (4 bits: two a byte, column 2j low), scales and
  optional zero points [n, k / group_size] (default 2^(bits-1)); w = scale * (code - zero).
  `input_order` (GPTQ act-order): the layer computes x[:, input_order] @ W^T.
- `Fp8Weight`: e4m3 [n, k] with an fp32 scale a row.
On a CPU integer weights become the 8-bit kernels' blocks exactly (4-bit symmetric: Q4_0, with
zeros: Q5_0, grouped 8-bit: Q8_0, per channel: int8), scales in fp16; FP8 is dequantised.
On CUDA both stay as they are (`kernels/triton/quant_matmul.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch
from torch import nn

from treeserve.kernels.cpu import quant as kernels
from treeserve.layers.quant import QuantPart, QuantTensor, in_input_order, same_input_order, weights_of

FP16_SCALE_TOLERANCE = 2.0**-10  # relative, rounding a scale to fp16


@dataclass
class GroupQuantWeight:
    codes: torch.Tensor  # uint8 [n, k // 2] (4 bits) or [n, k] (8 bits)
    bits: int
    scales: torch.Tensor  # [n, k // group_size]
    zeros: torch.Tensor | None  # uint8 [n, k // group_size]; None: 2^(bits-1)
    group_size: int
    cols: int
    input_order: torch.Tensor | None = None
    activations: str = "weights-only"  # "int8": W8A8
    dtype: torch.dtype = torch.float32
    int8_rows: torch.Tensor | None = None  # W8A8 per channel on CUDA

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.cols))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, dtype: torch.dtype) -> GroupQuantWeight:
        return replace(self, dtype=dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scales, self.zeros, self.input_order, self.int8_rows) if t is not None]

    def on(self, device: torch.device) -> GroupQuantWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        int8 = None
        if self.activations == "int8" and self.bits == 8 and self.zeros is None and self.group_size == self.cols:
            int8 = (self.codes.to(torch.int16) - 128).to(torch.int8)
        return replace(
            self,
            codes=move(self.codes),
            scales=move(self.scales),
            zeros=move(self.zeros),
            input_order=move(self.input_order),
            int8_rows=move(int8),
        )

    def unpacked(self) -> torch.Tensor:
        if self.bits == 8:
            return self.codes.to(torch.int16)
        low, high = (self.codes & 0x0F).to(torch.int16), (self.codes >> 4).to(torch.int16)
        return torch.stack((low, high), dim=-1).reshape(self.codes.shape[0], self.cols)

    def zero_points(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros
        return torch.full(self.scales.shape, 1 << (self.bits - 1), dtype=torch.uint8, device=self.scales.device)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix in the layer's input order: the reference."""
        repeat = lambda t: t.repeat_interleave(self.group_size, dim=1)  # noqa: E731
        w = (self.unpacked() - repeat(self.zero_points()).to(torch.int16)).float() * repeat(self.scales.float())
        return in_input_order(w, self.input_order)

    def slice_rows(self, start: int, stop: int) -> GroupQuantWeight:
        zeros = None if self.zeros is None else self.zeros[start:stop]
        return replace(self, codes=self.codes[start:stop], scales=self.scales[start:stop], zeros=zeros)

    def slice_columns(self, start: int, stop: int) -> GroupQuantWeight:
        if self.input_order is not None:
            raise ValueError(
                "an act-order (g_idx) GPTQ matrix is not split by columns: its groups mix every "
                "rank's inputs; run it with tensor_parallel_size=1"
            )
        if start % self.group_size or stop % self.group_size:
            raise ValueError(f"columns [{start}, {stop}) cut {self.group_size}-column quantisation groups")
        per_byte = 8 // self.bits
        groups = slice(start // self.group_size, stop // self.group_size)
        zeros = None if self.zeros is None else self.zeros[:, groups].contiguous()
        return replace(
            self,
            codes=self.codes[:, start // per_byte : stop // per_byte].contiguous(),
            scales=self.scales[:, groups].contiguous(),
            zeros=zeros,
            cols=stop - start,
        )

    @staticmethod
    def cat(weights: list[GroupQuantWeight]) -> GroupQuantWeight:
        first = weights[0]
        for w in weights[1:]:
            kind = (w.bits, w.group_size, w.cols, w.activations)
            if kind != (first.bits, first.group_size, first.cols, first.activations):
                raise ValueError(
                    f"a fused projection's parts are quantised differently: {kind} beside "
                    f"{(first.bits, first.group_size, first.cols, first.activations)}"
                )
            if not same_input_order(w.input_order, first.input_order):
                raise ValueError(
                    "a fused projection's parts have different act-order permutations (g_idx): "
                    "not supported (q/k/v and gate/up share their input, so GPTQ gives them one)"
                )
        has_zeros = any(w.zeros is not None for w in weights)
        zeros = torch.cat([w.zero_points() for w in weights]) if has_zeros else None
        return replace(
            first,
            codes=torch.cat([w.codes for w in weights]),
            scales=torch.cat([w.scales for w in weights]),
            zeros=zeros,
        )

    def to_quant_tensor(self) -> QuantTensor:
        n, k = self.shape
        if k % 32 or self.group_size % 32:
            raise ValueError(
                f"the CPU kernels take groups of a multiple of 32 columns, got {self.group_size} over {k} columns"
            )
        scales = self.scales.float()
        codes = self.unpacked()
        if self.bits == 8 and self.zeros is None and self.group_size == k:
            values = (codes - 128).to(torch.int8).view(torch.uint8)
            part = QuantPart(kernels.I8, values.contiguous(), scales[:, 0].contiguous())
        else:
            part = _blocks(codes, self.zero_points(), scales, self.group_size, self.bits)
        return QuantTensor([part], k, self.dtype, input_order=self.input_order)


def _blocks(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int, bits: int) -> QuantPart:
    """Q4_0, Q5_0 or Q8_0 blocks of 32 columns: d = the group's scale in fp16, d * value the weight."""
    n, k = codes.shape
    per_block = lambda t: t.repeat_interleave(group // 32, dim=1)  # noqa: E731  [n, k / 32]
    d = per_block(scales).to(torch.float16)
    change = ((d.float() - per_block(scales)).abs() / per_block(scales).abs().clamp_min(1e-30)).max()
    if change > FP16_SCALE_TOLERANCE:
        raise ValueError(
            f"a group scale changes by {float(change):.2g} (relative) in fp16, the CPU blocks' scale "
            "type; load with dequantize=True to run this matrix dense"
        )
    signed = codes.view(n, k // 32, 32) - per_block(zeros).to(torch.int16).unsqueeze(-1)
    symmetric = bool((zeros == (1 << (bits - 1))).all())
    scale_bytes = d.view(torch.uint8).view(n, k // 32, 2)
    if bits == 8:
        if not symmetric:
            raise ValueError(
                "8-bit codes with zero points do not fit the CPU's 8-bit blocks; load with "
                "dequantize=True to run this matrix dense"
            )
        blocks = torch.cat((scale_bytes, signed.to(torch.int8).view(torch.uint8)), dim=-1)
        return QuantPart(kernels.QTYPES["Q8_0"], blocks.reshape(n, -1).contiguous())
    if symmetric:  # Q4_0: d, 16 bytes: column j low nibble of byte j, j + 16 the high
        u = (signed + 8).to(torch.uint8)
        blocks = torch.cat((scale_bytes, u[..., :16] | (u[..., 16:] << 4)), dim=-1)
        return QuantPart(kernels.QTYPES["Q4_0"], blocks.reshape(n, -1).contiguous())
    # Q5_0: d, 4 bytes of fifth bits (bit j: column j), 16 bytes of nibbles as Q4_0
    u = (signed + 16).to(torch.int32)
    high = ((u >> 4) & 1) << torch.arange(32, dtype=torch.int32)
    qh = high.sum(dim=-1, dtype=torch.int64).view(n, k // 32, 1).view(torch.uint8)[..., :4]
    low = (u & 0x0F).to(torch.uint8)
    blocks = torch.cat((scale_bytes, qh, low[..., :16] | (low[..., 16:] << 4)), dim=-1)
    return QuantPart(kernels.QTYPES["Q5_0"], blocks.reshape(n, -1).contiguous())


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # e4m3 [n, k]
    scales: torch.Tensor  # fp32 [n]
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def to(self, dtype: torch.dtype) -> Fp8Weight:
        return replace(self, dtype=dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scales]

    def on(self, device: torch.device) -> Fp8Weight:
        return replace(self, weight=self.weight.to(device), scales=self.scales.to(device))

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float().unsqueeze(1)

    def slice_rows(self, start: int, stop: int) -> Fp8Weight:
        return replace(self, weight=self.weight[start:stop], scales=self.scales[start:stop])

    def slice_columns(self, start: int, stop: int) -> Fp8Weight:
        return replace(self, weight=self.weight[:, start:stop].contiguous())

    @staticmethod
    def cat(weights: list[Fp8Weight]) -> Fp8Weight:
        return replace(
            weights[0], weight=torch.cat([w.weight for w in weights]), scales=torch.cat([w.scales for w in weights])
        )


CheckpointWeight = GroupQuantWeight | Fp8Weight


@cache
def _matmuls(device_type: str) -> tuple[Callable, Callable, Callable]:
    """(fp8, int8, int-weight) matmuls for a device: the Triton / cuBLAS ones on CUDA, their
    PyTorch references elsewhere (which need no triton). Picked once, not on every call."""
    if device_type == "cuda":
        from treeserve.kernels.triton import quant_matmul as q

        return q.fp8_matmul, q.int8_matmul, q.int_weight_matmul
    from treeserve.kernels import quant_reference as r

    return r.fp8_matmul_reference, r.int8_matmul_reference, r.int_weight_matmul_reference


def checkpoint_linear(x: torch.Tensor, weight: CheckpointWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight kept as stored: Triton / cuBLAS on CUDA, their PyTorch references on CPU."""
    fp8_matmul, int8_matmul, int_weight_matmul = _matmuls(x.device.type)
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(weight, Fp8Weight):
        out = fp8_matmul(rows, weight.weight, weight.scales, bias)
    elif weight.int8_rows is not None:
        out = int8_matmul(rows, weight.int8_rows, weight.scales[:, 0].float(), bias)
    else:
        w = weight
        out = int_weight_matmul(rows, w.codes, w.bits, w.scales, w.zeros, w.group_size, w.input_order, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def checkpoint_weights(model: nn.Module) -> dict[str, CheckpointWeight]:
    return weights_of(model, (GroupQuantWeight, Fp8Weight))
