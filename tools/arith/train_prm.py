"""Train the arithmetic-world PRM (Math-Shepherd style step tags) on judged solutions.

    python -m tools.arith.train_prm [--init DIR]

It starts from the last stage of the fact curriculum (`tools.arith.facts`: the table, the
check, the route to the tag; `--init`, by default that stage's scratch directory), which
knows every `a op b`, compares a written result with it and reports the comparison at the
step tag. Then:

1. On-policy data: the shipped generator samples solutions (T=0.8 and T=1.0) to training
   problems (never the test split); the step judge labels every step.
2. Synthetic data: reference solutions corrupted on purpose (`tools.arith.prm_data`).
3. Drills (`--drill-passes`, `--prefix-drills-per-level`): the fact table right and wrong, and
   same-depth prefix pairs (`tools.arith.drills`), mixed in with the rest for the whole run.
4. Train every layer (`--extra-layers` adds identity-initialised ones on top): the loss is the
   next-token cross-entropy of '+' (good) or '-' (bad) at each `<|step|>` position, plus
   `--lm-weight` x the next-token cross-entropy of the result of every good operation step
   (keeps the table) and `--fact-check-weight` x '+'/'-' at the result token of every
   operation step (keeps the check). `--check-every` prints the same-depth corruption AUCs and
   the fact-drill AUC during training. `--copy-check-weight` adds '+'/'-' at every copied token
   (`tools.arith.copy_check`); the shipped recipe does not use it (see the model card's
   known limitation).

The defaults are the shipped checkpoint's recipe (its model card gives the data, the stages
and the measured AUCs).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from tools.arith.common import (
    PRM_BASE_DIR,
    PRM_DIR,
    PRM_THREADS,
    WORK_DIR,
    collate,
    deepen,
    length_batches,
    load_model,
    recipe_parser,
    save_checkpoint,
    set_threads,
    write_json,
)
from tools.arith.copy_check import copy_check_targets
from tools.arith.data import LEVELS, held_out_texts, problem_stream
from tools.arith.drills import drill_examples, fact_drill_auc
from tools.arith.evaluate import corruption_check
from tools.arith.facts import STAGE_DIRS, curriculum, fact_check_targets, result_targets, tag_targets
from tools.arith.prm_data import Example, cached_examples, read_examples, synthetic_examples
from tools.arith.prm_io import PRM_FORMAT, prm_input
from tools.arith.sampling import generate, load_llm, max_new_tokens_for
from treeserve import LLM
from treeserve.eval.arith_labels import split_steps, step_labels

DEFAULTS = {
    "on_policy_per_level": 400,
    "samples_per_problem": 4,
    "synthetic_per_level": 1500,
    "epochs": 2,
    "max_tokens": 2048,
    "lr": 1e-3,
    "drill_passes": 1,
    "prefix_drills_per_level": 0,
    "lm_weight": 0.5,
    "fact_check_weight": 1.0,
    "copy_check_weight": 0.0,
    "check_every": 0,
    "extra_layers": 2,
    "base_lr_scale": 0.1,
}


def on_policy_examples(generator: LLM, problems_by_level: dict, n: int, seed: int) -> list[Example]:
    out: list[Example] = []
    for lv, problems in problems_by_level.items():
        texts = [p.text for p in problems]
        half = len(texts) // 2
        for temperature, chunk in ((0.8, texts[:half]), (1.0, texts[half:])):
            samples = generate(
                generator,
                chunk,
                max_new_tokens=max_new_tokens_for(lv),
                temperature=temperature,
                n=n,
                seed=seed * 100 + lv,
            )
            for text, completions in zip(chunk, samples, strict=True):
                for completion in completions:
                    steps = split_steps(completion)
                    if steps:
                        out.append((text, steps, step_labels(text, steps)))
        print(f"on-policy L{lv}: {len(out)} solutions so far", flush=True)
    return out


def cached_on_policy(generator_dir: Path, problems_by_level: dict, n: int, seed: int) -> tuple[list[Example], float]:
    """`on_policy_examples` and the seconds they took to sample, kept in the scratch directory:
    the same seed and sizes sample the same."""
    sizes = "-".join(str(len(v)) for v in problems_by_level.values())
    path = WORK_DIR / f"prm_on_policy_seed{seed}_n{n}_{sizes}.json"
    return cached_examples(path, lambda: on_policy_examples(load_llm(generator_dir), problems_by_level, n, seed))


def train(
    seed: int,
    on_policy_per_level: int,
    samples_per_problem: int,
    synthetic_per_level: int,
    epochs: int,
    max_tokens: int,
    lr: float,
    generator_dir: Path,
    out_dir: Path,
    drill_passes: int = 0,
    prefix_drills_per_level: int = 0,
    lm_weight: float = 0.0,
    fact_check_weight: float = 0.0,
    copy_check_weight: float = 0.0,
    check_every: int = 0,
    init_dir: Path | None = None,
    extra_layers: int = 0,
    base_lr_scale: float = 1.0,
    mined: list[Example] | None = None,
) -> dict:
    set_threads(PRM_THREADS)
    import torch

    torch.manual_seed(seed)
    exclude = held_out_texts()
    streams = {lv: problem_stream(random.Random(f"prm-problems-{seed}-{lv}"), lv, exclude) for lv in LEVELS}
    on_policy, sample_seconds = cached_on_policy(
        generator_dir,
        {lv: [next(streams[lv]) for _ in range(on_policy_per_level)] for lv in LEVELS},
        samples_per_problem,
        seed,
    )
    rng = random.Random(f"prm-synthetic-{seed}")
    synthetic = synthetic_examples(rng, [next(streams[lv]) for lv in LEVELS for _ in range(synthetic_per_level)])
    drill_rng = random.Random(f"prm-drills-{seed}")
    drills = drill_examples(
        drill_rng, drill_passes, [next(streams[lv]) for lv in LEVELS for _ in range(prefix_drills_per_level)]
    )
    mined = mined or []
    data = on_policy + synthetic + drills + mined
    n_steps = sum(len(labels) for _, _, labels in data)
    n_bad = sum(labels.count(False) for _, _, labels in data)
    print(
        f"PRM data: {len(data)} solutions ({len(drills)} drills, {len(mined)} mined), {n_steps} steps, {n_bad} bad "
        f"({sample_seconds:.0f}s sampling)",
        flush=True,
    )

    encoded = []
    for problem, steps, labels in data:
        ids, tags = prm_input(problem, steps)
        targets = (
            tag_targets(ids, tags, labels),
            result_targets(ids, tags, labels),
            fact_check_targets(ids, tags),
            copy_check_targets(problem, steps, ids, tags) if copy_check_weight else [-100] * len(ids),
        )
        encoded.append((ids, *targets))
    # The PRM starts as a copy of the generator, or continues from `init_dir` (an earlier PRM).
    model = deepen(load_model(init_dir or generator_dir), extra_layers).train()
    # The layers the init checkpoint already has learn at base_lr_scale x lr (0: frozen), so a
    # PRM can keep what the curriculum taught while its new layers learn to judge solutions.
    new = {id(p) for layer in model.model.layers[len(model.model.layers) - extra_layers :] for p in layer.parameters()}
    base = [p for p in model.parameters() if id(p) not in new]
    if not base_lr_scale:
        for p in base:
            p.requires_grad_(False)
    model.config._attn_implementation = "eager"
    groups = [{"params": [p for p in model.parameters() if id(p) in new], "scale": 1.0}]
    groups = [g for g in groups + [{"params": base, "scale": base_lr_scale}] if g["params"] and g["scale"]]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    params = [p for group in groups for p in group["params"]]
    lengths = [len(ids) for ids, *_ in encoded]
    batch_rng = random.Random(f"prm-batches-{seed}")
    schedule = [b for _ in range(epochs) for b in length_batches(lengths, max_tokens, batch_rng)]
    train_start, log, running = time.time(), [], 0.0
    for step, batch in enumerate(schedule):
        input_ids, labels, lm_labels, check_labels, copy_labels = collate([encoded[i] for i in batch])
        for group in opt.param_groups:  # linear warmup, linear decay to 10%
            group["lr"] = group["scale"] * lr * min((step + 1) / 30, 1.0 - 0.9 * step / len(schedule))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=input_ids).logits  # right padding: causal masking suffices
        # The label is the next-token target at the tag position itself (no shift).
        flat = logits.float().flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(flat, labels.flatten(), ignore_index=-100)
        total = loss
        for weight, extra in (
            (lm_weight, lm_labels),
            (fact_check_weight, check_labels),
            (copy_check_weight, copy_labels),
        ):
            if weight and (extra >= 0).any():
                total = total + weight * torch.nn.functional.cross_entropy(flat, extra.flatten(), ignore_index=-100)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if (step + 1) % 50 == 0:
            log.append({"step": step + 1, "loss": running / 50, "elapsed_s": time.time() - train_start})
            elapsed = time.time() - train_start
            print(f"step {step + 1}/{len(schedule)} loss {running / 50:.4f} {elapsed:.0f}s", flush=True)
            running = 0.0
        if check_every and (step + 1) % check_every == 0:
            model.eval()
            checks = corruption_check(model)
            text = " ".join(f"{k} {v['auc']:.3f}" for k, v in checks.items())
            print(f"  corruption AUC {text}; fact drill AUC {fact_drill_auc(model):.3f}", flush=True)
            model.train()
    train_seconds = time.time() - train_start
    model.eval()
    save_checkpoint(model, out_dir, extra_files={"prm_config.json": PRM_FORMAT})
    summary = {
        "seed": seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "on_policy_solutions": len(on_policy),
        "synthetic_solutions": len(synthetic),
        "drills": len(drills),
        "mined_solutions": len(mined),
        "init": "generator" if init_dir is None else init_dir.name,
        "extra_layers": extra_layers,
        "base_lr_scale": base_lr_scale,
        "stages": curriculum(init_dir) if init_dir is not None else {},
        "drill_passes": drill_passes,
        "prefix_drills_per_level": prefix_drills_per_level,
        "lm_weight": lm_weight,
        "fact_check_weight": fact_check_weight,
        "copy_check_weight": copy_check_weight,
        "steps_labelled": n_steps,
        "bad_steps": n_bad,
        "optimizer_steps": len(schedule),
        "epochs": epochs,
        "max_tokens_per_batch": max_tokens,
        "peak_lr": lr,
        "sample_seconds": sample_seconds,
        "train_seconds": train_seconds,
        "log": log,
    }
    return summary


def main() -> None:
    parser = recipe_parser(__doc__, DEFAULTS)
    parser.add_argument("--generator", type=Path, default=PRM_BASE_DIR)
    parser.add_argument("--out", type=Path, default=PRM_DIR)
    parser.add_argument("--init", type=Path, default=STAGE_DIRS["route"], help="the checkpoint to start from")
    parser.add_argument("--mined", type=Path, help="search-mined solutions to add (JSON from tools.arith.mine_search)")
    args = parser.parse_args()
    recipe = {name: getattr(args, name) for name in DEFAULTS}
    mined = read_examples(args.mined)[0] if args.mined else None
    dirs = {"generator_dir": args.generator, "out_dir": args.out, "init_dir": args.init}
    summary = train(args.seed, **recipe, **dirs, mined=mined)
    write_json(WORK_DIR / "prm_train.json", summary)


if __name__ == "__main__":
    main()
