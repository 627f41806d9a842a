"""Benchmark inputs built here, never downloaded: random-weight checkpoints, their shapes and prompts.

`build_random_llama` writes a Hugging Face directory (bf16 safetensors, a WordLevel
tokenizer of the requested vocabulary) that treeserve, transformers and vLLM all load.
`build_twin` writes a larger random-weight twin of a shipped arithmetic model (its
tokenizer, chat template and PRM format, a bigger Llama) for scaling benchmarks.
`build_random_weights_dir` writes no weights at all: config.json, a word-level tokenizer
(`word_level_tokenizer`) and treeserve's random-weights marker, which makes treeserve's loader
draw the weights on the device (treeserve/models/loader.py) and bench/peers/sal_search.py
build the config's model with transformers' initialisation: any size, in no time;
`build_random_files` writes the weights too, for engines that need a weight file (vLLM).
QWEN3_SHAPES holds the config.json of Qwen3-1.7B and Qwen3-30B-A3B, one definition for every
bench that runs them (`{**QWEN3_1_7B, "num_hidden_layers": 4}` for fewer layers).
"""

from __future__ import annotations

import json
import os
import random
import shutil

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "treeserve", "assets")
# twin sizes: hidden, layers, attention heads, KV heads, MLP width (head_dim 64 as in common Llamas)
TWIN_SIZES = {
    "s": (512, 8, 8, 4, 1408),  # ~24M parameters
    "m": (1024, 8, 16, 8, 2816),  # ~95M
    "l": (1536, 12, 24, 12, 4096),  # ~310M
}
# Qwen/Qwen3-1.7B's and Qwen/Qwen3-30B-A3B's config.json fields that shape the model (q/k norms come
# with model_type), bos 0 and eos 1 for the word-level tokenizer (`word_level_tokenizer`)
QWEN3_1_7B = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
QWEN3_30B_A3B = {
    **QWEN3_1_7B,
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
QWEN3_SHAPES = {"qwen3-1.7b": QWEN3_1_7B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def build_random_llama(
    out_dir: str,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 8192,
    intermediate: int | None = None,
    seed: int = 0,
    byte_level: bool = False,
    tie_word_embeddings: bool = False,
    max_positions: int = 2048,
) -> str:
    """`byte_level`: a byte-level BPE tokenizer of `vocab` tokens (trained here on text and
    JSON) instead of the word-level one, whose words cannot spell JSON or any free text.
    `tie_word_embeddings` and `max_positions` (the context) go into config.json as they are."""
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(out_dir, exist_ok=True)
    if byte_level:
        tok = _byte_level_tokenizer(vocab)
    else:
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
                "model_max_length": max_positions,
            },
            f,
        )
    return _save_random(
        out_dir,
        transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=intermediate or 4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=max_positions,
            bos_token_id=0,
            eos_token_id=1,
            tie_word_embeddings=tie_word_embeddings,
        ),
        seed,
    )


