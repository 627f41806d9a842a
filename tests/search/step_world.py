"""A tiny random generator and step-tag PRM whose outputs have many reasoning steps.

The vocabulary is a handful of characters plus several tokens that end with the step
separator "\\n\\n", so a random model ends a step every few tokens and ends a solution
(EOS) now and then: beam search and DVTS run for several iterations, which is what the
search-equivalence tests need. Nothing here is trained; the PRM's scores are random but
deterministic, which is all those tests compare.

`build_step_world(root, think=True)` is a reasoning world: `<think>` and `</think>` are tokens
of their own (added, not special, as in Qwen3's and DeepSeek-R1's tokenizers and
`tests/engine/thinking_model.py`), the chat template opens the think block at the end of the
prompt (DeepSeek-R1's), and the random generator writes the tags now and then, inside steps and
as steps of their own.
"""

from __future__ import annotations

import json
import os

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<|step|>"]
CHARS = list("abcdxyz0123456789+-*= ().,?")
STEP_TOKENS = ["\n\n", "a\n\n", "b\n\n", "c\n\n", ".\n\n", "1\n\n"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


THINK_TAGS = ["<think>", "</think>"]


def _tokenizer(think: bool = False) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS + ["\n"] + STEP_TOKENS + ["C", "o", "m", "p", "u", "t", "e"])}
    merges = [("\n", "\n")] + [(t[0], "\n\n") for t in STEP_TOKENS[1:]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, ignore_merges=False))
    tok.add_special_tokens(SPECIALS)
    if think:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="\n\n", behavior="merged_with_previous")
    tok.decoder = decoders.Fuse()
    return tok


# the generator's family (`build_step_world(family=...)`): its distinguishing shape at this size
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        {"partial_rotary_factor": 0.75, "pad_token_id": None},
    ),
}


def _save(out_dir: str, seed: int, think: bool = False, family: str = "llama") -> str:
    os.makedirs(out_dir, exist_ok=True)
    tok = _tokenizer(think)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    template = TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|><think>{% endif %}") if think else TEMPLATE
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}, f)
    config_class, model_class, shape = FAMILIES[family]
    config = config_class(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.02,
        tie_word_embeddings=False,
        **shape,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    if think:  # the tags' logits spread wider: a tag is likely at some positions (a few in a search), not ~1/50
        with torch.no_grad():
            model.lm_head.weight[[tok.token_to_id(t) for t in THINK_TAGS]] *= 15.0
    model.save_pretrained(out_dir)
    return out_dir


def build_step_world(root: str, think: bool = False, family: str = "llama") -> tuple[str, str]:
    """(generator dir, PRM dir) under root; with `think`, both tokenizers have the think tags; the
    generator of `family` (FAMILIES), the PRM a Llama."""
    generator = _save(os.path.join(root, "generator"), seed=1, think=think, family=family)
    prm = _save(os.path.join(root, "prm"), seed=2, think=think)
    with open(os.path.join(prm, "prm_config.json"), "w") as f:
        json.dump(
            {
                "style": "step_tag",
                "step_tag": "<|step|>",
                "good_token": "a",
                "bad_token": "b",
                "step_separator": "\n\n",
                "prompt_format": "{question}",
            },
            f,
        )
    return generator, prm
