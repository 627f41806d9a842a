"""tools/arith/search_mistakes.py: the first mistake of each completion in an eval results file."""

from __future__ import annotations

import pytest

from tools.arith.search_mistakes import first_mistake, format_counts, main, mistake_counts, paired_counts

PROBLEM = "Compute ((9 + 15) + 13) - 4."


def solution(*steps: str) -> str:
    return "\n\n".join(steps)


GOOD = solution(
    "9 + 15 = 24, leaving (24 + 13) - 4.", "24 + 13 = 37, leaving 37 - 4.", "37 - 4 = 33.", "The answer is \\boxed{33}."
)
WRONG_RESULT = solution(
    "9 + 15 = 25, leaving (25 + 13) - 4.", "25 + 13 = 38, leaving 38 - 4.", "38 - 4 = 34.", "The answer is \\boxed{34}."
)
MISCOPIED_OPERAND = solution(
    "9 + 16 = 25, leaving (25 + 13) - 4.", "25 + 13 = 38, leaving 38 - 4.", "38 - 4 = 34.", "The answer is \\boxed{34}."
)
MISCOPIED_REST = solution(
    "9 + 15 = 24, leaving (24 + 18) - 4.", "24 + 18 = 42, leaving 42 - 4.", "42 - 4 = 38.", "The answer is \\boxed{38}."
)


def completion(text: str) -> dict:
    return {"text": text, "answer": text.rsplit("{", 1)[1].split("}")[0], "step_scores": []}


def test_first_mistake_names_the_kind_of_the_first_wrong_step():
    assert first_mistake(PROBLEM, GOOD) == "none"
    assert first_mistake(PROBLEM, WRONG_RESULT) == "result"
    assert first_mistake(PROBLEM, MISCOPIED_OPERAND) == "operation"
    assert first_mistake(PROBLEM, MISCOPIED_REST) == "rest"


def test_counts_cover_all_completions_and_the_chosen_one_of_wrong_problems():
    document = {
        "problems": [
            # wrong: the search picked 34, first written by the miscopied operand
            {
                "problem": PROBLEM,
                "pred": "34",
                "correct": False,
                "completions": [completion(t) for t in (GOOD, MISCOPIED_OPERAND, WRONG_RESULT)],
            },
            # right: its completions count, its choice does not
            {
                "problem": PROBLEM,
                "pred": "33",
                "correct": True,
                "completions": [completion(t) for t in (MISCOPIED_REST, GOOD)],
            },
        ]
    }
    counts = mistake_counts(document)
    assert counts["all"] == {"none": 2, "operation": 1, "result": 1, "rest": 1}
    assert counts["chosen_wrong"] == {"operation": 1}
    text = format_counts("x", counts)
    assert "| chosen_wrong | 0 (0%) | 0 (0%) | 1 (100%) |" in text


def record(uid: str, pred: str, correct: bool, *texts: str) -> dict:
    return {
        "unique_id": uid,
        "problem": PROBLEM,
        "pred": pred,
        "correct": correct,
        "completions": [completion(t) for t in texts],
    }


def test_paired_counts_name_the_mistake_of_the_run_that_is_wrong():
    run = {
        "problems": [
            record("a", "34", False, MISCOPIED_OPERAND, GOOD),  # lost: this run's miscopy
            record("b", "33", True, GOOD, WRONG_RESULT),  # won: the baseline's wrong result
            record("c", "33", True, GOOD),  # both right: not counted
            record("d", "38", False, MISCOPIED_REST),  # not in the baseline: not counted
        ]
    }
    baseline = {
        "problems": [
            record("a", "33", True, GOOD),
            record("b", "34", False, WRONG_RESULT, GOOD),
            record("c", "33", True, GOOD),
        ]
    }
    counts = paired_counts(run, baseline)
    assert counts == {"lost": {"operation": 1}, "won": {"result": 1}}
    assert paired_counts(baseline, run) == {"lost": {"result": 1}, "won": {"operation": 1}}


@pytest.mark.parametrize("content", ["not json", '{"summary": {}}', '{"problems": [{"problem": "x"}]}'])
def test_the_cli_refuses_a_file_that_is_not_eval_results(tmp_path, monkeypatch, capsys, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    for argv in ([str(bad)], [str(tmp_path / "missing.json")]):
        monkeypatch.setattr("sys.argv", ["search_mistakes", *argv])
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 2
        assert argv[0] in capsys.readouterr().err
