"""The PRM's curriculum on the arithmetic world's fact table: know, compare, report.

    python -m tools.arith.facts --stage table|check|route [--init DIR] [--out DIR]

A PRM can only call `87 + 15 = 101` wrong if it knows that 87 + 15 is 102, compares that with
the 101 written, and reports the comparison at the step's tag. Trained on judged solutions
alone, a model of this size learns none of the three, so each gets a stage; every stage
starts from the last one's checkpoint (the first from the generator's), in the PRM's own
input format, and the last one is `train_prm`'s starting point (none is shipped):

- `table`: rows of `FACTS_PER_ROW` true facts (`a op b = c.<|step|>`) under a problem of one
  of three kinds (`row_problem`), loss on every result token `c`. Numbers are single tokens,
  so the table (`drills.fact_table`, 4,647 facts) is a lookup to memorise: the generator knows
  23% of it (top-1), 6,000 steps teach all of it.
- `check`: rows like the table's whose results are wrong half the time (`check_row`: the true
  value is the target before each result, '+'/'-' the target at it), on 2 new
  identity-initialised layers over the frozen table model. It stays at chance for about 2,000
  steps and then climbs (grokking-like); a decaying learning rate stalls it, so it runs at a
  constant one until the check is right on 95% of 800 held-out results.
- `route`: fact drills judged at their step tags (`drill_row`), on 2 new layers over the frozen
  check model, until the fact-drill AUC (`drills.fact_drill_auc`) reaches 0.95 (the shipped
  PRM's, seed 2: 0.951 at 2,500 steps in 4.5 min; at seed 0 two runs from the same check model
  reached 0.965 at 2,250 steps and 0.964 at 1,000). Without it a PRM trained from the check model kept a 0.97-AUC
  verdict at the result token, yet its tags never read it. With 1 new layer it stayed at
  chance for 4,250 steps at lr 1e-3, and at lr 3e-3 it left chance only after 1,500 steps and
  reached just 0.85 by 3,500.

Each stage saves its summary next to its weights (`STAGE_FILE`); `curriculum` reads them back.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import time
from pathlib import Path

from tools.arith.common import (
    BAD_ID,
    GOOD_ID,
    PRM_BASE_DIR,
    PRM_THREADS,
    VOCAB,
    WORK_DIR,
    collate,
    deepen,
    encode_text,
    load_model,
    read_json,
    recipe_parser,
    save_checkpoint,
    set_threads,
    train_new_layers_only,
    train_step,
    write_json,
)
from tools.arith.data import held_out_texts
from tools.arith.drills import MAX_LEAF, Fact, fact_drill, fact_drill_auc, fact_table, wrong_result
from tools.arith.prm_io import prm_input
from treeserve.eval.arith import OPS, BinOp, apply_op, extend_chain, make_problem, render

FACTS_PER_ROW = 8
STAGES = ("table", "check", "route")
STAGE_DIRS = {stage: WORK_DIR / f"arith-{stage}" for stage in STAGES}
STAGE_FILE = "stage.json"  # a stage's training summary, saved with its checkpoint
# The check and route stages run at a constant lr after warmup (a decaying one stalls a
# comparison that is still forming) and stop at the first log line where their held-out score
# reaches `target`; they train only their `extra_layers` new layers.
DEFAULTS = {
    "table": {"steps": 6000, "rows_per_batch": 32, "lr": 2e-3, "warmup": 100, "target": 1.0, "extra_layers": 0},
    "check": {"steps": 30000, "rows_per_batch": 32, "lr": 1e-3, "warmup": 100, "target": 0.95, "extra_layers": 2},
    "route": {"steps": 5000, "rows_per_batch": 32, "lr": 1e-3, "warmup": 100, "target": 0.95, "extra_layers": 2},
}
EQUALS_ID, SPACE_ID = VOCAB["="], VOCAB[" "]
TOKENS = {i: tok for tok, i in VOCAB.items()}


def result_positions(ids: list[int], tags: list[int]) -> list[int | None]:
    """For each step (ending at its tag), the position that predicts the result of `a op b = c`
    (the space after '='), or None where the step has no operation."""
    positions: list[int | None] = []
    start = 0
    for tag in tags:
        found = (pos + 1 for pos in range(start, tag - 2) if ids[pos] == EQUALS_ID and ids[pos + 1] == SPACE_ID)
        positions.append(next(found, None))
        start = tag + 1
    return positions


def result_targets(ids: list[int], tags: list[int], labels: list[bool]) -> list[int]:
    """Next-token targets for the result of every good operation step (`a op b = c`: the
    position before `c` predicts `c`), -100 elsewhere."""
    target = [-100] * len(ids)
    for pos, good in zip(result_positions(ids, tags), labels, strict=True):
        if good and pos is not None:
            target[pos] = ids[pos + 1]
    return target


def fact_check_targets(ids: list[int], tags: list[int]) -> list[int]:
    """'+' or '-' at the result token of every operation step `a op b = c` (is c right for
    the operands as written?), -100 elsewhere: dense supervision for the first half of the
    PRM's check, right where the compared numbers sit."""
    target = [-100] * len(ids)
    for pos in result_positions(ids, tags):
        if pos is None or pos < 7:
            continue
        a, op, b, c = (TOKENS[ids[i]] for i in (pos - 7, pos - 5, pos - 3, pos + 1))
        if a.isdigit() and b.isdigit() and c.isdigit() and op in OPS:
            target[pos + 1] = GOOD_ID if apply_op(op, int(a), int(b)) == int(c) else BAD_ID
    return target


