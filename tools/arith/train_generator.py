"""Train the arithmetic-world generator: a tiny Llama that solves problems step by step.

    python -m tools.arith.train_generator --seed 2      # the shipped recipe, both phases

Small batches (~512 tokens) and many steps: on one CPU core the attention patterns that
copying and arithmetic need appear after a number of *steps*, so small batches get there
soonest. Most batches are chat-formatted problems of one level (similar lengths, little
padding) with noisy-teacher answers (`tools.arith.data`; loss on the answer and the EOS);
the others are arithmetic drills, the operations of reference solutions packed one per line
with the loss on the results only. Levels follow a curriculum: level 1 during a warm phase,
then one more level every few hundred steps, then all levels uniformly.

The last phase is a copy phase: chat rows only, with the noisy teacher at a higher rate. The
model stops miscopying operands and rewritten rests (mistakes the PRM cannot see), while its
sampled results stay spread (mistakes the PRM sees): the error mix that PRM-guided search can
fix. The PRM is built on, and trained with samples of, the generator before this phase
(`common.PRM_BASE_DIR`)."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

from tools.arith.common import (
    BOS_ID,
    EOS_ID,
    GENERATOR_DIR,
    GENERATOR_THREADS,
    WORK_DIR,
    collate,
    encode_text,
    generator_phase_dir,
    model_config,
    prompt_ids,
    recipe_parser,
    save_checkpoint,
    set_threads,
    write_json,
)
from tools.arith.data import LEVELS, NOISE_PER_DIGIT, held_out_texts, noisy_solution, problem_stream
from treeserve.eval.arith import Problem, arith_dataset

# Shape of the shipped generator (about 3.2M parameters).
GENERATOR_SHAPE = {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 704}
# The shipped recipe (seed 2): a first phase from scratch with the curriculum, then a shorter
# continuation at a lower learning rate. Longer second phases raise greedy accuracy at level 5
# faster than pass@16, which the search needs (the generator's model card). Then the copy phase.
# `noise`: the noisy teacher's error rate per digit of a result (`data.noise_rate`).
PHASES = (
    {"steps": 6000, "warm_steps": 500, "max_tokens": 512, "drill_frac": 0.4, "lr": 2e-3, "noise": NOISE_PER_DIGIT},
    {"steps": 2500, "warm_steps": 0, "max_tokens": 512, "drill_frac": 0.3, "lr": 1e-3, "noise": NOISE_PER_DIGIT},
    {"steps": 3000, "warm_steps": 0, "max_tokens": 512, "drill_frac": 0.0, "lr": 5e-4, "noise": 0.06},
)
DEFAULTS = PHASES[0]
DRILL_WIDTH = 256
LEVEL_MAX_LEN = {1: 56, 2: 88, 3: 128, 4: 176, 5: 224}  # prompt + answer + EOS, in tokens


def chat_row(rng: random.Random, problem: Problem, noise: float) -> tuple[list[int], list[int]]:
    """Prompt and noisy-teacher answer; the loss covers the answer and the EOS."""
    prompt = prompt_ids(problem.text)
    answer = encode_text(noisy_solution(rng, problem, noise)) + [EOS_ID]
    return prompt + answer, [-100] * len(prompt) + answer


def drill_row(streams, rng: random.Random, levels: tuple[int, ...], width: int) -> tuple[list[int], list[int]]:
    """Arithmetic drill: `<|bos|>` then the operations of reference solutions, one
    `a op b = c.` per line; the loss covers only the results. The operations are those
    the chat problems need, several times as many per token."""
    ids, labels = [BOS_ID], [-100]
    while True:
        problem = next(streams[rng.choice(levels)])
        for step in problem.steps[:-1]:
            equation, result = step.split(", leaving")[0].rstrip(".").split(" = ")
            prefix, target = encode_text(f"{equation} = "), encode_text(f"{result}.\n")
            if len(ids) + len(prefix) + len(target) > width:
                return ids, labels
            ids += prefix + target
            labels += [-100] * len(prefix) + target


def make_batch(streams, rng: random.Random, levels: tuple[int, ...], max_tokens: int, drill_frac: float, noise: float):
    if rng.random() < drill_frac:
        return collate([drill_row(streams, rng, levels, DRILL_WIDTH) for _ in range(max(1, max_tokens // DRILL_WIDTH))])
    level = rng.choice(levels)
    rows = max(1, max_tokens // LEVEL_MAX_LEN[level])
    return collate([chat_row(rng, next(streams[level]), noise) for _ in range(rows)])


def monitor_batch():
    """A fixed held-out batch (8 problems per level, seed 12345) with a mask of the step results."""
    import torch

    equals = encode_text("= ")
    records = arith_dataset(40, seed=12345)
    rows, result_masks = [], []
    for r in records:
        prompt, answer = prompt_ids(r["problem"]), encode_text(r["solution"]) + [EOS_ID]
        ids = prompt + answer
        rows.append((ids, [-100] * len(prompt) + answer))
        result_masks.append([i >= len(prompt) and ids[i - 2 : i] == equals for i in range(len(ids))])
    input_ids, labels = collate(rows)
    result = torch.zeros_like(labels, dtype=torch.bool)
    for i, mask in enumerate(result_masks):
        result[i, : len(mask)] = torch.tensor(mask)
    return input_ids, labels, result, torch.tensor([r["level"] for r in records])


def monitor(model, batch) -> dict:
    """Teacher-forced accuracy on the monitor batch: all answer tokens, result digits, by level."""
    import torch

    input_ids, labels, result, levels = batch
    model.eval()
    with torch.no_grad():
        pred = model(input_ids=input_ids).logits[:, :-1].argmax(-1)
    model.train()
    target, result = labels[:, 1:], result[:, 1:]
    answer = target != -100
    ok = pred == target
    out = {"token_acc": ok[answer].float().mean().item(), "result_acc": ok[result].float().mean().item()}
    for lv in LEVELS:
        sel = (levels == lv)[:, None]
        out[f"L{lv}_result_acc"] = ok[result & sel].float().mean().item()
    return {k: round(v, 3) for k, v in out.items()}


def levels_at(step: int, warm_steps: int, steps: int, ramp: float = 0.3) -> tuple[int, ...]:
    """Curriculum: level 1 during the warm phase (copying and the basic facts are learned
    there, fast), then a level is unlocked every `ramp / 4` of the rest; then all levels."""
    if step < warm_steps:
        return LEVELS[:1]
    progress = (step - warm_steps) / max(1, (steps - warm_steps) * ramp)
    return LEVELS[: min(len(LEVELS), 2 + int(progress * (len(LEVELS) - 1)))]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    seed: int,
    steps: int,
    warm_steps: int,
    max_tokens: int,
    drill_frac: float,
    lr: float,
    noise: float,
    out_dir: Path,
    init: Path | None = None,
) -> dict:
    set_threads(GENERATOR_THREADS)
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(f"generator-data-{seed}")
    exclude = held_out_texts()
    streams = {lv: problem_stream(random.Random(f"gen-problems-{seed}-{lv}"), lv, exclude) for lv in LEVELS}
    config = model_config(**GENERATOR_SHAPE)
    config._attn_implementation = "eager"  # CPU flash-attention backward is slow at this size
    model = LlamaForCausalLM(config) if init is None else LlamaForCausalLM.from_pretrained(init, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"generator: {n_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    model.train()
    start, log, running = time.time(), [], 0.0
    watch = monitor_batch()
    for step in range(steps):
        levels = levels_at(step, warm_steps, steps)
        input_ids, labels = make_batch(streams, rng, levels, max_tokens, drill_frac, noise)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=100)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if (step + 1) % 200 == 0:
            entry = {"step": step + 1, "loss": running / 200, "elapsed_s": time.time() - start, **monitor(model, watch)}
            log.append(entry)
            message = " ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items())
            print(message, flush=True)
            running = 0.0
        if (step + 1) % 2000 == 0 and step + 1 < steps:
            save_checkpoint(model, out_dir)  # a usable checkpoint while training goes on
            model.train()
    elapsed = time.time() - start
    model.eval()
    save_checkpoint(model, out_dir)
    summary = {
        "seed": seed,
        "steps": steps,
        "warm_steps": warm_steps,
        "max_tokens_per_batch": max_tokens,
        "drill_fraction": drill_frac,
        "peak_lr": lr,
        "noise_per_digit": noise,
        "parameters": n_params,
        "shape": GENERATOR_SHAPE,
        "threads": torch.get_num_threads(),
        "init": str(init) if init else None,
        "train_seconds": elapsed,
        "log": log,
    }
    write_json(WORK_DIR / f"generator_train_{out_dir.name}.json", summary)
    return summary


def train_recipe(seed: int, out_dir: Path) -> dict:
    """Every phase of `PHASES`, each continuing from the one before; the last writes `out_dir`."""
    phases, init = [], None
    for k, phase in enumerate(PHASES):
        target = out_dir if k == len(PHASES) - 1 else generator_phase_dir(k + 1)
        phases.append(train(seed, **phase, out_dir=target, init=init))
        init = target
    summary = {
        "seed": seed,
        "parameters": phases[0]["parameters"],
        "shape": GENERATOR_SHAPE,
        "phases": phases,
        "train_seconds": sum(p["train_seconds"] for p in phases),
    }
    write_json(WORK_DIR / "generator_train.json", summary)
    return summary


def recipe_summary(seed: int) -> dict:
    """What `train_recipe` reports, from the recipe alone (no timings): for model cards of a
    generator whose training log is gone."""
    n_params = sum(t.numel() for t in _weights(GENERATOR_DIR).values())
    phases = [
        {
            "seed": seed,
            "steps": p["steps"],
            "warm_steps": p["warm_steps"],
            "max_tokens_per_batch": p["max_tokens"],
            "drill_fraction": p["drill_frac"],
            "peak_lr": p["lr"],
            "noise_per_digit": p["noise"],
            "threads": GENERATOR_THREADS,
            "train_seconds": None,
        }
        for p in PHASES
    ]
    return {"seed": seed, "parameters": n_params, "shape": GENERATOR_SHAPE, "phases": phases, "train_seconds": None}


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def main() -> None:
    parser = recipe_parser(__doc__, DEFAULTS)
    parser.add_argument("--out", type=Path, default=GENERATOR_DIR)
    parser.add_argument("--init", type=Path, default=None, help="continue from this checkpoint")
    parser.add_argument("--single", action="store_true", help="one run with the flags above, not the whole recipe")
    args = parser.parse_args()
    if args.single:
        train(args.seed, **{name: getattr(args, name) for name in DEFAULTS}, out_dir=args.out, init=args.init)
    else:
        train_recipe(args.seed, args.out)


if __name__ == "__main__":
    main()
