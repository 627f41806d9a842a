"""The PRM's copy-check targets (tools/arith/copy_check.py): which tokens they judge and what they say."""

from __future__ import annotations

import random

from tools.arith.common import VOCAB
from tools.arith.copy_check import copy_check_targets
from tools.arith.data import problem_stream
from tools.arith.prm_data import corrupted_steps
from tools.arith.prm_io import prm_input
from treeserve.eval.arith_labels import step_verdicts

TOKENS = {i: t for t, i in VOCAB.items()}
PROBLEM = "Compute ((9 + 15) + 13) - 4."
GOOD = [
    "9 + 15 = 24, leaving (24 + 13) - 4.",
    "24 + 13 = 37, leaving 37 - 4.",
    "37 - 4 = 33.",
    "The answer is \\boxed{33}.",
]


def judged(steps: list[str]) -> list[list[str]]:
    """Per step, the judged tokens as `token+` / `token-`."""
    ids, tags = prm_input(PROBLEM, steps)
    targets = copy_check_targets(PROBLEM, steps, ids, tags)
    out, start = [], 0
    for tag in tags:
        out.append([f"{TOKENS[ids[i]]}{TOKENS[targets[i]]}" for i in range(start, tag) if targets[i] >= 0])
        start = tag + 1
    return out


def test_a_right_solution_has_every_copied_token_right():
    assert judged(GOOD) == [
        ["9+", "++", "15+", "24+", "++", "13+", "-+", "4+"],
        ["24+", "++", "13+", "37+", "-+", "4+"],
        ["37+", "-+", "4+"],
        ["33+"],
    ]


def test_a_miscopied_operand_is_marked_where_it_is_written_and_judging_stops_there():
    steps = ["9 + 15 = 24, leaving (24 + 13) - 4.", "24 + 18 = 42, leaving 42 - 4.", "42 - 4 = 38."]
    assert judged(steps) == [
        ["9+", "++", "15+", "24+", "++", "13+", "-+", "4+"],
        ["24+", "++", "18-", "42+", "-+", "4+"],
        [],
    ]


def test_a_miscopied_rest_is_marked_at_the_number_and_the_operator():
    steps = ["9 + 15 = 24, leaving (24 - 13) - 5.", "24 - 13 = 11."]
    assert judged(steps)[0] == ["9+", "++", "15+", "24+", "--", "13+", "-+", "5-"]
    assert judged(steps)[1] == []


def test_a_wrong_result_is_carried_as_a_right_copy_and_a_wrong_answer_is_marked():
    steps = ["9 + 15 = 25, leaving (25 + 13) - 4."]
    assert judged(steps) == [["9+", "++", "15+", "25+", "++", "13+", "-+", "4+"]]  # the result is the fact check's
    assert judged(GOOD[:3] + ["The answer is \\boxed{34}."])[3] == ["34-"]


def test_a_rest_of_another_shape_judges_only_the_operation():
    assert judged(["9 + 15 = 24, leaving 24 + 13 - 4."]) == [["9+", "++", "15+"]]


def test_copy_marks_agree_with_the_step_judge_on_synthetic_mistakes():
    """A step every copied token of which is right is never an operation or rest mistake."""
    rng = random.Random(0)
    stream = problem_stream(random.Random(1), 4, set())
    for _ in range(200):
        problem = next(stream)
        steps = corrupted_steps(rng, problem, rng.choice(("operand", "rest")))
        ids, tags = prm_input(problem.text, steps)
        targets = copy_check_targets(problem.text, steps, ids, tags)
        verdicts = step_verdicts(problem.text, steps)
        start = 0
        for tag, verdict in zip(tags, verdicts, strict=True):
            marks = {TOKENS[t] for t in targets[start:tag] if t >= 0}
            if marks == {"+"}:
                assert verdict not in ("operation", "rest")
            if verdict != "good":
                break
            start = tag + 1
