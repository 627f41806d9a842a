"""Copy drills: does the arithmetic PRM see an operand or a rest copied wrong?

    python -m tools.arith.copy_drills [--prm DIR]                  # measure a PRM
    python -m tools.arith.copy_drills --teach OUT [--minutes 85]   # a copy stage (an experiment)

Beam search on this world loses problems to miscopies (`search_mistakes --against`): the
generator writes `3 + 13 = 16` for `(3 + 14) - 11`, taking a number that is in view instead of
the one in place. A copy drill is a training problem's reference solution cut after step k,
once as it is and once with step k miscopied that way: an operand, or a number of the
rewritten rest, replaced by another number in view (in the expression the step works on, or
the result it just wrote) or by a near miss, with the result and what follows consistent with
the miscopy. The two differ only in their last step, at the same depth; every label comes
from `step_labels`.

`copy_drill_auc` scores held-out pairs at their last step tag (the PRM's own score). `--teach`
trains a copy stage on such drills (new layers over a frozen PRM, constant lr, fact drills
mixed in so the result check stays, optionally '+'/'-' at every copied token,
`copy_check.copy_check_targets`) and logs that AUC as it goes; `docs/prm-copy-check.md`
records what it did.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

from tools.arith.common import (
    PRM_DIR,
    collate,
    deepen,
    load_model,
    save_checkpoint,
    set_threads,
    train_new_layers_only,
    train_step,
)
from tools.arith.copy_check import copy_check_targets
from tools.arith.data import held_out_texts, problem_stream
from tools.arith.drills import fact_drill_auc, fact_table, near_miss, state_at
from tools.arith.facts import drill_row, tag_targets
from tools.arith.prm_data import Example
from tools.arith.prm_io import PRM_FORMAT, prm_input, roc_auc, score_steps
from treeserve.eval.arith import BinOp, Problem, apply_op, format_step, parse, ready_nodes, render, replace, solve
from treeserve.eval.arith_labels import step_labels

_RESULT = re.compile(r"= (-?\d+)")


def miscopy(rng: random.Random, true: int, in_view: list[int]) -> int:
    """Another number in view (60%, when there is one) or a near miss of `true`."""
    others = [n for n in in_view if n != true]
    return rng.choice(others) if others and rng.random() < 0.6 else near_miss(rng, true)


def miscopied_steps(rng: random.Random, problem: Problem, k: int) -> list[str] | None:
    """Reference steps up to k, then step k with a miscopied operand or rest number and a
    consistent rest of the solution; None where the miscopy would leave the world (a negative
    result, a factor outside 2-9)."""
    state = state_at(problem, k)
    path, node = next(ready_nodes(state))
    in_view = [int(n) for n in re.findall(r"\d+", render(state))]
    a, b = node.left, node.right
    value = apply_op(node.op, a, b)  # type: ignore[arg-type]
    if isinstance(replace(state, path, value), int) or rng.random() < 0.6:  # an operand
        if rng.random() < 0.5:
            a = miscopy(rng, a, in_view)  # type: ignore[arg-type]
        else:
            b = miscopy(rng, b, in_view)  # type: ignore[arg-type]
        if node.op == "*" and not 2 <= b <= 9:  # type: ignore[operator]
            return None
        value = apply_op(node.op, a, b)  # type: ignore[arg-type]
        rest = replace(state, path, value)
        step = format_step(BinOp(node.op, a, b), value, rest)
    else:  # a number of the rest
        text = render(replace(state, path, value))
        number = rng.choice(list(re.finditer(r"\d+", text)))
        wrong = miscopy(rng, int(number.group()), [*in_view, value])
        text = text[: number.start()] + str(wrong) + text[number.end() :]
        rest = parse(text)
        step = f"{node.left} {node.op} {node.right} = {value}, leaving {text}."
    steps = [*problem.steps[:k], step, *solve(rest)]
    return None if min(int(c) for c in _RESULT.findall("".join(steps))) < 0 else steps


def copy_drill_pair(rng: random.Random, problem: Problem) -> list[Example]:
    """[miscopied, right], both cut after the miscopied step; [] where no miscopy was made."""
    k = rng.randrange(len(problem.steps) - 1)
    steps = miscopied_steps(rng, problem, k)
    if steps is None:
        return []
    bad, right = steps[: k + 1], list(problem.steps[: k + 1])
    bad_labels = step_labels(problem.text, bad)
    if bad_labels[k]:
        return []
    return [(problem.text, bad, bad_labels), (problem.text, right, step_labels(problem.text, right))]


def held_out_pairs(per_level: int = 150) -> list[Example]:
    """Copy-drill pairs on training problems of levels 3-5 (never the test split) that
    `--teach` never draws (their own problem stream)."""
    rng, exclude, out = random.Random("copy-held-out"), held_out_texts(), []
    for level in (3, 4, 5):
        stream = problem_stream(random.Random(f"copy-held-out-{level}"), level, exclude)
        for _ in range(per_level):
            out += copy_drill_pair(rng, next(stream))
    return out


def copy_drill_auc(prm, pairs: list[Example]) -> float:
    """Step AUC of the PRM's score of the last step, right against miscopied."""
    scores = score_steps(prm, [(problem, steps) for problem, steps, _ in pairs])
    return roc_auc([s[-1] for s in scores], [labels[-1] for _, _, labels in pairs])


