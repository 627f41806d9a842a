"""Shared pieces of the arithmetic-world training scripts: tokenizer, chat template,
model shapes, checkpoint writing, token encoding and batching.

Training-time only (uses torch and `transformers`); the runtime never imports `tools`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import re
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "treeserve" / "assets"
GENERATOR_DIR = ASSETS / "arith-generator"
PRM_DIR = ASSETS / "arith-prm"
# The shipped pair's recipe: its seed, and the thread counts it trained on (bf16 matmuls round
# differently on other thread counts, and the trained weights with them).
SHIPPED_SEED = 2
GENERATOR_THREADS = 1  # two runs on one thread wrote byte-identical generators
PRM_THREADS = 2  # the curriculum stages and the PRM's training
# Scratch (training logs, evaluation JSON): outside the repository, never committed.
WORK_DIR = Path(os.environ.get("TREESERVE_ARITH_WORK", Path(tempfile.gettempdir()) / "treeserve-arith"))


def generator_phase_dir(phase: int) -> Path:
    """Where `train_generator.train_recipe` writes every phase but the last (1-based)."""
    return WORK_DIR / f"generator-phase{phase}"


# The generator the PRM is built on and trained with: the recipe's generator before its copy phase.
PRM_BASE_DIR = generator_phase_dir(2)

PAD, BOS, EOS, USER, ASSISTANT, SYSTEM, STEP_TAG, UNK = (
    "<|pad|>",
    "<|bos|>",
    "<|end|>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|step|>",
    "<|unk|>",
)
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT, SYSTEM, STEP_TAG, UNK]
CHARS = ["\n"] + [chr(i) for i in range(32, 127)]
# Numbers are whole tokens: every string of 2-3 digits (leading zeros included) is one token,
# single digits are characters. Longer digit runs split into 3-digit pieces. With numbers as
# tokens an operation is a fact to look up, which a model this small learns in minutes;
# with digits as characters it must learn carrying, which takes it hours.
NUMBERS = [f"{n:0{width}d}" for width in (2, 3) for n in range(10**width)]
VOCAB = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + NUMBERS)}
_PIECE = re.compile(r"\d{1,3}|[\s\S]")
PAD_ID, BOS_ID, EOS_ID, STEP_TAG_ID = VOCAB[PAD], VOCAB[BOS], VOCAB[EOS], VOCAB[STEP_TAG]
GOOD_TOKEN, BAD_TOKEN = "+", "-"
GOOD_ID, BAD_ID = VOCAB[GOOD_TOKEN], VOCAB[BAD_TOKEN]

# System messages are dropped: the tiny models follow no instructions, and search
# recipes that always send a system prompt should still work.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MAX_POSITIONS = 512


def recipe_parser(doc: str, defaults: dict) -> argparse.ArgumentParser:
    """A training script's command line: `--seed` and one flag per recipe default
    (`lm_weight` -> `--lm-weight`, typed like its default)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SHIPPED_SEED)
    for name, value in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return parser


def set_threads(pinned: int | None = None) -> None:
    """Torch's thread count: `pinned` where a training recipe fixes it (float rounding, and so the
    trained weights, depend on it; `GENERATOR_THREADS`, `PRM_THREADS`), else `OMP_NUM_THREADS`
    (1 if unset: this machine is shared)."""
    threads = pinned or int(os.environ.setdefault("OMP_NUM_THREADS", "1"))
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set, or parallel work already started
        torch.set_num_interop_threads(1)


def build_tokenizer() -> Tokenizer:
    """Numbers of up to 3 digits are one token each; every other character is one token."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECE.pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def prompt_text(problem: str) -> str:
    """The chat template rendered for one user message, with the assistant prefix."""
    return f"{BOS}{USER}{problem}{EOS}{ASSISTANT}"


def encode_text(text: str) -> list[int]:
    """Fast encoding of plain text (no special tokens), identical to the tokenizer's."""
    unk = VOCAB[UNK]
    return [VOCAB.get(piece, unk) for piece in _PIECE.findall(text)]


def prompt_ids(problem: str) -> list[int]:
    return [BOS_ID, VOCAB[USER], *encode_text(problem), EOS_ID, VOCAB[ASSISTANT]]


def model_config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def tokenizer_config() -> dict:
    added = {
        str(VOCAB[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": [USER, ASSISTANT, SYSTEM, STEP_TAG],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def save_checkpoint(model, out_dir: Path, extra_files: dict[str, dict] | None = None) -> None:
    """Write an HF checkpoint directory: bf16 weights, tokenizer, chat template."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "chat_template.jinja"):
        (out_dir / stale).unlink(missing_ok=True)
    model = copy.deepcopy(model).to(torch.bfloat16)  # the caller's fp32 weights stay as they are
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    write_json(out_dir / "tokenizer_config.json", tokenizer_config())
    write_json(
        out_dir / "special_tokens_map.json",
        {
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "additional_special_tokens": [USER, ASSISTANT, SYSTEM, STEP_TAG],
        },
    )
    for name, payload in (extra_files or {}).items():
        write_json(out_dir / name, payload)


def load_model(ckpt_dir: Path):
    """Load a shipped checkpoint for training-side use: fp32 compute, eval mode."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
    return model.eval()


def deepen(model, extra_layers: int):
    """`model` with `extra_layers` more decoder layers on top, each starting as the identity
    (zero attention output and MLP down projections): the copied layers still compute what
    they did (e.g. the generator's next result), the new ones have depth left to compare it."""
    import torch
    from transformers import LlamaForCausalLM

    if not extra_layers:
        return model
    config = copy.deepcopy(model.config)
    config.num_hidden_layers += extra_layers
    deeper = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = deeper.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".layers." in name for name in missing), (missing, unexpected)
    with torch.no_grad():
        for layer in deeper.model.layers[-extra_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return deeper


def train_new_layers_only(model, extra_layers: int) -> None:
    """Freeze every parameter but those of the top `extra_layers` decoder layers (the ones
    `deepen` added): what the layers below know stays as it is."""
    model.requires_grad_(False)
    for layer in model.model.layers[len(model.model.layers) - extra_layers :]:
        layer.requires_grad_(True)


def write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def collate(rows: list[tuple[list[int], ...]]):
    """Rows of (ids, target, ...) -> (input_ids, one label tensor per target), right-padded
    with PAD_ID and -100: causal masking alone is exact for the loss."""
    import torch

    width = max(len(ids) for ids, *_ in rows)
    fills = [PAD_ID] + [-100] * (len(rows[0]) - 1)
    tensors = [torch.full((len(rows), width), fill, dtype=torch.long) for fill in fills]
    for r, row in enumerate(rows):
        for tensor, values in zip(tensors, row, strict=True):
            tensor[r, : len(values)] = torch.tensor(values)
    return tuple(tensors)


def train_step(model, opt, params: list, input_ids, targets) -> float:
    """One optimizer step on the cross-entropy of the logits at `targets` (-100: no loss, no
    shift: the target at a position is that position's next token), in bf16 autocast with the
    gradient clipped to norm 1; returns the loss."""
    import torch

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=input_ids).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def length_batches(lengths: list[int], max_tokens: int, rng: random.Random, pool: int = 64) -> list[list[int]]:
    """Shuffled batches of indices, similar lengths together, at most `max_tokens` padded tokens."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), pool * 32):
        chunk = sorted(order[start : start + pool * 32], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in chunk:
            if batch and (len(batch) + 1) * lengths[i] > max_tokens:  # chunk is sorted
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches
