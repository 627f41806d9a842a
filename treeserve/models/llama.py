"""The Llama family (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Phi-3/4-mini) on flat token batches
([T] ids and positions), calling an `Attention` per layer; it never sees pages or requests. q/k/v
and gate/up are fused (four matmuls a layer). On CUDA residual adds run inside the next norm
(`forward_fused`), rope inside the KV store and act(gate) * up in one kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from treeserve.distributed.groups import RankGroup
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels import triton as triton_kernels
from treeserve.layers.attention import Attention
from treeserve.layers.embedding import Embedding, vocab_parallel_lookup
from treeserve.layers.layer_stack import LayerStack
from treeserve.layers.linear import Linear, linear_kernel, widened_linear
from treeserve.layers.norm import RMSNorm
from treeserve.layers.rotary import RotaryEmbedding, rope_frequencies
from treeserve.models.config import ModelConfig


class LlamaAttentionBlock(nn.Module):
    tp: RankGroup | None = None  # o_proj's partial sums are all-reduced

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.window = cfg.layer_windows[layer]
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: Attention) -> torch.Tensor:
        heads, kv_heads, head_dim = self.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, heads, head_dim)
        k = k.view(-1, kv_heads, head_dim)
        v = v.view(-1, kv_heads, head_dim)
        q, k = self.norm_qk(q, k)
        if rope.use_triton:  # the engine rotates q and k as it stores k
            out = attn(self.layer, q, k, v, self.window, rope=(rope, positions))
        else:
            q, k = rope(q, k, positions)
            out = attn(self.layer, q, k, v, self.window)
        out = self.o_proj(out.reshape(-1, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not hasattr(self, "q_norm"):
            return q, k
        return self.q_norm(q), self.k_norm(k)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class LlamaMLP(nn.Module):
    """Gated MLP, down(act(gate(x)) * up(x)); Gemma uses it with a tanh-approximated GELU."""

    tp: RankGroup | None = None  # down_proj's partial sums are all-reduced

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        intermediate = intermediate_size or cfg.intermediate_size  # a routed expert's own size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * intermediate, bias=cfg.mlp_bias)
        self.down_proj = Linear(intermediate, cfg.hidden_size, bias=cfg.mlp_bias)
        self.hidden_act = cfg.hidden_act
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.use_triton = False  # CUDA: one launch
        self.act_table: torch.Tensor | None = None  # CPU bf16: one C pass

    def pick_kernel(self) -> None:
        device = self.down_proj.weight.device
        self.use_triton = triton_kernels.fused_layers(device)
        if device.type == "cpu" and cpu_kernels.load() is not None:
            self.act_table = cpu_kernels.act_table(self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) on this rank's rows: its share of the sum."""
        gate_up = self.gate_up_proj(x)
        if self.use_triton:
            from treeserve.kernels.triton.activation import gated_activation

            hidden = gated_activation(gate_up, self.hidden_act)
        elif self.act_table is not None and gate_up.dtype == torch.bfloat16:
            hidden = cpu_kernels.gated_act_bf16(gate_up, self.act_table)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.act(gate) * up
        return self.down_proj(hidden)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttentionBlock(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, positions, rope, attn):  # noqa: ANN001 - same types as the block
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, out, residual, positions, rope, attn):  # noqa: ANN001 - as forward
        """`forward` with each residual add inside the next norm (`add_norm`, vLLM's layout):
        `residual` is updated in place (None at the first layer); returns (out, residual)."""
        h, residual = self.input_layernorm.add_norm(out, residual)
        h, residual = self.post_attention_layernorm.add_norm(self.self_attn(h, positions, rope, attn), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    decoder_layer: type[nn.Module] = LlamaDecoderLayer  # subclasses swap the layer and norm
    final_norm: type[nn.Module] = RMSNorm
    tp: RankGroup | None = None  # vocab-parallel embedding and LM head

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size // cfg.tp_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = self.final_norm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size // cfg.tp_size, bias=False)
        self.rope: RotaryEmbedding | None = None
        self.logits_linear = F.linear  # the tied LM head's matmul
        self.layer_stack: LayerStack | None = None  # all layers of a step in one C call

    def init_rope(self, max_positions: int, device: torch.device | str) -> None:
        cfg = self.config
        self.rope = RotaryEmbedding(
            rope_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling), max_positions, device
        )

    def pick_kernel(self) -> None:
        """The tied LM head's matmul, the rope kernels and the layer stack (after the submodules)."""
        if hasattr(self, "embed_tokens"):
            weight = self.embed_tokens.weight
            widened = self.embed_tokens.widened  # a bf16 table held in fp32
            self.logits_linear = widened_linear if widened else linear_kernel(weight)
            dtype = torch.bfloat16 if widened else weight.dtype
        else:  # a later pipeline stage
            dtype = self.layers[0].input_layernorm.weight.dtype
        for rope in vars(self).values():
            if isinstance(rope, RotaryEmbedding):
                rope.pick_kernel(dtype, self.config.head_dim)
        cfg = self.config
        act = self.layers[0].mlp.act
        if cfg.tp_size == 1 and cfg.pp_size == 1:  # no place for collectives in one C call
            embedding = self.embed_tokens if hasattr(self, "embed_tokens") else None
            self.layer_stack = LayerStack.build(
                self.layers,
                self.norm,
                self.rope_tables(),
                act,
                cfg.intermediate_size,
                cfg.rms_norm_eps,
                embedding,
                self.embedding_scale(torch.bfloat16),
            )

    def attach(self, tp: RankGroup) -> None:
        for module in self.modules():
            if isinstance(module, LlamaAttentionBlock | LlamaMLP | LlamaForCausalLM):
                module.tp = tp

    def embedding_scale(self, dtype: torch.dtype) -> torch.Tensor | None:
        """What `embed` multiplies rows by (Gemma's 0-dim tensor); None: nothing."""
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            x = self.embed_tokens(input_ids)
        else:
            table = self.embed_tokens
            x = vocab_parallel_lookup(table.lookup, input_ids, table.weight, table.num_embeddings, self.tp)
        scale = self.embedding_scale(x.dtype)
        return x if scale is None else x * scale

    def rope_tables(self) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        """(global table, sliding-window table): two only in Gemma 3."""
        return self.rope, self.rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        stack = self.layer_stack
        if stack is not None and (normed := stack(input_ids, positions, attn, self.embed)) is not None:
            return normed
        return self.norm(self.run_layers(self.embed(input_ids), positions, attn))

    @property
    def fused_residual(self) -> bool:
        return len(self.layers) > 0 and self.layers[0].input_layernorm.use_triton

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, attn: Attention) -> torch.Tensor:
        """This model's decoder layers (all, or a pipeline stage's) on `x`."""
        global_rope, local_rope = self.rope_tables()
        if self.fused_residual:
            residual = None
            for layer in self.layers:
                rope = global_rope if layer.self_attn.window is None else local_rope
                x, residual = layer.forward_fused(x, residual, positions, rope, attn)
            return x + residual
        for layer in self.layers:
            x = layer(x, positions, global_rope if layer.self_attn.window is None else local_rope, attn)
        return x

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        if not self.config.has_lm_head:
            raise ValueError("this checkpoint has no LM head (a reward model): ask for hidden states instead")
        if self.config.tie_word_embeddings:
            weight = self.embed_tokens.weight
            logits = self.logits_linear(hidden.to(weight.dtype), weight)
        else:
            logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits)
        return logits.float() if float32 else logits

    @staticmethod
    def hf_to_local(name: str) -> tuple[str, str | None]:
        """Checkpoint name -> (local name, fused part or None); experts' projections too."""
        name = name.removeprefix("model.")
        for fused, parts in LlamaForCausalLM.FUSED_ORDER.items():
            for part in parts:
                if f".{part}." in name:
                    return name.replace(f".{part}.", f".{fused}."), part
        return name, None

    FUSED_ORDER = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
