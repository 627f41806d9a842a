"""A tiny random generator and step-tag PRM whose outputs have many reasoning steps.

The vocabulary is a handful of characters plus several tokens that end with the step
separator "\\n\\n", so a random model ends a step every few tokens and ends a solution
(EOS) now and then: beam search and DVTS run for several iterations, which is what the
search-equivalence tests need. Nothing here is trained; the PRM's scores are random but
deterministic, which is all those tests compare.
"""

from __future__ import annotations

import json
import os

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<|step|>"]
CHARS = list("abcdxyz0123456789+-*= ().,?")
STEP_TOKENS = ["\n\n", "a\n\n", "b\n\n", "c\n\n", ".\n\n", "1\n\n"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS + ["\n"] + STEP_TOKENS + ["C", "o", "m", "p", "u", "t", "e"])}
    merges = [("\n", "\n")] + [(t[0], "\n\n") for t in STEP_TOKENS[1:]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, ignore_merges=False))
    tok.add_special_tokens(SPECIALS)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="\n\n", behavior="merged_with_previous")
    tok.decoder = decoders.Fuse()
    return tok


def _save(out_dir: str, seed: int) -> str:
    os.makedirs(out_dir, exist_ok=True)
    tok = _tokenizer()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}, f)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0,
        eos_token_id=1, initializer_range=0.02,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def build_step_world(root: str) -> tuple[str, str]:
    """(generator dir, PRM dir) under root."""
    generator = _save(os.path.join(root, "generator"), seed=1)
    prm = _save(os.path.join(root, "prm"), seed=2)
    with open(os.path.join(prm, "prm_config.json"), "w") as f:
        json.dump({"style": "step_tag", "step_tag": "<|step|>", "good_token": "a", "bad_token": "b",
                   "step_separator": "\n\n", "prompt_format": "{question}"}, f)  # fmt: skip
    return generator, prm
