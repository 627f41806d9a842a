"""Gemma 3 text models (`gemma3_text`) on flat token batches: Llama's blocks plus embeddings times
sqrt(hidden), fp32 norms of 1 + w, q/k norms, norms after attention and the MLP too, GELU (tanh),
`query_pre_attn_scalar ** -0.5`, local and global layers with their own rope. Logit soft-capping
is refused (no Gemma 3 checkpoint uses it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from treeserve.layers.norm import GemmaRMSNorm
from treeserve.layers.rotary import RotaryEmbedding, rope_frequencies
from treeserve.models.config import ModelConfig
from treeserve.models.config_fields import check_fields
from treeserve.models.llama import LlamaAttentionBlock, LlamaForCausalLM, LlamaMLP


@dataclass
class Gemma3Config(ModelConfig):
    local_rope_theta: float = 10000.0
    local_rope_scaling: dict | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma3Config:
        check_fields(cfg, "gemma3_text")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {act!r} for gemma3_text")
        global_rope, local_rope = _rope_parameters(cfg)
        llama_view = {  # Gemma's fields under Llama's keys
            **cfg,
            "model_type": "llama",
            "hidden_act": "silu",
            "rope_parameters": global_rope,
            "rope_scaling": None,
            "sliding_window": None,
            "head_dim": cfg.get("head_dim", 256),
            "max_position_embeddings": cfg.get("max_position_embeddings", 131072),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
            "eos_token_id": cfg.get("eos_token_id", 1),
            "bos_token_id": cfg.get("bos_token_id", 2),
        }
        shared = vars(ModelConfig.parse(llama_view))
        shared.update(
            hidden_act=act,
            layer_windows=_layer_windows(cfg, cfg["num_hidden_layers"]),
            attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
            local_rope_theta=float(local_rope.pop("rope_theta", 10000.0)),
            local_rope_scaling=local_rope or None,
        )
        return cls(**shared)


def _rope_parameters(cfg: dict) -> tuple[dict, dict]:
    """(global, local) rope parameters from either config layout transformers has written."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        return dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    global_rope = dict(cfg.get("rope_scaling") or params)
    global_rope.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    return global_rope, {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}


def _layer_windows(cfg: dict, layers: int) -> list[int | None]:
    window = cfg.get("sliding_window") or 4096
    types = cfg.get("layer_types")
    if not types:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    return [window if t == "sliding_attention" else None for t in types]


class Gemma3Attention(LlamaAttentionBlock):
    def __init__(self, cfg: Gemma3Config, layer: int):
        super().__init__(cfg, layer)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = LlamaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, positions, rope, attn):  # noqa: ANN001 - same types as the attention block
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, rope, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward_fused(self, out, residual, positions, rope, attn):  # noqa: ANN001 - as forward
        """As Llama's, the adds inside the norms before each sublayer; the post-norms stay plain."""
        h, residual = self.input_layernorm.add_norm(out, residual)
        h = self.post_attention_layernorm(self.self_attn(h, positions, rope, attn))
        h, residual = self.pre_feedforward_layernorm.add_norm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer = Gemma3DecoderLayer
    final_norm = GemmaRMSNorm

    def __init__(self, cfg: Gemma3Config):
        super().__init__(cfg)
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        self._embed_scales: dict[torch.dtype, torch.Tensor] = {}
        self.local_rope: RotaryEmbedding | None = None

    def init_rope(self, max_positions: int, device: torch.device | str) -> None:
        super().init_rope(max_positions, device)
        cfg = self.config
        local = rope_frequencies(cfg.head_dim, cfg.local_rope_theta, cfg.local_rope_scaling)
        self.local_rope = RotaryEmbedding(local, max_positions, device)

    def rope_tables(self) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        return self.rope, self.local_rope

    def embedding_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """sqrt(hidden) rounded via fp32 to `dtype` as transformers does, a 0-dim tensor cached per dtype."""
        scale = self._embed_scales.get(dtype)
        if scale is None:
            with torch.inference_mode(False):  # usable in any mode later
                scale = self._embed_scales[dtype] = torch.tensor(self.embed_scale).to(dtype)
        return scale
