"""Teach a model the arithmetic world's fact table by next-token loss, before it learns to judge.

    python -m tools.arith.facts --seed 0 [--steps 6000] [--lr 0.002] [--out DIR]

A PRM can only call `87 + 15 = 101` wrong if it knows that 87 + 15 is 102. The generator
knows the facts of the small numbers it meets most (top-1 on the whole table: 23%), and a PRM
trained on judged steps alone never learns the rest: a '+'/'-' label says little about which
value would have been right. Predicting the result of every fact does, so the PRM's recipe
starts here: rows in the PRM's own input format, each a one-operation problem followed by
`FACTS_PER_ROW` operation steps of random facts (`a op b = c.<|step|>`), with the loss on
every result token `c`. Numbers are single tokens, so the table (`drills.fact_table`,
4,647 facts) is a lookup to memorise: AdamW with a cosine schedule, starting from the
generator's weights. The checkpoint is scratch input for `train_prm --init` (not shipped).

The second half of a check is comparing the written result with the known one. `--check`
trains it on rows whose results are wrong half the time (`check_row`: the true value is the
target before each result, '+'/'-' the target at it). It puts `extra_layers` new
identity-initialised layers on top of the table model and trains only those, so the table
stays as known, at a constant learning rate until the check is right on `target` of 800
held-out results (`CHECK_DEFAULTS`). It stays at chance for about 2,000 steps, then starts to
compare (grokking-like); a cosine schedule decays the rate before the comparison has formed.

    python -m tools.arith.facts --check --seed 0 [--init <table model>] [--out DIR]
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

from tools.arith.common import (
    BAD_ID,
    GENERATOR_DIR,
    GOOD_ID,
    VOCAB,
    WORK_DIR,
    collate,
    deepen,
    encode_text,
    load_model,
    recipe_parser,
    save_checkpoint,
    set_single_thread,
)
from tools.arith.drills import Fact, fact_table, wrong_result
from tools.arith.prm_io import prm_input
from treeserve.eval.arith import OPS, apply_op

FACTS_DIR = WORK_DIR / "arith-facts"
CHECK_DIR = WORK_DIR / "arith-check"
FACTS_PER_ROW = 8
DEFAULTS = {"steps": 6000, "rows_per_batch": 32, "lr": 2e-3, "warmup": 100}
# The check stage: constant lr after warmup (a decaying one stalls the comparison while it is
# still forming), stopped at the first log line where held-out check accuracy reaches `target`.
CHECK_DEFAULTS = {"steps": 30000, "rows_per_batch": 32, "lr": 1e-3, "warmup": 100, "target": 0.95, "extra_layers": 2}
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


def fact_row(facts: list[Fact]) -> tuple[list[int], list[int]]:
    """Token ids and result targets of one row: the first fact as the problem, all as steps."""
    a, op, b = facts[0]
    steps = [f"{x} {o} {y} = {apply_op(o, x, y)}." for x, o, y in facts]
    ids, tags = prm_input(f"Compute {a} {op} {b}.", steps)
    return ids, result_targets(ids, tags, [True] * len(steps))


def check_row(rng: random.Random, facts: list[Fact]) -> tuple[list[int], list[int]]:
    """Like `fact_row`, but each result is wrong with probability 1/2 (`drills.wrong_result`).
    Targets: the true result at the position before each result, '+'/'-' at the result."""
    a, op, b = facts[0]
    truths = [apply_op(o, x, y) for x, o, y in facts]
    written = [t if rng.random() < 0.5 else wrong_result(rng, *f) for t, f in zip(truths, facts, strict=True)]
    steps = [f"{x} {o} {y} = {w}." for (x, o, y), w in zip(facts, written, strict=True)]
    ids, tags = prm_input(f"Compute {a} {op} {b}.", steps)
    target = fact_check_targets(ids, tags)
    for pos, truth in zip(result_positions(ids, tags), truths, strict=True):
        target[pos] = encode_text(str(truth))[0]
    return ids, target


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

    rows = [fact_row(facts[i : i + FACTS_PER_ROW]) for i in range(0, len(facts), FACTS_PER_ROW)]
    right = total = 0
    with torch.no_grad():
        for i in range(0, len(rows), rows_per_batch):
            input_ids, targets = collate(rows[i : i + rows_per_batch])
            predicted = model(input_ids=input_ids).logits.argmax(-1)
            mask = targets >= 0
            right += int((predicted[mask] == targets[mask]).sum())
            total += int(mask.sum())
    return right / total


def teach(
    model, seed: int, steps: int, rows_per_batch: int, lr: float, warmup: int, log_every: int = 250,
    checkpoint: Path | None = None, check: bool = False, target: float = 1.0,
) -> dict:  # fmt: skip
    """Train `model`'s trainable parameters in place on the fact table (cosine schedule), or
    with `check` on `check_row`s (half the results wrong, judged at the result token; constant
    lr, stopping once check accuracy on 100 held-out rows reaches `target`); returns the
    training log. With `checkpoint`, the model is saved there at every log line."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(f"facts-{seed}")
    facts = fact_table()
    model.train()
    model.config._attn_implementation = "eager"
    check_rows = [check_row(random.Random(f"check-{i}"), random.Random(i).sample(facts, FACTS_PER_ROW))
                  for i in range(100)] if check else []  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, log, running = time.time(), [], 0.0
    order: list[Fact] = []
    for step in range(steps):
        rows = []
        for _ in range(rows_per_batch):  # passes over the shuffled table, FACTS_PER_ROW at a time
            if len(order) < FACTS_PER_ROW:
                order += rng.sample(facts, len(facts))
            chunk = order[:FACTS_PER_ROW]
            rows.append(check_row(rng, chunk) if check else fact_row(chunk))
            del order[:FACTS_PER_ROW]
        input_ids, targets = collate(rows)
        progress = 0.0 if check else max(0.0, (step - warmup) / max(1, steps - warmup))
        for group in opt.param_groups:  # linear warmup, cosine decay to 5% (check: constant)
            group["lr"] = lr * min((step + 1) / warmup, 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=input_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            model.eval()
            accuracy = fact_accuracy(model, rng.sample(facts, 1000))
            checked = check_accuracy(model, check_rows) if check else None
            model.train()
            entry = {"step": step + 1, "loss": running / log_every, "sample_accuracy": accuracy,
                     "check_accuracy": checked, "elapsed_s": time.time() - start}  # fmt: skip
            log.append(entry)
            print(f"facts step {step + 1}/{steps} loss {entry['loss']:.4f} acc {accuracy:.3f} "
                  f"check {checked} {entry['elapsed_s']:.0f}s", flush=True)  # fmt: skip
            running = 0.0
            if checkpoint is not None:
                save_checkpoint(model, checkpoint)
            if check and checked >= target:
                break
    model.eval()
    return {"seed": seed, "steps": step + 1, "max_steps": steps, "target": target, "rows_per_batch": rows_per_batch,
            "facts_per_row": FACTS_PER_ROW,
            "peak_lr": lr, "warmup": warmup, "check": check, "train_seconds": time.time() - start,
            "table_accuracy": fact_accuracy(model, facts), "log": log}  # fmt: skip


def build(seed: int, init: Path, out: Path, check: bool = False, **recipe) -> dict:
    """Run one stage (the table, or with `check` the check on top of a table model) from the
    checkpoint in `init` and save the result to `out`; returns the training summary.
    `recipe` is `DEFAULTS` or `CHECK_DEFAULTS`, possibly changed."""
    set_single_thread()
    extra_layers = recipe.pop("extra_layers", 0)
    model = deepen(load_model(init), extra_layers)
    if extra_layers:  # the table stays exactly as known; only the new layers learn
        model.requires_grad_(False)
        for layer in model.model.layers[-extra_layers:]:
            layer.requires_grad_(True)
    print(f"table accuracy before: {fact_accuracy(model, fact_table()):.3f}", flush=True)
    summary = teach(model, seed, checkpoint=out, check=check, **recipe)
    save_checkpoint(model, out)
    print(f"table accuracy after: {summary['table_accuracy']:.4f} ({summary['train_seconds'] / 60:.1f} min)")
    return summary | {"init": init.name, "extra_layers": extra_layers}


def main() -> None:
    check = "--check" in sys.argv[1:]
    defaults = CHECK_DEFAULTS if check else DEFAULTS
    parser = recipe_parser(__doc__, defaults)
    parser.add_argument("--init", type=Path, default=FACTS_DIR if check else GENERATOR_DIR)
    parser.add_argument("--out", type=Path, default=CHECK_DIR if check else FACTS_DIR)
    parser.add_argument("--check", action="store_true", help="train the fact check on rows with wrong results")
    args = parser.parse_args()
    build(args.seed, args.init, args.out, check, **{name: getattr(args, name) for name in defaults})


if __name__ == "__main__":
    main()
