"""The built-in arithmetic task (search on a CPU with no downloads): seeded problems at levels 1-5 such as
`Compute ((12 + 7) * 3) - 15.`, reference solutions of one operation per step (`12 + 7 = 19, leaving
(19 * 3) - 15.`, blank-line separated, then `The answer is \\boxed{42}.`), MATH-500-shaped records and
exact grading. Pure Python: never imports torch, the engine or a model."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction

OPS = ("+", "-", "*")
PRECEDENCE = {"+": 1, "-": 1, "*": 2}  # for parsing input written without full parentheses
STEP_SEPARATOR = "\n\n"
SUBJECT = "arithmetic"


@dataclass(frozen=True)
class BinOp:
    op: str
    left: Expr
    right: Expr


Expr = int | BinOp
Path = tuple[int, ...]


@dataclass(frozen=True)
class LevelSpec:
    n_ops: int
    max_leaf: int  # leaves are drawn from 1..max_leaf (multipliers from 2..9)
    max_value: int  # every intermediate result lies in 0..max_value


LEVELS: dict[int, LevelSpec] = {
    1: LevelSpec(n_ops=1, max_leaf=12, max_value=50),
    2: LevelSpec(n_ops=2, max_leaf=12, max_value=60),
    3: LevelSpec(n_ops=3, max_leaf=15, max_value=80),
    4: LevelSpec(n_ops=4, max_leaf=15, max_value=100),
    5: LevelSpec(n_ops=5, max_leaf=20, max_value=120),
}


def apply_op(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


def evaluate(expr: Expr) -> int:
    if isinstance(expr, int):
        return expr
    return apply_op(expr.op, evaluate(expr.left), evaluate(expr.right))


def render(expr: Expr) -> str:
    """Fully parenthesised, so no precedence rule is needed to read it."""
    if isinstance(expr, int):
        return str(expr)
    left, right = render(expr.left), render(expr.right)
    if isinstance(expr.left, BinOp):
        left = f"({left})"
    if isinstance(expr.right, BinOp):
        right = f"({right})"
    return f"{left} {expr.op} {right}"


_TOKEN = re.compile(r"\s*(\d+|[-+*()])")


def parse(text: str) -> Expr:
    """Parse an expression such as `3 * (25 - 7) + 40`; raises ValueError on bad input."""
    tokens: list[str] = []
    pos, text = 0, text.strip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"unexpected character at {pos} in {text!r}")
        tokens.append(match.group(1))
        pos = match.end()
    expr, end = _parse_sum(tokens, 0)
    if end != len(tokens):
        raise ValueError(f"trailing input in {text!r}")
    return expr


def _parse_sum(tokens: list[str], i: int) -> tuple[Expr, int]:
    left, i = _parse_product(tokens, i)
    while i < len(tokens) and tokens[i] in ("+", "-"):
        right, j = _parse_product(tokens, i + 1)
        left, i = BinOp(tokens[i], left, right), j
    return left, i


def _parse_product(tokens: list[str], i: int) -> tuple[Expr, int]:
    left, i = _parse_atom(tokens, i)
    while i < len(tokens) and tokens[i] == "*":
        right, j = _parse_atom(tokens, i + 1)
        left, i = BinOp("*", left, right), j
    return left, i


def _parse_atom(tokens: list[str], i: int) -> tuple[Expr, int]:
    if i >= len(tokens):
        raise ValueError("expression ends early")
    tok = tokens[i]
    if tok.isdigit():
        return int(tok), i + 1
    if tok == "-" and i + 1 < len(tokens) and tokens[i + 1].isdigit():
        return -int(tokens[i + 1]), i + 2
    if tok == "(":
        expr, j = _parse_sum(tokens, i + 1)
        if j >= len(tokens) or tokens[j] != ")":
            raise ValueError("unbalanced parentheses")
        return expr, j + 1
    raise ValueError(f"unexpected token {tok!r}")


def ready_nodes(expr: Expr, path: Path = ()) -> Iterator[tuple[Path, BinOp]]:
    """Operations whose operands are both numbers, in post-order (the solving order)."""
    if isinstance(expr, int):
        return
    yield from ready_nodes(expr.left, path + (0,))
    yield from ready_nodes(expr.right, path + (1,))
    if isinstance(expr.left, int) and isinstance(expr.right, int):
        yield path, expr


def replace(expr: Expr, path: Path, value: Expr) -> Expr:
    if not path:
        return value
    if not isinstance(expr, BinOp):
        raise ValueError("path leads past a leaf")
    if path[0] == 0:
        return BinOp(expr.op, replace(expr.left, path[1:], value), expr.right)
    return BinOp(expr.op, expr.left, replace(expr.right, path[1:], value))


def format_step(node: BinOp, value: int, rest: Expr) -> str:
    """One solution step: the operation, its result and, unless done, what is left."""
    equation = f"{node.left} {node.op} {node.right} = {value}"
    if isinstance(rest, int):
        return f"{equation}."
    return f"{equation}, leaving {render(rest)}."


def format_answer(value: int | str) -> str:
    return f"The answer is \\boxed{{{value}}}."


def solve(expr: Expr, perturb: Callable[[BinOp, int], int] | None = None) -> list[str]:
    """Solution steps for `expr`, the boxed answer last; `perturb(node, true_result)` may change a
    step's result (a noisy teacher), which later steps then use."""
    steps: list[str] = []
    while isinstance(expr, BinOp):
        path, node = next(ready_nodes(expr))
        value = apply_op(node.op, node.left, node.right)  # type: ignore[arg-type]
        if perturb is not None:
            value = perturb(node, value)
        expr = replace(expr, path, value)
        steps.append(format_step(node, value, expr))
    steps.append(format_answer(expr))
    return steps