held_out = functools.cache(held_out_texts)


def row_problem(rng: random.Random, fact: Fact) -> str:
    """The problem above a table or check row, one of three kinds: the row's first fact alone;
    that fact as the first operation of a longer chain, as above a real solution's first step;
    or an unrelated problem (never a test one), as above its later steps. A row's first step
    must be read whatever the problem says: trained under the first kind alone, the seed-2
    table model got the first step of `Compute (a op b) + 7.` right 49% of the time (100% under
    `Compute a op b.`, and for every later step), the check model above it judged that step at
    AUC 0.72, and the route stage above that stalled at 0.86."""
    a, op, b = fact
    kind = rng.randrange(3)
    if kind == 0:
        return f"Compute {a} {op} {b}."
    if kind == 1:
        return f"Compute {render(extend_chain(rng, BinOp(op, a, b), rng.randint(1, 4), MAX_LEAF))}."
    while (text := make_problem(rng, rng.randint(1, 5)).text) in held_out():
        pass
    return text


def fact_row(rng: random.Random, facts: list[Fact]) -> tuple[list[int], list[int]]:
    """Token ids and result targets of one row: all facts as steps under a `row_problem`."""
    steps = [f"{x} {o} {y} = {apply_op(o, x, y)}." for x, o, y in facts]
    ids, tags = prm_input(row_problem(rng, facts[0]), steps)
    return ids, result_targets(ids, tags, [True] * len(steps))


def check_row(rng: random.Random, facts: list[Fact]) -> tuple[list[int], list[int]]:
    """Like `fact_row`, but each result is wrong with probability 1/2 (`drills.wrong_result`)
    and the problem above is any of `row_problem`'s kinds. Targets: the true result at the
    position before each result, '+'/'-' at the result."""
    truths = [apply_op(o, x, y) for x, o, y in facts]
    written = [t if rng.random() < 0.5 else wrong_result(rng, *f) for t, f in zip(truths, facts, strict=True)]
    steps = [f"{x} {o} {y} = {w}." for (x, o, y), w in zip(facts, written, strict=True)]
    ids, tags = prm_input(row_problem(rng, facts[0]), steps)
    target = fact_check_targets(ids, tags)
    for pos, truth in zip(result_positions(ids, tags), truths, strict=True):
        target[pos] = encode_text(str(truth))[0]
    return ids, target


