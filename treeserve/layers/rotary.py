"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and a cos/sin table.

Computes exactly what `transformers` computes (fp32 inverse frequencies times integer
positions), so logits match bit for bit in fp32. For bf16 on a CPU, `pick_kernel` chooses
the C kernel `kernels.cpu.rope_bf16` (PyTorch's bits, read from the fused projection's
strided heads); inputs it cannot take go through the PyTorch lines. On CUDA it sets
`use_triton`: the attention block then hands q, k and this table to the engine, which rotates
them as it stores k and v (`kernels/triton/rope_kv.py`, PyTorch's bits too).
"""

from __future__ import annotations

import math

import torch

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels import triton as triton_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """A cos/sin table over positions [0, max_positions), looked up per token."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, device: torch.device | str):
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        self._looked_up: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        self.use_c = False
        self.use_triton = False  # rotate as the engine stores k (`Attention`'s `rope`), on CUDA

    def pick_kernel(self, dtype: torch.dtype) -> None:
        """Choose the kernel for q/k of `dtype` (the model's), on this table's device."""
        self.use_c = self.cos.device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.load() is not None
        self.use_triton = triton_kernels.fused_layers(self.cos.device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] -> rotated q, k in their dtype."""
        cos, sin = self.lookup(positions, q.dtype)
        if self.use_c and all(_c_layout(t) for t in (q, k)):
            return cpu_kernels.rope_bf16(q, cos, sin), cpu_kernels.rope_bf16(k, cos, sin)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, 1, D] of `positions`, reused while every layer of one forward passes the same tensor."""
        last = self._looked_up
        if last is None or last[0] is not positions or last[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            last = self._looked_up = (positions, dtype, cos, sin)
        return last[2], last[3]


def _c_layout(x: torch.Tensor) -> bool:
    """bf16 heads contiguous within each token (rows may be strided): what the C kernel reads."""
    return x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