@dataclass(frozen=True)
class Problem:
    expr: Expr
    level: int

    @property
    def text(self) -> str:
        return f"Compute {render(self.expr)}."

    @property
    def answer(self) -> int:
        return evaluate(self.expr)

    @property
    def steps(self) -> list[str]:
        return solve(self.expr)

    @property
    def solution(self) -> str:
        return STEP_SEPARATOR.join(self.steps)


def problem_expression(problem: str) -> Expr:
    """The expression of a problem text `Compute <expr>.`"""
    text = problem.strip()
    if text.startswith("Compute "):
        text = text[len("Compute ") :]
    return parse(text.rstrip("."))


def _intermediates(expr: Expr) -> Iterator[int]:
    if isinstance(expr, BinOp):
        yield from _intermediates(expr.left)
        yield from _intermediates(expr.right)
        yield evaluate(expr)


def extend_chain(rng: random.Random, expr: Expr, n_ops: int, max_leaf: int) -> Expr:
    """`expr` extended to a left-deep chain `((expr op b) op c) op d` (multipliers 2-9, else 1..max_leaf)."""
    for _ in range(n_ops):
        op = rng.choice(OPS)
        expr = BinOp(op, expr, rng.randint(2, 9) if op == "*" else rng.randint(1, max_leaf))
    return expr


def make_problem(rng: random.Random, level: int) -> Problem:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level!r}")
    spec = LEVELS[level]
    while True:
        expr = extend_chain(rng, rng.randint(1, spec.max_leaf), spec.n_ops, spec.max_leaf)
        if any(v < 0 or v > spec.max_value for v in _intermediates(expr)):
            continue
        return Problem(expr, level)


def to_record(problem: Problem, unique_id: str) -> dict:
    """A MATH-500-shaped record."""
    return {
        "problem": problem.text,
        "solution": problem.solution,
        "answer": str(problem.answer),
        "subject": SUBJECT,
        "level": problem.level,
        "unique_id": unique_id,
    }


def arith_dataset(size: int = 500, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3, 4, 5)) -> list[dict]:
    """`size` distinct problems spread evenly over `levels`, reproducible from `seed`; the default is
    the fixed test split (ids `arith/L<level>/<index>`)."""
    if size < 0 or not levels:
        raise ValueError("size must be >= 0 and levels non-empty")
    records: list[dict] = []
    for k, level in enumerate(levels):
        count = size // len(levels) + (1 if k < size % len(levels) else 0)
        rng = random.Random(f"treeserve-arith-{seed}-L{level}")
        seen: set[str] = set()
        misses = 0
        while len(seen) < count:
            problem = make_problem(rng, level)
            if problem.text in seen:
                misses += 1
                if misses > 100 * count:
                    raise ValueError(f"level {level} has too few distinct problems for {count}")
                continue
            records.append(to_record(problem, f"arith/L{level}/{len(seen):04d}"))
            seen.add(problem.text)
    return records


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text` (braces may nest), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def to_number(text: str | int) -> Fraction | None:
    """Exact value of an answer such as `42`, `-7`, `1,234`, `42.0` or `$42$`; None if not a number."""
    if isinstance(text, int):
        return Fraction(text)
    cleaned = text.strip().strip("$").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+", cleaned):
        cleaned = cleaned.replace(",", "")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def grade(prediction: str | int, answer: str | int) -> bool:
    """True iff the prediction's boxed answer (or the prediction itself) equals `answer` exactly."""
    if isinstance(prediction, str):
        boxed = extract_boxed(prediction)
        prediction = boxed if boxed is not None else prediction
    value, target = to_number(prediction), to_number(answer)
    return value is not None and target is not None and value == target
