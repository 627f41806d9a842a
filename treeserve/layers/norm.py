"""RMS norms: Llama's (weight x normed, in the input dtype) and Gemma's (1 + weight, in fp32).

Both use the C kernel `kernels.cpu.rms_norm_bf16` for bf16 inputs when `pick_kernel` found
the weights on a CPU with the kernels built (same bits as the PyTorch lines below), and
PyTorch otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.kernels import cpu as cpu_kernels


def _c_kernel_for(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and cpu_kernels.load() is not None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_c = False

    def pick_kernel(self) -> None:
        self.use_c = _c_kernel_for(self.weight) and self.weight.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_c and x.dtype == torch.bfloat16:
            return cpu_kernels.rms_norm_bf16(x, self.eps, None, self.weight)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), computed in fp32 and cast back (weights are offsets from 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.use_c = False
        self._gain: torch.Tensor | None = None  # fp32 1 + weight, made at the first call (weights are frozen)

    def pick_kernel(self) -> None:
        self.use_c = _c_kernel_for(self.weight)

    def gain(self) -> torch.Tensor:
        if self._gain is None:
            self._gain = 1.0 + self.weight.float()
        return self._gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_c and x.dtype == torch.bfloat16:
            return cpu_kernels.rms_norm_bf16(x, self.eps, self.gain(), None)
        return F.rms_norm(x.float(), self.weight.shape, self.gain(), self.eps).to(x.dtype)
