"""A model's shapes and options, read from its `config.json`: what every layer is built from.

Owns `ModelConfig`, the one config of every architecture (the Llama family's fields; Gemma 3's
subclass adds its own in `gemma3.py`), with `from_hf` for the Llama family (Llama, Mistral,
Qwen2). A tensor- or pipeline-parallel rank's config is a copy with its share (`sharding.py`).
It holds data and its parsing only: no tensors, no modules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    layer_windows: list[int | None]  # sliding window per layer (None: global attention)
    eos_token_ids: list[int]
    bos_token_id: int | None
    has_lm_head: bool = True  # False for reward models whose checkpoint has a head of its own
    hidden_act: str = "silu"  # MLP activation: "silu" or "gelu_pytorch_tanh"
    attn_scale: float | None = None  # softmax scale of attention; None: head_dim ** -0.5
    tp_rank: int = 0  # tensor parallelism (models/sharding.py): this rank's heads, KV heads and
    tp_size: int = 1  # intermediate rows are in the fields above; the vocabulary is whole
    full_kv_heads: int = 0  # the model's KV heads (more than num_kv_heads when split; a rank may hold a copy)
    pp_rank: int = 0  # pipeline parallelism: this stage's layers are num_layers (and layer_windows)
    pp_size: int = 1  # from first_layer on; stage 0 also holds the embedding, final norm and LM head
    first_layer: int = 0

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} for {model_type}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        attention_bias = cfg.get("attention_bias", False)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=cfg.get("mlp_bias", False),
            layer_windows=_layer_windows(cfg, model_type, layers),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=cfg.get("bos_token_id"),
        )


def _layer_windows(cfg: dict, model_type: str, layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return [None] * layers
    if cfg.get("layer_types"):
        return [window if t == "sliding_attention" else None for t in cfg["layer_types"]]
    if model_type == "qwen2":
        first = cfg.get("max_window_layers", layers)
        return [window if i >= first else None for i in range(layers)]
    return [window] * layers
