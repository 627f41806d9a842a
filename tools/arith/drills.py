"""Arithmetic fact drills for the PRM: short labelled examples that make it check each step.

Trained on whole solutions alone, the PRM learns that deep steps are often wrong instead of
checking a step's arithmetic (see the model card). Numbers of up to 3 digits are single
tokens and every operation of the arithmetic world has small operands, so the whole fact
table is small (~4,700 facts, `fact_table`); drills show each fact right and wrong many times,
in exactly the PRM input format, and stay in the training mix throughout so the check does
not fade. Two kinds, every label from the step judge `step_labels`:

* fact drills: a one-operation problem (or one operation with a second one left to do) and
  its first step `a op b = x[, leaving x op2 d].`, once with the true result and once with a
  plausible wrong one (`wrong_result`: the generator's slips, another operator, a miscopied
  operand, a near miss), optionally followed by the boxed answer;
* prefix drills: a training problem's reference solution cut right after step k, once as it
  is and once with step k gone wrong the way the generator's first wrong steps go wrong
  (`PREFIX_KINDS`, weighted like them: a wrong result; the right result written into the
  rest as another number; an operand miscopied from the previous rest or the problem, with
  the result of the miscopied operation; a wrong or premature final answer; the wrong order),
  so the pair differs only in its last step, at the same depth. The generator's slips are
  near misses (`near_miss`: mostly off by 1-3).
"""

from __future__ import annotations

import random

from tools.arith.prm_data import Example, corrupted_steps
from tools.arith.prm_io import roc_auc, score_steps
from treeserve.eval.arith import (
    LEVELS,
    OPS,
    BinOp,
    Expr,
    Problem,
    apply_op,
    format_answer,
    format_step,
    ready_nodes,
    replace,
)
from treeserve.eval.arith_labels import corrupt_value, step_labels

Fact = tuple[int, str, int]
MAX_LEAF = max(spec.max_leaf for spec in LEVELS.values())
MAX_VALUE = max(spec.max_value for spec in LEVELS.values())
# How a prefix drill's last step goes wrong, and how often: roughly the generator's first wrong
# steps on training problems (result 46%, rest 26%, right operand 12%, left operand 9%, final 4%).
PREFIX_KINDS = {
    "result": 0.36,
    "rest": 0.22,
    "right": 0.12,
    "left": 0.1,
    "final": 0.08,
    "premature": 0.04,
    "order": 0.04,
    "far": 0.04,
}
NEAR_MISSES = (1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 4, 5, 6, 8, 10)


def near_miss(rng: random.Random, value: int) -> int:
    """`value` off by a little, as the generator's slips are (never negative, never `value`)."""
    for _ in range(100):
        wrong = value + rng.choice((-1, 1)) * rng.choice(NEAR_MISSES)
        if wrong >= 0:
            return wrong
    return value + 1


def fact_table() -> list[Fact]:
    """Every operation a problem can contain: the left operand is a running value (0..MAX_VALUE),
    the right one a leaf (1..MAX_LEAF, 2..9 for `*`), the result in 0..MAX_VALUE."""
    facts: list[Fact] = []
    for a in range(MAX_VALUE + 1):
        for op in OPS:
            for b in range(2, 10) if op == "*" else range(1, MAX_LEAF + 1):
                if 0 <= apply_op(op, a, b) <= MAX_VALUE:
                    facts.append((a, op, b))
    return facts


def wrong_result(rng: random.Random, a: int, op: str, b: int) -> int:
    """A plausible wrong value of `a op b` (never the true one, never negative)."""
    true = apply_op(op, a, b)
    for _ in range(100):
        kind = rng.random()
        if kind < 0.35:
            wrong = corrupt_value(rng, true)  # the noisy teacher's slips, which the generator copies
        elif kind < 0.6:
            wrong = near_miss(rng, true)
        elif kind < 0.75:
            wrong = apply_op(rng.choice([o for o in OPS if o != op]), a, b)
        elif kind < 0.9:
            delta = rng.choice((-1, 1))
            wrong = apply_op(op, a + delta, b) if rng.random() < 0.5 else apply_op(op, a, max(1, b + delta))
        else:
            wrong = true + rng.choice((-1, 1)) * rng.randint(1, 10)
        if wrong != true and wrong >= 0:
            return wrong
    return true + 1


