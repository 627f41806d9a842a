"""RMS norms: Llama's (weight x normed, in the input dtype) and Gemma's (1 + weight, in fp32),
on the C kernel for bf16 on a CPU, one Triton launch on CUDA (`add_norm` folds in the residual
add), else PyTorch; the same bits either way on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels import triton as triton_kernels


def _c_kernel_for(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and cpu_kernels.load() is not None


def _triton_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, fp32_weight: bool
) -> torch.Tensor:
    from treeserve.kernels.triton.norm import rms_norm

    return rms_norm(x, weight, eps, residual, fp32_weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_c = False
        self.use_triton = False

    def pick_kernel(self) -> None:
        self.use_c = _c_kernel_for(self.weight) and self.weight.dtype == torch.bfloat16
        self.use_triton = triton_kernels.fused_layers(self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            return _triton_norm(x, self.weight, self.eps, None, fp32_weight=False)
        if self.use_c and x.dtype == torch.bfloat16:
            return cpu_kernels.rms_norm_bf16(x, self.eps, None, self.weight)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum written into `residual`; Triton only."""
        if residual is None:
            return self(x), x
        return _triton_norm(x, self.weight, self.eps, residual, fp32_weight=False), residual


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and cast back (weights are offsets from 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.use_c = False
        self.use_triton = False
        self._gain: torch.Tensor | None = None  # fp32 1 + weight (weights are frozen)

    def pick_kernel(self) -> None:
        self.use_c = _c_kernel_for(self.weight)
        self.use_triton = triton_kernels.fused_layers(self.weight.device)
        if self.use_triton:
            self.gain()  # now, not inside a CUDA graph's capture

    def gain(self) -> torch.Tensor:
        if self._gain is None:
            self._gain = 1.0 + self.weight.float()
        return self._gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_triton:
            return _triton_norm(x, self.gain(), self.eps, None, fp32_weight=True)
        if self.use_c and x.dtype == torch.bfloat16:
            return cpu_kernels.rms_norm_bf16(x, self.eps, self.gain(), None)
        return F.rms_norm(x.float(), self.weight.shape, self.gain(), self.eps).to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self(x), x
        return _triton_norm(x, self.gain(), self.eps, residual, fp32_weight=True), residual
