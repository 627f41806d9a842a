"""Tiny random PRM checkpoints shaped like the real ones, for the PRM adapter tests.

Each builder starts from `tests.tiny_models` (the trained byte-level BPE tokenizer and a
random transformers model saved with `save_pretrained`), adds the special tokens, the
pre-tokenizer regex and a chat template like the real model's, and rewrites config.json
and model.safetensors so tensor names and `architectures` follow the real checkpoint:

- `rlhflow`: Llama with a Llama-3 chat template (RLHFlow/Llama3.1-8B-PRM-Deepseek-Data).
- `reward_head`: Qwen2, no lm_head, `score.0`/`score.2` head, "Qwen2ForProcessRewardModel"
  (Qwen/Qwen2.5-Math-PRM-7B).
- `value_head`: Qwen2 with tied embeddings plus `v_head.summary`, "Qwen2ForPrmModel"
  (Skywork/Skywork-o1-Open-PRM-Qwen-2.5-1.5B).
"""

from __future__ import annotations

import functools
import json
import os

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, pre_tokenizers, processors

from tests.tiny_models import build_checkpoint, save_tokenizer, train_tokenizer

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN2_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<extra_0>"]


@functools.cache
def _base_vocab_size() -> int:
    return train_tokenizer().get_vocab_size()


def _tokenizer(out_dir: str, family: str, bos: str | None = None) -> None:
    """Write tokenizer files in the style of a Llama-3 or Qwen2 checkpoint."""
    tok = train_tokenizer()
    if family == "llama3":
        tok.add_special_tokens(LLAMA3_TOKENS)
        bos_id = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos_id)]
        )
        split, config = LLAMA3_SPLIT, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        config["chat_template"] = LLAMA3_TEMPLATE
    else:
        tok.add_special_tokens(QWEN2_TOKENS)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        split, config = QWEN2_SPLIT, {"bos_token": bos, "eos_token": "<|im_end|>", "chat_template": QWEN2_TEMPLATE}
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    save_tokenizer(tok, out_dir)
    config.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=4096)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)


def _write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def _edit_checkpoint(out_dir: str, architectures: list[str], drop: tuple[str, ...], add: dict[str, torch.Tensor]):
    path = os.path.join(out_dir, "model.safetensors")
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    save_file({**tensors, **add}, path, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = architectures
    _write_json(config_path, config)


def build_rlhflow(out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    vocab = _base_vocab_size() + len(LLAMA3_TOKENS)
    build_checkpoint(out_dir, "llama", seed=1, vocab_size=vocab, initializer_range=0.3)
    _tokenizer(out_dir, "llama3")
    return out_dir


def build_reward_head(out_dir: str, hidden: int = 64) -> str:
    os.makedirs(out_dir, exist_ok=True)
    vocab = _base_vocab_size() + len(QWEN2_TOKENS)
    build_checkpoint(out_dir, "qwen2", seed=2, vocab_size=vocab, hidden_size=hidden, tie_word_embeddings=False)
    _tokenizer(out_dir, "qwen2")
    g = torch.Generator().manual_seed(2)
    head = {
        "score.0.weight": torch.randn(hidden, hidden, generator=g) * 0.3,
        "score.0.bias": torch.randn(hidden, generator=g) * 0.3,
        "score.2.weight": torch.randn(2, hidden, generator=g) * 0.3,
        "score.2.bias": torch.randn(2, generator=g) * 0.3,
    }
    _edit_checkpoint(out_dir, ["Qwen2ForProcessRewardModel"], ("lm_head.weight",), head)
    return out_dir


def build_value_head(out_dir: str, hidden: int = 64) -> str:
    os.makedirs(out_dir, exist_ok=True)
    vocab = _base_vocab_size() + len(QWEN2_TOKENS)
    build_checkpoint(out_dir, "qwen2", seed=3, vocab_size=vocab, hidden_size=hidden, tie_word_embeddings=True)
    _tokenizer(out_dir, "qwen2", bos="<|endoftext|>")  # Skywork's prepare_input prepends the BOS text
    g = torch.Generator().manual_seed(3)
    head = {
        "v_head.summary.weight": torch.randn(1, hidden, generator=g),
        "v_head.summary.bias": torch.randn(1, generator=g),
    }
    _edit_checkpoint(out_dir, ["Qwen2ForPrmModel"], (), head)
    return out_dir


def build_arith_step_tag(out_dir: str) -> str:
    """A random model in the shipped arithmetic PRM's format, written by its own training code."""
    from pathlib import Path

    import transformers

    from tools.arith import common, prm_io

    config = common.model_config(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)
    config.initializer_range = 0.3
    torch.manual_seed(4)
    model = transformers.LlamaForCausalLM(config).eval()
    common.save_checkpoint(model, Path(out_dir), extra_files={"prm_config.json": prm_io.PRM_FORMAT})
    return out_dir
