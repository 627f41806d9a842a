"""The generator's recipe: the noisy teacher's rate per phase, the copy phase, and which
checkpoint the PRM is built on."""

from __future__ import annotations

import random

from tools.arith.common import PRM_BASE_DIR, generator_phase_dir
from tools.arith.data import NOISE_PER_DIGIT, noisy_solution, problem_stream
from tools.arith.train_generator import PHASES


def _problems(level: int, count: int):
    stream = problem_stream(random.Random(f"recipe-test-{level}"), level, exclude=set())
    return [next(stream) for _ in range(count)]


def test_a_noiseless_teacher_writes_the_reference_solution():
    rng = random.Random(0)
    for problem in _problems(5, 50):
        assert noisy_solution(rng, problem, per_digit=0.0) == problem.solution


def test_a_noisier_teacher_corrupts_more_solutions():
    problems = _problems(5, 400)

    def corrupted(per_digit: float) -> int:
        rng = random.Random(1)
        return sum(noisy_solution(rng, p, per_digit) != p.solution for p in problems)

    low, high = corrupted(NOISE_PER_DIGIT), corrupted(3 * NOISE_PER_DIGIT)
    assert 0 < low < high
    assert high > 1.8 * low, (low, high)


def test_the_copy_phase_is_last_and_the_prm_is_built_on_the_phase_before_it():
    *earlier, copy_phase = PHASES
    assert copy_phase["drill_frac"] == 0.0  # chat rows only: the copies are what it trains
    assert all(p["noise"] == NOISE_PER_DIGIT for p in earlier)
    assert copy_phase["noise"] > NOISE_PER_DIGIT  # sampled results stay spread
    assert generator_phase_dir(len(PHASES) - 1) == PRM_BASE_DIR
