"""`ModelConfig`, every architecture's shapes and options from `config.json` (`from_hf` for the
Llama family; Gemma 3's subclass in `gemma3.py`; read fields in `config_fields.py`). Data and
parsing only; a parallel rank's config is a copy with its share (`sharding.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from treeserve.layers import rotary
from treeserve.models.config_fields import check_fields


@dataclass
class MoEConfig:
    """Routed experts (Qwen3-MoE): top-k of `num_experts` a token, each `intermediate_size` rows;
    `sparse_layers` have them, the rest are dense."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: list[bool]


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
    hidden_act: str = "silu"  # "silu" or "gelu_pytorch_tanh"
    attn_scale: float | None = None  # softmax scale of attention; None: head_dim ** -0.5
    qk_norm: bool = False  # RMS norms on q and k per head before rope (Qwen3)
    partial_rotary_factor: float = 1.0  # the share of each head rope rotates (Phi-4-mini: 0.75)
    moe: MoEConfig | None = None  # routed experts (Qwen3-MoE); None: dense MLPs
    tp_rank: int = 0  # this rank's heads and rows are in the fields above
    tp_size: int = 1
    full_kv_heads: int = 0  # the model's KV heads (more than num_kv_heads when split; a rank may hold a copy)
    pp_rank: int = 0  # this stage's layers start at first_layer
    pp_size: int = 1  # stage 0 also holds embedding, final norm, LM head
    first_layer: int = 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """The Llama family: every field that changes the arithmetic is read or refused."""
        check_fields(cfg, cfg.get("model_type", "llama"))
        return cls.parse(cfg)

    @classmethod
    def parse(cls, cfg: dict) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        heads = cfg["num_attention_heads"]
        layers = cfg["num_hidden_layers"]
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} for {model_type}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
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
            rope_scaling=_rope_scaling(rope, cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=cfg.get("mlp_bias", False),
            layer_windows=_layer_windows(cfg, model_type, layers),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            bos_token_id=cfg.get("bos_token_id"),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            partial_rotary_factor=partial,
            moe=_moe(cfg, layers) if model_type == "qwen3_moe" else None,
        )


def _rope_scaling(rope: dict, cfg: dict) -> dict | None:
    """The rope parameters for `layers/rotary.py`, lengths and factors filled in as transformers does."""
    if not rope or rotary.rope_type(rope) == "default":
        return None
    rotary.check_rope(rope)
    kind = rotary.rope_type(rope)
    if kind in ("llama3", "yarn", "longrope"):
        original = cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = original or cfg.get("max_position_embeddings", 4096)
    if kind in ("yarn", "longrope") and rope.get("factor") is None:
        rope["factor"] = cfg.get("max_position_embeddings", 4096) / rope["original_max_position_embeddings"]
    return rope


def _moe(cfg: dict, layers: int) -> MoEConfig:
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ValueError("qwen3_moe config without num_experts")
    step = cfg.get("decoder_sparse_step", 1)
    only_mlp = set(cfg.get("mlp_only_layers") or [])
    sparse = [i not in only_mlp and step > 0 and (i + 1) % step == 0 for i in range(layers)]
    return MoEConfig(
        experts,
        cfg["num_experts_per_tok"],
        cfg["moe_intermediate_size"],
        bool(cfg.get("norm_topk_prob", False)),
        sparse,
    )


def _layer_windows(cfg: dict, model_type: str, layers: int) -> list[int | None]:
    window = cfg.get("sliding_window")
    qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")
    if qwen and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return [None] * layers
    if cfg.get("layer_types"):
        return [window if t == "sliding_attention" else None for t in cfg["layer_types"]]
    if qwen:
        first = cfg.get("max_window_layers", layers)
        return [window if i >= first else None for i in range(layers)]
    return [window] * layers
