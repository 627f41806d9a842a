"""Write tiny GGUF files from tiny Hugging Face checkpoints, the way llama.cpp's converter does.

Mirrors `convert_hf_to_gguf.py` for what the loader must undo: Llama q/k rows permuted for
interleaved rope, Gemma norm weights stored as 1 + w, llama.cpp tensor names, 2-D weights and
stacked experts quantised (Q8_0, Q5_0, Q4_0 rotate over the tensors; or F32/F16), norms in F32.
Phi-3 as its `Phi3MiniModel`: q/k/v and gate/up kept fused (`attn_qkv`, `ffn_up`), the rotated
dims, the pretraining length and longrope's factor tensors. The tokenizer goes in as llama.cpp's
"gpt2" type (byte-level BPE with merges), which the tiny checkpoints use.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
from safetensors.numpy import load_file

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_feedforward_layernorm": "post_ffw_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
}
EXPERT_TENSORS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows from halves to interleaved pairs."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _gguf_name(name: str, arch: str) -> str:
    name = name.removeprefix("model.")
    globals_ = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if name in globals_:
        return globals_[name]
    if name == "lm_head.weight":
        return "output.weight"
    _, layer, rest = name.split(".", 2)
    module, suffix = rest.rsplit(".", 1)
    if module == "post_attention_layernorm":
        return f"blk.{layer}.{'post_attention_norm' if arch == 'gemma3' else 'ffn_norm'}.{suffix}"
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{suffix}"


# where each format keeps its fp16 scales (byte offsets in a block): random blocks get sane ones
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """uint8 [rows, bytes a row] of random blocks of `qtype` with fp16 scales ~ N(0, scale) (the
    gguf package cannot quantise to the K formats; random blocks exercise every bit of them)."""
    weights, nbytes = BLOCKS[qtype]
    data = rng.integers(0, 256, size=(rows, cols // weights, nbytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        values = (rng.standard_normal((rows, cols // weights)) * scale).astype(np.float16)
        data[:, :, offset : offset + 2] = values.view(np.uint8).reshape(rows, cols // weights, 2)
    return data.reshape(rows, -1)


def write_gguf(hf_dir: str, out_path: str, arch: str, quants: tuple[str, ...] = ("Q8_0", "Q5_0", "Q4_0")) -> str:
    """arch: 'llama', 'qwen2', 'qwen3', 'qwen3moe', 'phi3' or 'gemma3'; 2-D weights take the formats
    `quants` in turn (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 quantised from the checkpoint, K formats random
    blocks, F32/F16 as they are), stacked experts the same but Q8_0 for a K format. Returns out_path."""
    import gguf

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if arch == "gemma3":
        writer.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
        writer.add_sliding_window(cfg["sliding_window"])
        default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(cfg["num_hidden_layers"])]
        if cfg["layer_types"] != default:  # as newer converters write it
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    else:
        writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    if arch == "qwen3moe":  # every expert's matrices of a layer as one 3-D tensor, as llama.cpp's converter
        writer.add_expert_count(cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        tensors = _stack_experts(tensors, cfg["num_local_experts"])
    if arch == "phi3":
        tensors = {**tensors, **_add_phi3(writer, cfg, heads)}
    _add_tokenizer(writer, hf_dir, cfg)
    rng = np.random.default_rng(0)
    for i, (name, data) in enumerate(sorted(tensors.items())):
        data = data.astype(np.float32)
        qname = quants[i % len(quants)]
        if name.startswith("rope_factors"):
            writer.add_tensor(name, data)
            continue
        if data.ndim == 3:  # stacked experts
            qname = "Q8_0" if qname.endswith("_K") else qname
            _add_matrix(writer, name, data, qname)
            continue
        if arch == "llama" and ".q_proj." in name:
            data = _permute(data, heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _permute(data, kv_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0
        target = _gguf_name(name, arch)
        qtype = gguf.GGMLQuantizationType[qname]
        if data.ndim == 2 and qname.endswith("_K") and data.shape[1] % BLOCKS[qname][0] == 0:
            writer.add_tensor(target, random_blocks(qname, *data.shape, rng, scale=0.002), raw_dtype=qtype)
        elif data.ndim == 2 and not qname.endswith("_K"):
            _add_matrix(writer, target, data, qname)
        else:
            writer.add_tensor(target, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _add_matrix(writer, name: str, data: np.ndarray, qname: str) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    """A matrix (or stack of them) in `qname`, quantised by the gguf package; F32 where its rows
    are no whole 32-weight blocks."""
    import gguf

    if qname in ("F32", "F16"):
        writer.add_tensor(name, data.astype(np.float16 if qname == "F16" else np.float32))
    elif data.shape[-1] % 32:
        writer.add_tensor(name, data)
    else:
        qtype = gguf.GGMLQuantizationType[qname]
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _add_phi3(writer, cfg: dict, heads: int) -> dict[str, np.ndarray]:  # noqa: ANN001 - gguf.GGUFWriter
    """Phi3MiniModel's metadata (rotated dims, pretraining length, no sliding window as 0) and,
    for longrope, its attention factor; returns longrope's factor tensors (none without it)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 1.0)
    original = cfg["original_max_position_embeddings"]
    writer.add_rope_dimension_count(int(partial * cfg["hidden_size"]) // heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type") != "longrope":
        return {}
    scale = cfg["max_position_embeddings"] / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return {
        "rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32),
    }


def _stack_experts(tensors: dict[str, np.ndarray], experts: int) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with each layer's experts stacked under llama.cpp's names
    (`blk.N.ffn_gate_exps.weight`: [experts, rows, cols])."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = {int(k.split(".")[2]) for k in tensors if ".mlp.experts." in k}
    for layer in sorted(layers):
        for proj, target in EXPERT_TENSORS.items():
            names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(experts)]
            out[f"blk.{layer}.{target}.weight"] = np.stack([tensors[n] for n in names])
    return out


def _add_tokenizer(writer, hf_dir: str, cfg: dict) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(specials)
    tokens = [""] * (max(vocab.values()) + 1)
    for text, token_id in vocab.items():
        tokens[token_id] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(True)