def copy_row(problem: str, steps: list[str], dense: bool) -> tuple[list[int], list[int]]:
    """Ids and targets: '+'/'-' at each tag and, with `dense`, at every copied token."""
    ids, tags = prm_input(problem, steps)
    target = tag_targets(ids, tags, step_labels(problem, steps))
    if dense:
        copies = copy_check_targets(problem, steps, ids, tags)
        target = [c if c != -100 else t for c, t in zip(copies, target, strict=True)]
    return ids, target


def teach_copy(init: Path, out: Path, minutes: float, lr: float, extra_layers: int, dense: bool, seed: int) -> None:
    """A copy stage: each batch 6 copy-drill pairs (levels 2-5) and 4 fact drills, only the
    `extra_layers` new layers learning, at a constant lr; held-out AUCs every 500 steps."""
    import torch

    set_threads()
    torch.manual_seed(seed)
    rng, facts, exclude = random.Random(f"copy-stage-{seed}"), fact_table(), held_out_texts()
    streams = [problem_stream(random.Random(f"copy-stage-{seed}-{lv}"), lv, exclude) for lv in (2, 3, 4, 4, 5, 5)]
    held = held_out_pairs()
    model = deepen(load_model(init), extra_layers)
    train_new_layers_only(model, extra_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    print(f"start: copy-drill AUC {copy_drill_auc(model, held):.3f}, fact-drill AUC {fact_drill_auc(model):.3f}")
    model.train().config._attn_implementation = "eager"
    start, step, running = time.time(), 0, 0.0
    while time.time() - start < minutes * 60:
        pairs = [example for _ in range(6) for example in copy_drill_pair(rng, next(rng.choice(streams)))]
        rows = [copy_row(problem, steps, dense) for problem, steps, _ in pairs]
        rows += [drill_row(rng, [rng.choice(facts)]) for _ in range(4)]
        input_ids, targets = collate(rows)
        running, step = running + train_step(model, opt, params, input_ids, targets), step + 1
        if step % 500 == 0:
            model.eval()
            aucs = f"copy-drill AUC {copy_drill_auc(model, held):.3f}, fact-drill AUC {fact_drill_auc(model):.3f}"
            print(f"step {step} loss {running / 500:.4f} {time.time() - start:.0f}s: {aucs}", flush=True)
            model.train()
            running = 0.0
    save_checkpoint(model.eval(), out, extra_files={"prm_config.json": PRM_FORMAT})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prm", type=Path, default=PRM_DIR, help="the PRM to measure, or --teach's start")
    parser.add_argument("--teach", type=Path, metavar="OUT", help="train a copy stage and save it here")
    parser.add_argument("--minutes", type=float, default=85.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--extra-layers", type=int, default=4)
    parser.add_argument("--dense", action="store_true", help="also '+'/'-' at every copied token")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not (args.prm / "config.json").is_file():
        parser.error(f"no checkpoint in {args.prm}")
    if args.teach is not None and args.extra_layers < 1:
        parser.error("--extra-layers must be at least 1: only the new layers learn")
    if args.teach is not None:
        teach_copy(args.prm, args.teach, args.minutes, args.lr, args.extra_layers, args.dense, args.seed)
        return
    set_threads()
    pairs = held_out_pairs()
    print(
        f"{args.prm}: copy-drill AUC {copy_drill_auc(load_model(args.prm), pairs):.3f} on {len(pairs)} held-out steps"
    )


if __name__ == "__main__":
    main()