def _byte_level_tokenizer(vocab: int):  # noqa: ANN202 - tokenizers.Tokenizer
    """GPT-2-style byte-level BPE with <s>, </s>, <unk> as ids 0-2, trained on generated text
    and JSON (every byte is a token, so any text can be spelled)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["name", "age", "city", "people", "true", "false", "null"]
    words += ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(6000)]
    corpus = []
    for _ in range(4000):
        record = {
            rng.choice(words): rng.choice([rng.randint(-999, 9999), rng.choice(words) * rng.randint(1, 3)])
            for _ in range(rng.randint(1, 5))
        }
        corpus.append(json.dumps(record) + " " + " ".join(rng.choices(words, k=8)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>", "<unk>"], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def build_twin(size: str, role: str, out_root: str, seed: int = 0) -> str:
    """The shipped arithmetic `role` ("generator" or "prm") at `size`: the asset directory's
    tokenizer, chat template, generation and PRM config, a Llama of TWIN_SIZES[size] with the
    asset's vocabulary and context, random bf16 weights (seeded). Built once into
    out_root/size/role."""
    import transformers

    out_dir = os.path.join(out_root, size, role)
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    asset = os.path.join(ASSETS, f"arith-{role}")
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(asset):
        if name not in ("config.json", "model.safetensors", "README.md", "eval.json"):
            shutil.copy(os.path.join(asset, name), out_dir)
    with open(os.path.join(asset, "config.json")) as f:
        shipped = json.load(f)
    hidden, layers, heads, kv_heads, intermediate = TWIN_SIZES[size]
    shipped.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        head_dim=hidden // heads,
    )
    return _save_random(out_dir, transformers.LlamaConfig(**shipped), seed + (role == "prm"))


def _save_random(out_dir: str, config: object, seed: int) -> str:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    return out_dir


def build_random_files(out_dir: str, config: dict, seed: int = 0, step_tag_prm: bool = False) -> str:
    """`build_random_weights_dir`'s directory (config.json, the word-level tokenizer, with
    `step_tag_prm` the step-tag prm_config.json) with the weights
    written too, as bf16 safetensors under transformers' names for `config` (any model_type it knows):
    normal(0, 0.02) matrices and unit norms drawn straight in bf16, one tensor at a time, so a
    checkpoint of several GB is written without a model built in fp32 first. Every engine loads it."""
    import torch
    import transformers
    from safetensors.torch import save_file

    weights = os.path.join(out_dir, "model.safetensors")
    if os.path.isfile(weights):
        return out_dir
    build_random_weights_dir(out_dir, config, word_level_tokenizer(config["vocab_size"]), seed, step_tag_prm)
    os.remove(os.path.join(out_dir, "random_weights.json"))  # the marker would make treeserve draw its own
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.AutoModelForCausalLM.from_config(hf_config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
    save_file(tensors, weights, metadata={"format": "pt"})
    return out_dir


# random-weights directories' vocabulary: specials, a step tag and its two labels, then one word per id
WORD_SPECIALS = ["<s>", "</s>", "<unk>"]
STEP_TAG, GOOD, BAD = "ки", "+", "-"
FIRST_WORD = len(WORD_SPECIALS) + 3
STEP_TAG_PRM = {
    "style": "step_tag",
    "step_tag": STEP_TAG,
    "step_tag_id": 3,
    "good_token": GOOD,
    "good_token_id": 4,
    "bad_token": BAD,
    "bad_token_id": 5,
    "prompt_format": "{problem} ",
    "first_step_prefix": "",
    "step_format": "{step} " + STEP_TAG,
    "step_separator": "\n",
    "use_chat_template": False,
}
PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def word_level_tokenizer(vocab: int):  # noqa: ANN201 - tokenizers.Tokenizer
    """One word per id (`▁w<id>` from FIRST_WORD on), split at whitespace; decoding puts a space
    before every word, so decoded steps concatenate into text that encodes back to the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {w: i for i, w in enumerate(WORD_SPECIALS)}
    words.update({"▁" + w: len(WORD_SPECIALS) + i for i, w in enumerate((STEP_TAG, GOOD, BAD))})
    words.update({f"▁w{i}": i for i in range(FIRST_WORD, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(prepend_scheme="always")]
    )
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    tok.add_special_tokens(WORD_SPECIALS)
    return tok


def build_random_weights_dir(
    out_dir: str, config: dict, tokenizer: object, seed: int = 0, step_tag_prm: bool = False
) -> str:
    """A checkpoint directory without weights: `config` (config.json; bos 0, eos 1), the
    word-level `tokenizer` with a chat template that joins the messages' text, the loader's
    random-weights marker with `seed` and, with `step_tag_prm`, a step-tag prm_config.json."""
    from treeserve.models.loader import RANDOM_WEIGHTS

    os.makedirs(out_dir, exist_ok=True)
    tokenizer_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "chat_template": PLAIN_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.get("max_position_embeddings", 4096),
    }
    files = {"config.json": config, "tokenizer_config.json": tokenizer_config, RANDOM_WEIGHTS: {"seed": seed}}
    if step_tag_prm:
        files["prm_config.json"] = STEP_TAG_PRM
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=1)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def random_prompts(count: int, mean_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(mean_len + rng.randint(-5, 5))] for _ in range(count)]
