"""The arithmetic step judge (PRM training labels and checks) and the corruptions that make wrong steps.

The judge replays the true state (operations done so far replaced by their true values): a step
`a op b = c[, leaving <rest>].` is good iff `a op b` is a ready operation of that state (`+`, `*` may swap
operands), `c` its true value and `<rest>` the state after it. A named operation advances the state with
its true value even when wrong, so a wrong value carried on makes later steps bad."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from treeserve.eval.arith import (
    STEP_SEPARATOR,
    BinOp,
    Expr,
    apply_op,
    evaluate,
    extract_boxed,
    parse,
    problem_expression,
    ready_nodes,
    replace,
    to_number,
)

_OP_STEP = re.compile(r"^(-?\d+) ([-+*]) (-?\d+) = (-?\d+)(?:, leaving (.+))?\.$")


def split_steps(solution: str) -> list[str]:
    """Steps of a solution text: blank-line separated, stripped, empty ones dropped."""
    return [s.strip() for s in solution.split(STEP_SEPARATOR) if s.strip()]


def parse_op_step(step: str) -> tuple[int, str, int, int, str | None] | None:
    """`(a, op, b, c, rest)` of an operation step, or None if it is not one."""
    match = _OP_STEP.match(step.strip())
    if match is None:
        return None
    a, op, b, c, rest = match.groups()
    return int(a), op, int(b), int(c), rest


def _matches(node: BinOp, op: str, a: int, b: int) -> bool:
    if node.op != op:
        return False
    if (node.left, node.right) == (a, b):
        return True
    return op in ("+", "*") and (node.left, node.right) == (b, a)


def _same_tree(text: str | None, expected: Expr) -> bool:
    if text is None:
        return isinstance(expected, int)
    if isinstance(expected, int):
        return False
    try:
        return parse(text) == expected
    except ValueError:
        return False


MISTAKES = ("format", "operation", "result", "rest", "final")  # what `step_verdicts` calls a bad step


def step_verdicts(problem: str | Expr, steps: Sequence[str]) -> list[str]:
    """Per step, "good" or one of MISTAKES: "format" (not a step, or one after nothing is left),
    "operation" (not a ready operation of the true state), "result", "rest" or "final" (wrong answer)."""
    state = problem_expression(problem) if isinstance(problem, str) else problem
    answer = evaluate(state)
    verdicts: list[str] = []
    for step in steps:
        boxed = extract_boxed(step)
        if boxed is not None:
            right = step.strip().startswith("The answer is") and to_number(boxed) == answer
            verdicts.append("good" if right else "final")
            continue
        parsed = parse_op_step(step)
        if parsed is None or isinstance(state, int):
            verdicts.append("format")
            continue
        a, op, b, c, rest = parsed
        candidates = [(p, n) for p, n in ready_nodes(state) if _matches(n, op, a, b)]
        if not candidates:
            verdicts.append("operation")
            continue
        verdict, next_state = "", None
        for path, node in candidates:
            true_value = apply_op(node.op, node.left, node.right)  # type: ignore[arg-type]
            after = replace(state, path, true_value)
            next_state = next_state if next_state is not None else after
            if c != true_value:
                verdict = verdict or "result"
            elif _same_tree(rest, after):
                verdict, next_state = "good", after
                break
            else:
                verdict = "rest"
        verdicts.append(verdict)
        state = next_state  # type: ignore[assignment]
    return verdicts


def step_labels(problem: str | Expr, steps: Sequence[str]) -> list[bool]:
    return [verdict == "good" for verdict in step_verdicts(problem, steps)]


def solution_labels(problem: str, solution: str) -> tuple[list[str], list[bool]]:
    steps = split_steps(solution)
    return steps, step_labels(problem, steps)


def corrupt_value(rng: random.Random, value: int) -> int:
    """A plausible wrong result near `value`: off by a little, a carry slip or a digit slip."""
    for _ in range(100):
        kind = rng.random()
        digits = str(abs(value))
        if kind < 0.25:
            wrong = value + rng.choice((-2, -1, 1, 2))
        elif kind < 0.5:
            wrong = value + rng.choice((-1, 1)) * 10 ** rng.randrange(1, max(2, len(digits)))
        elif kind < 0.75 and len(digits) >= 2:
            i = rng.randrange(len(digits) - 1)
            swapped = digits[:i] + digits[i + 1] + digits[i] + digits[i + 2 :]
            wrong = int(swapped) * (1 if value >= 0 else -1)
        else:
            i = rng.randrange(len(digits))
            new_digit = rng.choice([d for d in "0123456789" if d != digits[i]])
            if i == 0 and new_digit == "0" and len(digits) > 1:
                continue
            wrong = int(digits[:i] + new_digit + digits[i + 1 :]) * (1 if value >= 0 else -1)
        if wrong != value and wrong >= 0:
            return wrong
    return value + 1
