"""Write a small random-weight Llama checkpoint in Hugging Face format, with no downloads.

Used by `treeserve generate` when the project's trained arithmetic generator is not
installed: the text is noise, but every engine path (paged KV, prefix cache, continuous
batching, sampling, stop strings, chat template) runs for real on a real checkpoint
directory. Needs only torch, safetensors and tokenizers (no transformers).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "Compute (12 + 7) * 3 - 15.\n\n12 + 7 = 19.\n\n19 * 3 = 57.\n\n57 - 15 = 42.\n\nThe answer is \\boxed{42}.",
    "The quick brown fox jumps over the lazy dog. Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]


def default_dir() -> Path:
    return Path(os.environ.get("TREESERVE_CACHE", Path.home() / ".cache" / "treeserve")) / "demo-llama"


def build_demo_checkpoint(out_dir: Path | None = None, seed: int = 0) -> Path:
    """Write (once) and return the directory of the demo checkpoint."""
    out_dir = Path(out_dir or default_dir())
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 50, trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    config = dict(CONFIG, vocab_size=tok.get_vocab_size())
    save_file(_random_weights(config, seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))  # last: marks the directory complete
    return out_dir


def _random_weights(c: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": w(c["vocab_size"], hidden),
        "lm_head.weight": w(c["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": w(hidden, hidden),
                p + "self_attn.k_proj.weight": w(kv, hidden),
                p + "self_attn.v_proj.weight": w(kv, hidden),
                p + "self_attn.o_proj.weight": w(hidden, hidden),
                p + "mlp.gate_proj.weight": w(inter, hidden),
                p + "mlp.up_proj.weight": w(inter, hidden),
                p + "mlp.down_proj.weight": w(hidden, inter),
                p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            }
        )
    return tensors
