"""A tiny reasoning model for the thinking-budget and reasoning-parser tests.

The tiny tokenizer of `tests/tiny_models.py` with `<think>` and `</think>` added as tokens of
their own (as Qwen3's and DeepSeek-R1's tokenizers add them: one token each, their text kept in
decoded output), and a random-weight Llama over it (the loader draws the weights). The chat
template opens the think block at the end of the prompt, as DeepSeek-R1's does.
"""

from __future__ import annotations

import json
import os

from tests.tiny_models import CHAT_TEMPLATE, build_random_weights_dir, save_tokenizer, train_tokenizer

R1_TEMPLATE = CHAT_TEMPLATE.replace("'<|assistant|>\n'", "'<|assistant|>\n<think>\n'")


def build_thinking_dir(out_dir: str, special: bool = False, template: str = R1_TEMPLATE) -> str:
    """A random-weight checkpoint whose tokenizer has `<think>` and `</think>` (`special`: as
    special tokens, whose text decoding skips)."""
    from tokenizers import AddedToken

    build_random_weights_dir(out_dir)
    tok = train_tokenizer()
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in ("<think>", "</think>")])
    save_tokenizer(tok, out_dir)
    with open(os.path.join(out_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out_dir, "config.json")) as f:
        model = json.load(f)
    model["vocab_size"] = tok.get_vocab_size()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model, f, indent=1)
    return out_dir
