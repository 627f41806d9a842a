"""Train the arithmetic-world generator: a tiny Llama that solves problems step by step.

    python -m tools.arith.train_generator --seed 0

Each batch holds problems of one level (similar lengths, little padding), levels drawn
uniformly, so every level gets the same share of tokens. Targets are noisy-teacher
solutions (see `tools.arith.data`); the loss covers the assistant answer and the EOS.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

from tools.arith.common import (
    EOS_ID,
    GENERATOR_DIR,
    PAD_ID,
    WORK_DIR,
    encode_chars,
    model_config,
    prompt_ids,
    save_checkpoint,
    set_single_thread,
    write_json,
)
from tools.arith.data import LEVELS, held_out_texts, noisy_solution, problem_stream

# Shape of the shipped generator (about 3.2M parameters).
GENERATOR_SHAPE = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 704}
LEVEL_MAX_LEN = {1: 64, 2: 104, 3: 152, 4: 208, 5: 264}  # prompt + answer + EOS


def make_batch(streams, rng: random.Random, level: int, max_tokens: int):
    import torch

    rows: list[tuple[list[int], list[int]]] = []
    for _ in range(max(1, max_tokens // LEVEL_MAX_LEN[level])):
        problem = next(streams[level])
        prompt = prompt_ids(problem.text)
        answer = encode_chars(noisy_solution(rng, problem)) + [EOS_ID]
        rows.append((prompt, answer))
    width = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (prompt, answer) in enumerate(rows):
        ids = prompt + answer
        input_ids[r, : len(ids)] = torch.tensor(ids)
        labels[r, len(prompt) : len(ids)] = torch.tensor(answer)
        mask[r, : len(ids)] = 1
    return input_ids, mask, labels


def level_at(rng: random.Random, step: int, steps: int, ramp: float = 0.3) -> int:
    """Curriculum after the warm phase: a level is unlocked every `ramp / 4` of training,
    then levels are uniform."""
    top = min(len(LEVELS), 2 + int(step / max(1, steps * ramp) * (len(LEVELS) - 1)))
    return rng.choice(LEVELS[:top])


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(seed: int, warm_steps: int, steps: int, max_tokens: int, lr: float, out_dir: Path) -> dict:
    """`warm_steps` small batches of level-1 problems (copying and the basic facts are
    learned there, fast), then `steps` batches of `max_tokens` tokens over all levels."""
    set_single_thread()
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(f"generator-data-{seed}")
    exclude = held_out_texts()
    streams = {lv: problem_stream(random.Random(f"gen-problems-{seed}-{lv}"), lv, exclude) for lv in LEVELS}
    config = model_config(**GENERATOR_SHAPE)
    config._attn_implementation = "eager"  # CPU flash-attention backward is slow at this size
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"generator: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )  # fmt: skip
    model.train()
    start, log = time.time(), []
    running = 0.0
    total = warm_steps + steps
    for step in range(total):
        if step < warm_steps:
            level, tokens, step_lr = 1, max_tokens // 4, lr * min(1.0, (step + 1) / 50)
        else:
            level = level_at(rng, step - warm_steps, steps)
            tokens, step_lr = max_tokens, lr_at(step - warm_steps, steps, lr, warmup=50)
        input_ids, mask, labels = make_batch(streams, rng, level, tokens)
        for group in opt.param_groups:
            group["lr"] = step_lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if (step + 1) % 50 == 0:
            log.append({"step": step + 1, "loss": running / 50, "elapsed_s": time.time() - start})
            print(f"step {step + 1}/{total} loss {running / 50:.4f} {time.time() - start:.0f}s", flush=True)
            running = 0.0
    elapsed = time.time() - start
    model.eval()
    save_checkpoint(model, out_dir)
    summary = {
        "seed": seed, "warm_steps": warm_steps, "steps": steps, "max_tokens_per_batch": max_tokens,
        "peak_lr": lr, "parameters": n_params, "shape": GENERATOR_SHAPE, "train_seconds": elapsed,
        "log": log,
    }  # fmt: skip
    write_json(WORK_DIR / "generator_train.json", summary)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-steps", type=int, default=500)
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=GENERATOR_DIR)
    args = parser.parse_args()
    train(args.seed, args.warm_steps, args.steps, args.max_tokens, args.lr, args.out)


if __name__ == "__main__":
    main()
