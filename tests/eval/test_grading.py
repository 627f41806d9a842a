"""Grading: answer extraction, arith in-process, math-verify in workers, timeouts that never hang."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from treeserve.eval.grading import Grader, extract_answer, verify_math

MATH500 = Path("/work/shared/data/math500.jsonl")


# Module-level so the worker processes can unpickle them by reference.
def sleepy_verify(gold: str, pred: str) -> bool:
    time.sleep(30)
    return True


def stuck_verify(gold: str, pred: str) -> bool:
    """Blocks SIGALRM, so only the parent's kill can end it (like C code that never yields)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        time.sleep(30)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    return True


@pytest.fixture(scope="module")
def grader():
    with Grader(timeout_s=5.0, max_workers=2) as g:
        yield g


def test_extract_answer():
    assert extract_answer("so \\boxed{3} no wait \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_answer("The answer is \\boxed{ 42 }.") == "42"
    assert (
        extract_answer("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}")
        == "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"
    )
    assert extract_answer("no answer here") is None
    assert extract_answer("\\boxed{}") is None
    assert extract_answer("cut off \\boxed{\\frac{1}{2") is None


def test_integer_grading_runs_in_process():
    with Grader() as g:
        verdicts = g.grade_many(
            [
                ("The answer is \\boxed{94}.", "94", "arith"),
                ("94", "94", "arith"),
                ("\\boxed{94.0}", "94", "arith"),
                ("\\boxed{95}", "94", "arith"),
                ("\\boxed{ninety-four}", "94", "arith"),
                (None, "94", "arith"),
            ]
        )
        assert verdicts == [True, True, True, False, False, False]
        assert g.answer_keys(["42", "42.0", "1,234", "1234", "x", None], "arith") == [
            "num:42",
            "num:42",
            "num:1234",
            "num:1234",
            "text:x",
            None,
        ]
        assert g.equivalent("42", "42.0", "arith") and not g.equivalent("42", "43", "arith")
        assert g.stats.worker_calls == 0 and g._pool is None  # no processes for arith


def test_bad_kind_and_arguments():
    g = Grader()
    with pytest.raises(ValueError, match="grader kind"):
        g.grade("1", "1", "exact")
    with pytest.raises(ValueError, match="timeout_s"):
        Grader(timeout_s=0)
    with pytest.raises(ValueError, match="max_workers"):
        Grader(max_workers=0)


def test_verify_math_in_process():
    assert verify_math("\\frac{1}{2}", "0.5")
    assert verify_math("\\frac{1}{2}", "The answer is \\boxed{\\dfrac12}.")
    assert not verify_math("\\frac{1}{2}", "\\frac{1}{3}")


@pytest.mark.skipif(not MATH500.exists(), reason="shared MATH-500 file not present")
def test_math500_rows_true_and_false(grader):
    rows = [json.loads(line) for line in MATH500.read_text(encoding="utf-8").splitlines()[:8]]
    right = [(extract_answer(r["solution"]), r["answer"], "math") for r in rows]
    right += [(r["solution"], r["answer"], "math") for r in rows]  # a whole text with \boxed{} works too
    # Each row's gold against the next row's answer: wrong unless the two are equivalent.
    wrong = [(rows[(i + 1) % len(rows)]["answer"], r["answer"], "math") for i, r in enumerate(rows)]
    distinct = [not verify_math(r["answer"], w[0]) for r, w in zip(rows, wrong, strict=True)]
    verdicts = grader.grade_many(right + wrong + [(None, rows[0]["answer"], "math")])
    assert verdicts[: len(right)] == [True] * len(right)
    assert verdicts[len(right) : -1] == [not d for d in distinct]
    assert sum(distinct) >= 6 and verdicts[-1] is False


def test_math_equivalence_and_cache(grader):
    keys = grader.answer_keys(["\\frac12", "0.5", "1/2", "x^2+1", "1+x^2", "\\frac13", None], "math")
    assert keys[0] == keys[1] == keys[2] and keys[3] == keys[4]
    assert keys[0] != keys[5] and keys[0] != keys[3] and keys[6] is None
    assert grader.equivalent("5.0", "5", "math") and not grader.equivalent("5", "6", "math")
    assert grader.grade_many([("0.5", "\\frac{1}{2}", "math"), ("2", "\\frac{1}{2}", "math")]) == [True, False]
    hits = grader.stats.cache_hits
    assert grader.grade("0.5", "\\frac{1}{2}", "math") is True
    assert grader.stats.cache_hits == hits + 1


def test_slow_item_times_out_as_wrong():
    start = time.monotonic()
    with Grader(timeout_s=0.3, kill_grace_s=1.0, max_workers=2, verify_fn=sleepy_verify) as g:
        assert g.grade_many([("1", "1", "math"), ("2", "2", "math"), ("3", "3", "math")]) == [False] * 3
        assert g.stats.timeouts == 3 and g.stats.pool_restarts == 0  # the worker's own deadline fired
    assert time.monotonic() - start < 20


def test_stuck_worker_is_killed_and_grading_goes_on():
    start = time.monotonic()
    with Grader(timeout_s=0.2, kill_grace_s=0.3, max_workers=2, verify_fn=stuck_verify) as g:
        assert g.grade_many([("1", "1", "math"), ("2", "2", "math"), ("3", "3", "math")]) == [False] * 3
        assert g.stats.timeouts == 3 and g.stats.pool_restarts >= 1
        g.verify_fn, g.timeout_s = verify_math, 5.0
        assert g.grade_many([("4", "4", "math"), ("5", "4", "math")]) == [True, False]
    assert time.monotonic() - start < 30


def test_workers_started_ahead_grade_and_close():
    """`start` launches the workers without waiting (run_eval: while the models load); grading
    then uses them, and a grader started but never used closes its processes."""
    with Grader(max_workers=2) as g:
        g.start()
        processes = list(g._pool._processes.values())  # noqa: SLF001 - the pool's workers
        assert g._pings  # noqa: SLF001 - nothing waited on yet
        assert g.grade_many([("\\frac12", "0.5", "math"), ("3", "4", "math")]) == [True, False]
        assert not g._pings and list(g._pool._processes.values()) == processes  # noqa: SLF001 - the same workers
    unused = Grader(max_workers=1)
    unused.start()
    processes += list(unused._pool._processes.values())  # noqa: SLF001
    unused.close()
    for p in processes:
        p.join(timeout=10)
        assert not p.is_alive()
