"""Builders for the tiny checkpoints the tests use: random weights in Hugging Face format.

Each checkpoint is a real HF directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template) written by transformers' `save_pretrained`,
with a byte-level BPE tokenizer trained here by `tokenizers`. Nothing is downloaded.
`build_random_weights_dir` writes the same minus the weights: a `random_weights.json` marker
makes the loader draw them (models/loader.py).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Compute (12 + 7) * 3 - 15.\n\nStep 1: 12 + 7 = 19.\n\nStep 2: 19 * 3 = 57.\n\nThe answer is 42.",
    "Unicode: café, naïve, Straße, 日本語, emoji 🙂, Ελληνικά.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 -42",
    "def f(x):\n    return x * x  # square\n\n",
    "Once upon a time, in a land far away, there lived a small model that liked to count.",
]


def train_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tok


def save_tokenizer(tok, out_dir: str) -> None:
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def tiny_shape(tok: Tokenizer) -> dict:
    """The tiny models' shape (config.json keys) for tokenizer `tok`."""
    return dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
    )


def build_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Write a tiny random checkpoint of `arch` (llama | qwen2 | mistral | gemma3_text | qwen3 |
    qwen3_moe | phi3) to out_dir, in each family's real layout (ARCH_DEFAULTS: the shapes that set
    it apart, such as Qwen3's head_dim or Phi-4-mini's partial rotary heads)."""
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    tok = train_tokenizer()
    save_tokenizer(tok, out_dir)
    common = {**tiny_shape(tok), "initializer_range": 0.1, **ARCH_DEFAULTS.get(arch, {})}
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).eval()
    if arch in ("qwen3", "qwen3_moe"):  # q/k norm weights start at 1: make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "q_norm" in name or "k_norm" in name:
                    param.normal_(1, 0.5)
    if arch == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch == "gemma3_text":  # Gemma's norm weights start at 0 (a gain of 1): make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


# Each family's distinguishing shape at tiny size (overrides of `tiny_shape`).
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
}
ARCH_DEFAULTS: dict[str, dict] = {
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},  # head_dim != hidden / heads, as Qwen3's
    "qwen3_moe": {
        "head_dim": 32,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
    "phi3": {  # Phi-4-mini's partial rotary heads and longrope, its pretraining length cut to 64
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "original_max_position_embeddings": 64,
        "pad_token_id": None,
        "rope_scaling": LONGROPE,
    },
}


def build_random_weights_dir(out_dir: str, seed: int = 0, **overrides) -> str:
    """A tiny Llama directory with no weight file: config.json, the tokenizer and the loader's
    random-weights marker with `seed`."""
    from treeserve.models.loader import RANDOM_WEIGHTS

    os.makedirs(out_dir, exist_ok=True)
    tok = train_tokenizer()
    save_tokenizer(tok, out_dir)
    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        **tiny_shape(tok),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    config.update(overrides)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out_dir, RANDOM_WEIGHTS), "w") as f:
        json.dump({"seed": seed}, f)
    return out_dir
