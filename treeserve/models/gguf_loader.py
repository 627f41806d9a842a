"""GGUF files (llama.cpp's format) as checkpoints: the metadata as the model's `config.json`,
every tensor under its Hugging Face name (kept in its blocks for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K; else dequantised by `gguf`), llama.cpp's converter undone (Llama's q/k row
permutation, Gemma's 1 + w norms); `convert_gguf` writes an HF directory.
Architectures: llama (no llama3 rope scaling), qwen2, qwen3, qwen3moe (3-D experts become a
matrix an expert, views of the file), phi3 (fused `attn_qkv` / `ffn_up`, longrope factor
tensors), gemma3 (llama.cpp's in-code defaults for older files: every 6th layer global, local
rope base 10000, query_pre_attn_scalar = head_dim).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterator
from functools import cached_property, lru_cache

import gguf
import numpy as np
import torch

from treeserve.layers.quant import KERNEL_FORMATS, QuantPart, QuantTensor
from treeserve.models.gguf_file import GGUFFile

log = logging.getLogger(__name__)

ARCH_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma3": "gemma3_text",
}
ARCH_NAMES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

_LAYER_NAMES = {  # llama.cpp's name after blk.N. -> HF's after model.layers.N.
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",  # Gemma 3: pre_feedforward_layernorm (below)
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",  # Qwen3-MoE: the router
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


@lru_cache(maxsize=2)
def _read(path: str, size: int, mtime_ns: int) -> GGUFFile:  # noqa: ARG001 - size/mtime key the cache
    return GGUFFile(path)


def read_gguf(path: str) -> GGUFFile:
    """The file's memory-mapped reader, one parse per file version (loader and tokenizer share it)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    stat = os.stat(path)
    return _read(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


class GGUFCheckpoint:
    def __init__(self, path: str):
        self.reader = read_gguf(path)
        self.path = path
        self.arch = self.field("general.architecture")
        if self.arch not in ARCH_MODEL_TYPES:
            raise ValueError(
                f"unsupported GGUF architecture {self.arch!r} in {path!r} (supported: {sorted(ARCH_MODEL_TYPES)})"
            )
        self.tensor_names = {t.name for t in self.reader.tensors}
        self.layer_names = {"gemma3": _GEMMA_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}.get(self.arch, _LAYER_NAMES)
        if self.arch == "phi3" and "blk.0.ffn_gate.weight" in self.tensor_names:  # gate apart: ffn_up is up alone
            self.layer_names = _LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj"}

    def field(self, key: str, default: object = None) -> object:
        entry = self.reader.fields.get(key)
        return default if entry is None else entry.contents()

    def _arch_field(self, key: str, default: object = None) -> object:
        return self.field(f"{self.arch}.{key}", default)

    @cached_property
    def config(self) -> dict:
        heads = self._arch_field("attention.head_count")
        hidden = self._arch_field("embedding_length")
        layers = self._arch_field("block_count")
        vocab = self._arch_field("vocab_size") or len(self.reader.fields["tokenizer.ggml.tokens"].data)
        model_type = ARCH_MODEL_TYPES[self.arch]
        config = {
            "model_type": model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": self._arch_field("feed_forward_length"),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_field("attention.head_count_kv", heads),
            "head_dim": self._arch_field("attention.key_length", hidden // heads),
            "rms_norm_eps": self._arch_field("attention.layer_norm_rms_epsilon", 1e-6),
            "max_position_embeddings": self._arch_field("context_length", 4096),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
            "torch_dtype": "float32",
        }
        theta = float(self._arch_field("rope.freq_base", 10000.0))
        scaling = self._rope_scaling()
        if model_type == "gemma3_text":
            config.update(
                architectures=["Gemma3ForCausalLM"],
                hidden_activation="gelu_pytorch_tanh",
                sliding_window=self._arch_field("attention.sliding_window", 4096),
                layer_types=self._gemma_layer_types(layers),
                query_pre_attn_scalar=hidden // heads if layers == 62 else config["head_dim"],
                rope_parameters={
                    "full_attention": {"rope_type": "default", **(scaling or {}), "rope_theta": theta},
                    "sliding_attention": {
                        "rope_type": "default",
                        "rope_theta": float(self._arch_field("rope.freq_base_swa", 10000.0)),
                    },
                },
            )
        else:
            config.update(
                architectures=[ARCH_NAMES[model_type]], hidden_act="silu", rope_theta=theta, rope_scaling=scaling
            )
        if model_type == "phi3":
            config.update(self._phi3_fields(config["head_dim"]))
        if model_type == "qwen3_moe":  # llama.cpp routes every layer and renormalises the top k
            experts = self._arch_field("expert_feed_forward_length")
            config.update(
                num_experts=self._arch_field("expert_count"),
                num_experts_per_tok=self._arch_field("expert_used_count"),
                moe_intermediate_size=experts,
                norm_topk_prob=True,
                intermediate_size=config["intermediate_size"] or experts,
            )
        return config

    def _gemma_layer_types(self, layers: int) -> list[str]:
        """`attention.sliding_window_pattern`: a period (every n-th layer global) or one flag per layer."""
        pattern = self._arch_field("attention.sliding_window_pattern", 6)
        if isinstance(pattern, int):
            return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        return ["sliding_attention" if swa else "full_attention" for swa in pattern]

    def _phi3_fields(self, head_dim: int) -> dict:
        """Phi-3's rotated share of a head, pretraining length and sliding window (0: none)."""
        dims = self._arch_field("rope.dimension_count", head_dim)
        partial = dims / head_dim
        if int(head_dim * partial) != dims:
            raise ValueError(f"{self.path!r}: rope.dimension_count {dims} of head_dim {head_dim} is no share we rotate")
        return {
            "partial_rotary_factor": partial,
            "sliding_window": self._arch_field("attention.sliding_window") or None,
            "original_max_position_embeddings": self._arch_field("rope.scaling.original_context_length"),
        }

    def _rope_scaling(self) -> dict | None:
        if "rope_freqs.weight" in self.tensor_names:
            raise ValueError(f"{self.path!r} uses per-frequency rope factors (llama3 rope scaling): not supported")
        kind = self._arch_field("rope.scaling.type", "none")
        if self.tensor_names & set(_ROPE_FACTORS) and kind in ("none", None, "longrope", "su"):
            return self._longrope()
        if kind in ("none", None):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self._arch_field("rope.scaling.factor"))}
        raise ValueError(f"unsupported rope scaling {kind!r} in {self.path!r} (supported: linear)")

    def _longrope(self) -> dict:
        """longrope from its factor tensors; the attention factor is HF's formula unless the file has one."""
        factors = {key: self._vector(name) for name, key in _ROPE_FACTORS.items() if name in self.tensor_names}
        original = self._arch_field("rope.scaling.original_context_length")
        if len(factors) != 2 or not original:
            needs = "rope_factors_long, rope_factors_short and rope.scaling.original_context_length"
            raise ValueError(f"{self.path!r}: longrope needs {needs}")
        scaling = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(original)}
        scale = self._arch_field("context_length", 4096) / original
        formula = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        attention_factor = self._arch_field("rope.scaling.attn_factor", formula)
        if not math.isclose(attention_factor, formula, rel_tol=1e-6):  # the file's value is float32
            scaling["attention_factor"] = float(attention_factor)
        return scaling

    def _vector(self, name: str) -> list[float]:
        tensor = next(t for t in self.reader.tensors if t.name == name)
        return np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1).tolist()

    def hf_name(self, name: str) -> str:
        stem, _, suffix = name.rpartition(".")
        if stem in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[stem]}.{suffix}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.layer_names:
            return f"model.layers.{parts[1]}.{self.layer_names[parts[2]]}.{suffix}"
        raise ValueError(f"unknown tensor {name!r} in GGUF file {self.path!r}")

    def tensors(self, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """(HF name, tensor in HF layout) for every tensor: fp32, or with `keep_quantized` a
        `QuantTensor` over the file's bytes where the kernels take the format."""
        heads = self.config["num_attention_heads"]
        kv_heads = self.config["num_key_value_heads"]
        dequantized: set[str] = set()
        for tensor in self.reader.tensors:
            if tensor.name in _ROPE_FACTORS:
                continue
            name = self.hf_name(tensor.name)
            kind = tensor.tensor_type
            if keep_quantized and _kept_quantized(tensor):
                yield from self._quantized(name, tensor, heads, kv_heads)
                continue
            if keep_quantized and kind.name not in _DENSE and kind.name not in dequantized:
                dequantized.add(kind.name)
                log.warning("%s: %s tensors have no quantised kernel; dequantising them on load", self.path, kind.name)
            values = np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            values = values.reshape([int(d) for d in reversed(tensor.shape)])
            weight = torch.from_numpy(values.copy())
            if self.arch == "llama" and ".q_proj." in name:
                weight = _unpermute_rope_rows(weight, heads)
            elif self.arch == "llama" and ".k_proj." in name:
                weight = _unpermute_rope_rows(weight, kv_heads)
            elif self.arch == "gemma3" and name.endswith("norm.weight"):
                weight = weight - 1.0
            if ".mlp.experts." in name:  # each expert's matrix under its own name
                for expert, matrix in enumerate(weight):
                    yield _expert_name(name, expert), matrix
                continue
            yield name, weight

    def quantized_blocks(self) -> dict[str, tuple[int, str, int]]:
        """(input width, format, weights a block) of each matrix kept in blocks, from the tensor table."""
        return {
            self.hf_name(t.name): (int(t.shape[0]), t.tensor_type.name, gguf.GGML_QUANT_SIZES[t.tensor_type][0])
            for t in self.reader.tensors
            if _kept_quantized(t)
        }

    def _quantized(self, name: str, tensor: object, heads: int, kv_heads: int) -> Iterator[tuple[str, QuantTensor]]:
        """The tensor's blocks as one matrix, or stacked experts' as one matrix an expert."""
        data = torch.from_numpy(tensor.data)  # a view of the copy-on-write memory map
        if self.arch == "llama" and ".q_proj." in name:
            data = _unpermute_rope_rows(data, heads).contiguous()
        elif self.arch == "llama" and ".k_proj." in name:
            data = _unpermute_rope_rows(data, kv_heads).contiguous()
        qtype, cols = tensor.tensor_type.value, int(tensor.shape[0])
        if data.dim() == 2:
            yield name, QuantTensor([QuantPart(qtype, data)], cols)
            return
        for expert, rows in enumerate(data):  # an expert's rows are contiguous
            yield _expert_name(name, expert), QuantTensor([QuantPart(qtype, rows)], cols)


_DENSE = {"F32", "F16", "BF16", "F64"}


def _kept_quantized(tensor: object) -> bool:
    stacked = len(tensor.shape) == 3 and "_exps." in tensor.name
    return (len(tensor.shape) == 2 or stacked) and tensor.tensor_type.value in KERNEL_FORMATS


def _expert_name(name: str, expert: int) -> str:
    """`mlp.experts.gate_proj.weight` -> `mlp.experts.3.gate_proj.weight` (the Hub's layout)."""
    return name.replace(".experts.", f".experts.{expert}.")


def _unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which reorders each head's rows from halves to pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def convert_gguf(path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write the GGUF model as a Hugging Face directory (weights in `dtype`); return out_dir."""
    from safetensors.torch import save_file

    from treeserve.models.gguf_tokenizer import tokenizer_from_gguf

    checkpoint = GGUFCheckpoint(path)
    config = dict(checkpoint.config, torch_dtype=str(dtype).removeprefix("torch."))
    tokenizer, tokenizer_config = tokenizer_from_gguf(checkpoint.reader)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: t.to(dtype).contiguous() for name, t in checkpoint.tensors()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    files = {
        "config.json": config,
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config},
        "generation_config.json": generation,
    }
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)
    return out_dir