def fact_drill(rng: random.Random, fact: Fact, good: bool) -> Example:
    a, op, b = fact
    value = apply_op(op, a, b) if good else wrong_result(rng, a, op, b)
    if rng.random() < 0.5:  # the operation is all there is; sometimes the boxed answer follows
        problem = f"Compute {a} {op} {b}."
        steps = [f"{a} {op} {b} = {value}."]
        if rng.random() < 0.5:
            steps.append(format_answer(value if rng.random() < 0.8 else corrupt_value(rng, value)))
    else:  # a second operation is left to do, as in most steps of a real solution
        op2 = rng.choice(OPS)
        d = rng.randint(2, 9) if op2 == "*" else rng.randint(1, MAX_LEAF)
        problem = f"Compute ({a} {op} {b}) {op2} {d}."
        carried = value if good or rng.random() < 0.7 else near_miss(rng, apply_op(op, a, b))
        steps = [format_step(BinOp(op, a, b), value, BinOp(op2, carried, d))]
    return problem, steps, step_labels(problem, steps)


def state_at(problem: Problem, k: int) -> Expr:
    """The true expression left after the first `k` reference steps."""
    expr = problem.expr
    for _ in range(k):
        path, node = next(ready_nodes(expr))
        expr = replace(expr, path, apply_op(node.op, node.left, node.right))  # type: ignore[arg-type]
    return expr


def slipped_step(rng: random.Random, problem: Problem, k: int, kind: str) -> str:
    """Reference step `k` (an operation) gone wrong in one of the generator's ways."""
    state = state_at(problem, k)
    path, node = next(ready_nodes(state))
    a, b = node.left, node.right
    if kind == "left":
        a = near_miss(rng, a)  # type: ignore[arg-type]
    elif kind == "right":
        b = near_miss(rng, b) if rng.random() < 0.7 else rng.randint(1, MAX_LEAF)  # type: ignore[arg-type]
    value = apply_op(node.op, a, b)  # type: ignore[arg-type]
    if kind == "result":
        value = near_miss(rng, value) if rng.random() < 0.7 else corrupt_value(rng, value)
    elif kind == "far":
        value = wrong_result(rng, a, node.op, b)  # type: ignore[arg-type]
    carried = near_miss(rng, value) if kind == "rest" else value
    return format_step(BinOp(node.op, a, b), value, replace(state, path, carried))


def _first_bad_cut(problem: Problem, steps: list[str]) -> Example | None:
    labels = step_labels(problem.text, steps)
    if all(labels):
        return None
    cut = labels.index(False) + 1
    return problem.text, steps[:cut], labels[:cut]


def prefix_drill_pair(rng: random.Random, problem: Problem) -> list[Example]:
    """The reference cut after a step and, beside it, the same cut with that step wrong."""
    kind = rng.choices(list(PREFIX_KINDS), weights=list(PREFIX_KINDS.values()))[0]
    reference = list(problem.steps)
    n_ops = len(reference) - 1
    if kind == "rest" and n_ops == 1:
        kind = "result"  # a one-operation problem has no rest to miscopy
    if kind in ("result", "rest", "left", "right", "far"):
        k = rng.randrange(n_ops - 1 if kind == "rest" else n_ops)
        bad = _first_bad_cut(problem, reference[:k] + [slipped_step(rng, problem, k, kind)])
    elif kind == "premature":  # the boxed answer where an operation is still due
        k = rng.randrange(len(reference) - 1)
        last = reference[k - 1] if k else ""
        shown = last.split(" = ")[1].split(",")[0].rstrip(".") if k else str(rng.randint(1, MAX_LEAF))
        bad = _first_bad_cut(problem, reference[:k] + [format_answer(shown)])
    elif kind == "final":
        bad = _first_bad_cut(problem, reference[:-1] + [format_answer(near_miss(rng, problem.answer))])
    else:
        bad = _first_bad_cut(problem, corrupted_steps(rng, problem, kind))
    if bad is None:
        return []
    n = len(bad[1])
    good = (problem.text, reference[:n], step_labels(problem.text, reference[:n]))
    return [bad, good]


def drill_examples(rng: random.Random, fact_passes: int, problems: list[Problem]) -> list[Example]:
    """`fact_passes` passes over the fact table (each fact once right, once wrong, fresh wrong
    values and contexts every pass) plus a prefix-drill pair for each problem."""
    facts = fact_table()
    out = [fact_drill(rng, fact, good) for _ in range(fact_passes) for fact in facts for good in (True, False)]
    for problem in problems:
        out += prefix_drill_pair(rng, problem)
    return out


def fact_drill_auc(prm, facts: int = 600, seed: int = 99) -> float:
    """Step AUC on fact drills (`tools.arith.drills`): one operation, right or a plausible wrong
    result, nothing else to go on. 0.5 means the PRM does not check arithmetic at all."""
    rng = random.Random(seed)
    drills = [fact_drill(rng, fact, good) for fact in rng.sample(fact_table(), facts) for good in (True, False)]
    scores = score_steps(prm, [(problem, steps) for problem, steps, _ in drills])
    return roc_auc([s[0] for s in scores], [labels[0] for _, _, labels in drills])