def tag_targets(ids: list[int], tags: list[int], labels: list[bool]) -> list[int]:
    """'+' or '-' (the step's label) at each step tag, -100 elsewhere: the PRM's own target."""
    target = [-100] * len(ids)
    for pos, good in zip(tags, labels, strict=True):
        target[pos] = GOOD_ID if good else BAD_ID
    return target


def drill_row(rng: random.Random, facts: list[Fact]) -> tuple[list[int], list[int]]:
    """A fact drill (`drills.fact_drill`) of the first fact, right or wrong with probability
    1/2, judged at its step tags: the check read where the PRM reports it."""
    problem, steps, labels = fact_drill(rng, facts[0], rng.random() < 0.5)
    ids, tags = prm_input(problem, steps)
    return ids, tag_targets(ids, tags, labels)


def check_accuracy(model, rows: list[tuple[list[int], list[int]]]) -> float:
    """How often '+' against '-' at a result token says rightly whether the result is right."""
    import torch

    with torch.no_grad():
        input_ids, targets = collate(rows)
        logits = model(input_ids=input_ids).logits
    mask = (targets == GOOD_ID) | (targets == BAD_ID)
    said = torch.where(logits[..., GOOD_ID] > logits[..., BAD_ID], GOOD_ID, BAD_ID)
    return float((said[mask] == targets[mask]).float().mean())


def fact_accuracy(model, facts: list[Fact], rows_per_batch: int = 64) -> float:
    """Top-1 accuracy of the result token over `facts`, in the training format."""
    import torch

    rng = random.Random("fact-accuracy")
    rows = [fact_row(rng, facts[i : i + FACTS_PER_ROW]) for i in range(0, len(facts), FACTS_PER_ROW)]
    right = total = 0
    with torch.no_grad():
        for i in range(0, len(rows), rows_per_batch):
            input_ids, targets = collate(rows[i : i + rows_per_batch])
            predicted = model(input_ids=input_ids).logits.argmax(-1)
            mask = targets >= 0
            right += int((predicted[mask] == targets[mask]).sum())
            total += int(mask.sum())
    return right / total


def held_out_score(stage: str, facts: list[Fact]):
    """The score that stops a stage at its target, as a function of the model (None: the
    table stage runs its steps): check accuracy on 100 held-out check rows, or fact-drill AUC."""
    if stage == "check":
        rows = [
            check_row(random.Random(f"check-{i}"), random.Random(i).sample(facts, FACTS_PER_ROW)) for i in range(100)
        ]
        return lambda model: check_accuracy(model, rows)
    return fact_drill_auc if stage == "route" else None


