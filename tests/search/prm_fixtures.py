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
- `token_classification`: `Qwen2ForTokenClassification` / `LlamaForTokenClassification`
  (num_labels=2) saved by transformers itself, as TRL's PRMTrainer leaves it
  (HuggingFaceH4/Qwen2.5-Math-1.5B-Instruct-PRM-0.2).
- `orm`: `LlamaForSequenceClassification` (num_labels=1) saved by transformers itself
  (Skywork/Skywork-Reward-V2-Llama-3.1-8B), or Qwen2 with a `score.0`/`score.2` head of one
  output, "Qwen2ForRewardModel" (Qwen/Qwen2.5-Math-RM-72B).
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
    return _qwen2_with_head(out_dir, hidden, seed=2, classes=2, architecture="Qwen2ForProcessRewardModel")


def _qwen2_with_head(out_dir: str, hidden: int, seed: int, classes: int, architecture: str) -> str:
    """Qwen2 without lm_head and a two-layer head: `score.0` (hidden->hidden), `score.2` (hidden->classes)."""
    os.makedirs(out_dir, exist_ok=True)
    vocab = _base_vocab_size() + len(QWEN2_TOKENS)
    build_checkpoint(out_dir, "qwen2", seed=seed, vocab_size=vocab, hidden_size=hidden, tie_word_embeddings=False)
    _tokenizer(out_dir, "qwen2")
    g = torch.Generator().manual_seed(seed)
    head = {
        "score.0.weight": torch.randn(hidden, hidden, generator=g) * 0.3,
        "score.0.bias": torch.randn(hidden, generator=g) * 0.3,
        "score.2.weight": torch.randn(classes, hidden, generator=g) * 0.3,
        "score.2.bias": torch.randn(classes, generator=g) * 0.3,
    }
    _edit_checkpoint(out_dir, [architecture], ("lm_head.weight",), head)
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


def _head_config(family: str, **overrides):
    """A tiny transformers config of `family` (qwen2 | llama) for the PRM tokenizer of that family."""
    import transformers

    from tests.tiny_models import tiny_shape

    tokens = QWEN2_TOKENS if family == "qwen2" else LLAMA3_TOKENS
    shape = {**tiny_shape(train_tokenizer()), "vocab_size": _base_vocab_size() + len(tokens), "initializer_range": 0.3}
    config_cls = transformers.Qwen2Config if family == "qwen2" else transformers.LlamaConfig
    return config_cls(**{**shape, **overrides})


def build_token_classification(out_dir: str, family: str = "qwen2", bias: bool = True) -> str:
    """A TRL-style PRM: `<Family>ForTokenClassification` with 2 labels, written by save_pretrained."""
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    config = _head_config(family, num_labels=2, token_classification_bias=bias)
    model_cls = getattr(transformers, ("Qwen2" if family == "qwen2" else "Llama") + "ForTokenClassification")
    torch.manual_seed(5)
    model_cls(config).eval().save_pretrained(out_dir)
    _tokenizer(out_dir, "qwen2" if family == "qwen2" else "llama3")
    return out_dir


def build_sequence_classification(out_dir: str) -> str:
    """A Skywork-Reward-V2-style ORM: LlamaForSequenceClassification, 1 label, written by save_pretrained."""
    import transformers

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(6)
    transformers.LlamaForSequenceClassification(_head_config("llama", num_labels=1)).eval().save_pretrained(out_dir)
    _tokenizer(out_dir, "llama3")
    return out_dir


def build_qwen_reward_model(out_dir: str, hidden: int = 64) -> str:
    """A Qwen2.5-Math-RM-style ORM: Qwen2 without lm_head, `score.0` (hidden->hidden), `score.2` (hidden->1)."""
    return _qwen2_with_head(out_dir, hidden, seed=7, classes=1, architecture="Qwen2ForRewardModel")
