"""Labelled step data for the arithmetic PRM: on-policy samples plus synthetic corruptions.

Every example is (problem, steps, labels) and every label comes from the step judge
`treeserve.eval.arith_labels.step_labels`, never from how the example was made. On-policy
examples are the generator's own samples (T=0.8 and T=1.0) on training problems; synthetic
ones corrupt a reference solution in one of the ways a solver goes wrong, and continue
consistently from the mistake:

* result: one step's result is wrong (a plausible slip: off by a little, carry, digits);
* many: several slips (the noisy teacher at a high rate);
* operand: an operand is miscopied, the result fits the miscopied operand;
* rest: the rewritten expression miscopies a number;
* order: an operation that is not ready is done first (precedence or parenthesis error);
* final: the boxed answer differs from the last result.

Examples that take minutes to make (samples, search-mined beams) are kept as JSON in the scratch
directory (`cached_examples`).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from pathlib import Path

from tools.arith.common import read_json, write_json
from treeserve.eval.arith import (
    BinOp,
    Problem,
    apply_op,
    format_answer,
    format_step,
    parse,
    ready_nodes,
    render,
    replace,
    solve,
)
from treeserve.eval.arith_labels import corrupt_value, step_labels

Example = tuple[str, list[str], list[bool]]
KINDS = ("result", "many", "operand", "rest", "order", "final")


def read_examples(path: Path) -> tuple[list[Example], float]:
    """Examples saved by `cached_examples` (JSON `{"seconds", "examples"}`), and their seconds."""
    saved = read_json(path)
    return [(p, steps, labels) for p, steps, labels in saved["examples"]], saved["seconds"]


def cached_examples(path: Path, make: Callable[[], list[Example]]) -> tuple[list[Example], float]:
    """`make()` and the seconds it took, kept at `path` (in the scratch directory): a later call
    with the same path reads them back instead."""
    if path.exists():
        return read_examples(path)
    start = time.time()
    examples = make()
    seconds = time.time() - start
    write_json(path, {"seconds": seconds, "examples": examples})
    return examples, seconds


def _steps_with_slips(rng: random.Random, problem: Problem, at: set[int]) -> list[str]:
    count = [0]

    def perturb(node: BinOp, value: int) -> int:
        count[0] += 1
        return corrupt_value(rng, value) if count[0] - 1 in at else value

    return solve(problem.expr, perturb)


def _continue_from(prefix: list[str], text: str) -> list[str]:
    """`prefix` then a correct solution of the expression `text` (or just its answer)."""
    try:
        expr = parse(text)
    except ValueError:
        return prefix
    return prefix + solve(expr)


def corrupted_steps(rng: random.Random, problem: Problem, kind: str) -> list[str]:
    steps = problem.steps
    n_ops = len(steps) - 1
    k = rng.randrange(n_ops)
    if kind == "result":
        return _steps_with_slips(rng, problem, {k})
    if kind == "many":
        return _steps_with_slips(rng, problem, {i for i in range(n_ops) if rng.random() < 0.5} | {k})
    if kind == "final":
        value = int(steps[-1][len("The answer is \\boxed{") : -2])
        return steps[:-1] + [format_answer(corrupt_value(rng, value))]
    # Replay the reference up to step k, then go wrong there.
    expr = problem.expr
    for _ in range(k):
        path, node = next(ready_nodes(expr))
        expr = replace(expr, path, apply_op(node.op, node.left, node.right))  # type: ignore[arg-type]
    path, node = next(ready_nodes(expr))
    if kind == "operand":
        a, b = node.left, node.right
        if rng.random() < 0.5:
            a = corrupt_value(rng, a)  # type: ignore[arg-type]
        else:
            b = corrupt_value(rng, b)  # type: ignore[arg-type]
        wrong = BinOp(node.op, a, b)
        value = apply_op(node.op, a, b)  # type: ignore[arg-type]
        rest = replace(expr, path, value)
        return steps[:k] + [format_step(wrong, value, rest)] + _continue_from([], render(rest))
    if kind == "rest":
        value = apply_op(node.op, node.left, node.right)  # type: ignore[arg-type]
        rest = replace(expr, path, value)
        if isinstance(rest, int):
            return steps[:k] + [format_step(node, value, rest), format_answer(corrupt_value(rng, value))]
        text = render(rest)
        numbers = list(re.finditer(r"\d+", text))
        m = rng.choice(numbers)
        text = text[: m.start()] + str(corrupt_value(rng, int(m.group()))) + text[m.end() :]
        return steps[:k] + [f"{node.left} {node.op} {node.right} = {value}, leaving {text}."] + _continue_from([], text)
    if kind == "order":
        text = render(expr)
        ready = {(n.left, n.op, n.right) for _, n in ready_nodes(expr)}
        pairs = [
            m
            for m in re.finditer(r"(?=(?<!\d)(\d+) ([-+*]) (\d+))", text)
            if (int(m.group(1)), m.group(2), int(m.group(3))) not in ready
        ]
        if not pairs:
            return _steps_with_slips(rng, problem, {k})
        m = rng.choice(pairs)
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        value = apply_op(op, a, b)
        end = m.start() + len(f"{a} {op} {b}")
        rest_text = text[: m.start()] + str(value) + text[end:]
        try:
            rest = parse(rest_text)
        except ValueError:
            return _steps_with_slips(rng, problem, {k})
        return steps[:k] + [format_step(BinOp(op, a, b), value, rest)] + _continue_from([], render(rest))
    raise ValueError(f"unknown corruption {kind!r}")


def synthetic_examples(rng: random.Random, problems: list[Problem]) -> list[Example]:
    """A corrupted solution of each problem and, beside it, the correct one: the pair differs
    only where the mistake is, so the label's gradient points at the mistake itself rather
    than at how deep the step is."""
    out: list[Example] = []
    for problem in problems:
        steps = corrupted_steps(rng, problem, rng.choice(KINDS))
        out.append((problem.text, steps, step_labels(problem.text, steps)))
        out.append((problem.text, list(problem.steps), step_labels(problem.text, problem.steps)))
    return out
