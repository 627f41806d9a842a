"""Benchmark inputs built here, never downloaded: random-weight Llama checkpoints and prompts.

`build_random_llama` writes a Hugging Face directory (bf16 safetensors, a WordLevel
tokenizer of the requested vocabulary) that treeserve, transformers and vLLM all load.
"""

from __future__ import annotations

import json
import os
import random


def build_random_llama(
    out_dir: str,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 8192,
    intermediate: int | None = None,
    seed: int = 0,
) -> str:
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(out_dir, exist_ok=True)
    words = {"<s>": 0, "</s>": 1, "<unk>": 2}
    words.update({f"w{i}": i for i in range(3, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 2048,
            },
            f,
        )
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir


def random_prompts(count: int, mean_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(mean_len + rng.randint(-5, 5))] for _ in range(count)]
