"""Training data for the arithmetic world: problem streams and the noisy teacher.

The generator is trained on solutions from a noisy teacher: each step's result is replaced,
with a probability that grows with the number of digits and the level, by a plausible
wrong value (`corrupt_value`), and later steps consistently use that wrong value. Together
with the model's small capacity this makes a generator that errs more on harder problems
and whose samples spread over right and wrong answers, which is what search needs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from treeserve.eval.arith import BinOp, Problem, arith_dataset, make_problem, solve
from treeserve.eval.arith_labels import corrupt_value

LEVELS = (1, 2, 3, 4, 5)
# Per-step error probability of the noisy teacher: BASE + PER_DIGIT * digits(result),
# scaled by LEVEL_SCALE[level]. Tuned so that greedy decoding stays mostly right while
# samples at T=0.8 go wrong often enough on hard problems.
# The copy phase of the generator's recipe raises PER_DIGIT (`train_generator.PHASES`).
NOISE_BASE = 0.0
NOISE_PER_DIGIT = 0.02
NOISE_LEVEL_SCALE = {1: 0.5, 2: 0.75, 3: 1.0, 4: 1.25, 5: 1.5}


def held_out_texts(seed: int = 0) -> set[str]:
    """Problems of the shipped test split: never used for training. (Level 1 has only
    about 900 distinct problems, so their arithmetic facts still occur inside longer
    training problems; only the exact test problems are held out.)"""
    return {r["problem"] for r in arith_dataset(500, seed=seed)}


def noise_rate(level: int, result: int, per_digit: float) -> float:
    digits = len(str(abs(result)))
    return (NOISE_BASE + per_digit * digits) * NOISE_LEVEL_SCALE[level]


def noisy_teacher(rng: random.Random, level: int, per_digit: float) -> Callable[[BinOp, int], int]:
    def perturb(node: BinOp, value: int) -> int:
        if rng.random() < noise_rate(level, value, per_digit):
            return corrupt_value(rng, value)
        return value

    return perturb


def problem_stream(rng: random.Random, level: int, exclude: set[str]) -> Iterator[Problem]:
    while True:
        problem = make_problem(rng, level)
        if problem.text not in exclude:
            yield problem


def noisy_solution(rng: random.Random, problem: Problem, per_digit: float) -> str:
    """A solution of `problem` whose step results the noisy teacher corrupts at `per_digit`."""
    perturb = noisy_teacher(rng, problem.level, per_digit)
    return "\n\n".join(solve(problem.expr, perturb))