def teach(
    model,
    stage: str,
    seed: int,
    steps: int,
    rows_per_batch: int,
    lr: float,
    warmup: int,
    target: float = 1.0,
    log_every: int = 250,
    checkpoint: Path | None = None,
) -> dict:
    """Train `model`'s trainable parameters in place on one stage's rows, walking the shuffled
    table `FACTS_PER_ROW` facts at a time: `fact_row`s with a cosine schedule ("table"), or
    `check_row`s / `drill_row`s at a constant lr until `held_out_score` reaches `target`
    ("check" / "route"). Returns the training log; with `checkpoint`, the model is saved there
    at every log line."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(f"facts-{seed}")
    facts = fact_table()
    model.train()
    model.config._attn_implementation = "eager"
    make_row = {"table": fact_row, "check": check_row, "route": drill_row}[stage]
    score = held_out_score(stage, facts)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, log, running = time.time(), [], 0.0
    order: list[Fact] = []
    for step in range(steps):
        rows = []
        for _ in range(rows_per_batch):
            if len(order) < FACTS_PER_ROW:
                order += rng.sample(facts, len(facts))
            rows.append(make_row(rng, order[:FACTS_PER_ROW]))
            del order[:FACTS_PER_ROW]
        input_ids, targets = collate(rows)
        progress = 0.0 if score else max(0.0, (step - warmup) / max(1, steps - warmup))
        for group in opt.param_groups:  # linear warmup, cosine decay to 5% (or constant)
            group["lr"] = lr * min((step + 1) / warmup, 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        running += train_step(model, opt, params, input_ids, targets)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            model.eval()
            accuracy = fact_accuracy(model, rng.sample(facts, 1000))
            held_out = score(model) if score else None
            model.train()
            entry = {
                "step": step + 1,
                "loss": running / log_every,
                "sample_accuracy": accuracy,
                "held_out_score": held_out,
                "elapsed_s": time.time() - start,
            }
            log.append(entry)
            print(
                f"{stage} step {step + 1}/{steps} loss {entry['loss']:.4f} table {accuracy:.3f} "
                f"held-out {held_out} {entry['elapsed_s']:.0f}s",
                flush=True,
            )
            running = 0.0
            if checkpoint is not None:
                save_checkpoint(model, checkpoint)
            if held_out is not None and held_out >= target:
                break
    model.eval()
    return {
        "stage": stage,
        "seed": seed,
        "steps": step + 1,
        "max_steps": steps,
        "target": target,
        "rows_per_batch": rows_per_batch,
        "peak_lr": lr,
        "warmup": warmup,
        "train_seconds": time.time() - start,
        "table_accuracy": fact_accuracy(model, facts),
        "log": log,
    }


def build(stage: str, seed: int, init: Path, out: Path, extra_layers: int = 0, **recipe) -> dict:
    """Run one stage from the checkpoint in `init` and save the result to `out`; returns the
    training summary. With `extra_layers`, that many identity-initialised layers go on top and
    only they learn, so what the layers below know (the table, the check) stays as it is."""
    set_threads(PRM_THREADS)
    model = deepen(load_model(init), extra_layers)
    if extra_layers:
        train_new_layers_only(model, extra_layers)
    print(f"{stage}: table accuracy before {fact_accuracy(model, fact_table()):.3f}", flush=True)
    summary = teach(model, stage, seed, checkpoint=out, **recipe) | {"init": str(init), "extra_layers": extra_layers}
    save_checkpoint(model, out)
    write_json(out / STAGE_FILE, summary)
    print(f"{stage}: table accuracy after {summary['table_accuracy']:.4f} ({summary['train_seconds'] / 60:.1f} min)")
    return summary


def curriculum(ckpt: Path) -> dict[str, dict]:
    """The stages that made the checkpoint in `ckpt`, first to last, from the `STAGE_FILE`
    each stage leaves next to its weights (empty for a checkpoint no stage made). A stage's
    `init` that no longer exists where it was trained is looked for next to `ckpt`, by its
    name: stage directories copied together (e.g. out of the scratch dir) keep their chain."""
    stages: dict[str, dict] = {}
    while (ckpt / STAGE_FILE).exists():
        summary = read_json(ckpt / STAGE_FILE)
        stages = {summary["stage"]: summary} | stages
        init = Path(summary["init"])
        ckpt = init if init.exists() else ckpt.parent / init.name
    return stages


def main() -> None:
    stages = argparse.ArgumentParser(add_help=False)
    stages.add_argument("--stage", choices=STAGES, default="table")
    stage = stages.parse_known_args()[0].stage
    parser = recipe_parser(__doc__, DEFAULTS[stage])
    parser.add_argument("--stage", choices=STAGES, default="table")
    previous = STAGE_DIRS[STAGES[STAGES.index(stage) - 1]] if stage != "table" else PRM_BASE_DIR
    parser.add_argument("--init", type=Path, default=previous)
    parser.add_argument("--out", type=Path, default=STAGE_DIRS[stage])
    args = parser.parse_args()
    build(stage, args.seed, args.init, args.out, **{name: getattr(args, name) for name in DEFAULTS[stage]})


if __name__ == "__main__":
    main()
