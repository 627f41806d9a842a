"""Rotary position embeddings (default, linear, dynamic, llama3, yarn, longrope), computed as
`transformers` does (fp32 bit for bit). bf16 on a CPU uses the C kernel; on CUDA the engine
rotates q and k as it stores k (`use_triton`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels import triton as triton_kernels

ROPE_KEYS = {  # each type's parameters besides rope_type / type / rope_theta; others are refused
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor", "long_factor", "short_factor"},
}
ROPE_ALIASES = {"su": "longrope"}  # older Phi-3 configs


@dataclass
class RopeFrequencies:
    """`inv_freq` below `switch`, longrope's `long_inv_freq` from it on; cos/sin times `attention_factor`."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0
    long_inv_freq: torch.Tensor | None = None
    switch: int = 0


def rope_type(scaling: dict | None) -> str:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return ROPE_ALIASES.get(kind, kind)


def check_rope(scaling: dict | None) -> None:
    kind = rope_type(scaling)
    if kind not in ROPE_KEYS:
        raise ValueError(f"unsupported rope type {kind!r} (supported: {', '.join(ROPE_KEYS)})")
    unknown = set(scaling or {}) - ROPE_KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if unknown:
        raise ValueError(f"rope type {kind!r} with unsupported parameters {sorted(unknown)}")


def rope_frequencies(dim: int, theta: float, scaling: dict | None) -> RopeFrequencies:
    """transformers' `ROPE_INIT_FUNCTIONS`, in its order of fp32 operations ("dynamic" changes
    nothing below max_position_embeddings, which the table never passes)."""
    check_rope(scaling)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponent)
    kind = rope_type(scaling)
    if kind in ("default", "dynamic"):
        return RopeFrequencies(inv_freq)
    if kind == "linear":
        return RopeFrequencies(inv_freq / scaling["factor"])
    if kind == "llama3":
        return RopeFrequencies(_llama3_inv_freq(inv_freq, scaling))
    if kind == "yarn":
        return _yarn(dim, theta, scaling)
    return _longrope(dim, theta, scaling, exponent)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    return rope_frequencies(head_dim, theta, scaling).inv_freq


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, scaling: dict) -> RopeFrequencies:
    """YaRN (Peng et al. 2023): low frequencies interpolated, high ones extrapolated, a ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return RopeFrequencies(inv_freq, float(attention_factor))


def _longrope(dim: int, base: float, scaling: dict, exponent: torch.Tensor) -> RopeFrequencies:
    """LongRoPE (Phi-3, Phi-4-mini): short factors below the pretraining length, long ones from it."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = {}
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != dim // 2:
            raise ValueError(f"longrope {key} has {len(scaling[key])} entries; {dim} rotated dims need {dim // 2}")
        factors[key] = torch.tensor(scaling[key], dtype=torch.float32)
    short = 1.0 / (factors["short_factor"] * base**exponent)
    long = 1.0 / (factors["long_factor"] * base**exponent)
    return RopeFrequencies(short, float(attention_factor), long, int(original))


class RotaryEmbedding:
    """cos/sin over positions [0, max_positions), as wide as the rotated part of a head."""

    def __init__(self, freqs: RopeFrequencies | torch.Tensor, max_positions: int, device: torch.device | str):
        freqs = freqs if isinstance(freqs, RopeFrequencies) else RopeFrequencies(freqs)
        positions = torch.arange(max_positions, dtype=torch.float32)
        table = positions[:, None] * freqs.inv_freq[None, :].float()
        if freqs.long_inv_freq is not None and max_positions > freqs.switch:
            table[freqs.switch :] = positions[freqs.switch :, None] * freqs.long_inv_freq[None, :].float()
        emb = torch.cat((table, table), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if freqs.attention_factor != 1.0:
            cos, sin = cos * freqs.attention_factor, sin * freqs.attention_factor
        self.cos = cos.to(device)
        self.sin = sin.to(device)
        self.rotary_dim = self.cos.shape[1]
        self._looked_up: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        self.use_c = False
        self.use_triton = False  # the engine rotates q, k as it stores k

    def pick_kernel(self, dtype: torch.dtype, head_dim: int | None = None) -> None:
        """The C and Triton kernels rotate whole heads only."""
        whole = head_dim is None or head_dim == self.rotary_dim
        on_c = self.cos.device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.load() is not None
        self.use_c = whole and on_c
        self.use_triton = whole and triton_kernels.fused_layers(self.cos.device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.lookup(positions, q.dtype)
        if self.use_c and all(_c_layout(t) for t in (q, k)):
            return cpu_kernels.rope_bf16(q, cos, sin), cpu_kernels.rope_bf16(k, cos, sin)
        if q.shape[-1] != self.rotary_dim:
            d = self.rotary_dim
            q_rot, k_rot = q[..., :d], k[..., :d]
            q_rot = q_rot * cos + _rotate_half(q_rot) * sin
            k_rot = k_rot * cos + _rotate_half(k_rot) * sin
            return torch.cat((q_rot, q[..., d:]), dim=-1), torch.cat((k_rot, k[..., d:]), dim=-1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D], reused while the layers of a forward pass the same `positions`."""
        last = self._looked_up
        if last is None or last[0] is not positions or last[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            last = self._looked_up = (positions, dtype, cos, sin)
        return last[2], last[3]


def _c_layout(x: torch.Tensor) -> bool:
    """bf16 heads contiguous within a token (rows may be strided)."""
    return x.dtype == torch.bfloat16 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
