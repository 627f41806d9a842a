"""Paired comparison of results files (`treeserve compare`): counts, McNemar p-value, errors."""

from __future__ import annotations

import math

import pytest

from treeserve.cli import main
from treeserve.eval.compare import compare_results, format_comparison, mcnemar_exact
from treeserve.eval.metrics import ProblemOutcome, ScoredCompletion
from treeserve.eval.report import RunStats, build_results, write_results


def write_run(path, correct: dict[str, bool], strategy="majority", problems=None):
    """A results file with one problem per entry of `correct` (unique_id -> solved?)."""
    outcomes = []
    for uid, ok in correct.items():
        text = (problems or {}).get(uid, f"Compute {uid}.")
        answer = "1" if ok else "2"
        completion = ScoredCompletion(text=f"\\boxed{{{answer}}}", answer=answer, step_scores=[0.5], correct=ok)
        outcomes.append(ProblemOutcome(uid, 4, text, "1", [completion], pred=answer, correct=ok))
    config = {"search": {"strategy": strategy, "n": 1, "temperature": 0.8}, "selection": "weighted"}
    return write_results(build_results(config, outcomes, RunStats(wall_time_s=1.0)), path)


def test_mcnemar_exact_matches_the_binomial_tail():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(10, 0) == pytest.approx(2 / 2**10)
    assert mcnemar_exact(1, 9) == pytest.approx(2 * (1 + 10) / 2**10)
    assert mcnemar_exact(28, 17) == mcnemar_exact(17, 28)
    assert 0.1 < mcnemar_exact(28, 17) < 0.2  # 45 discordant pairs, 28 to 17: not significant at 5%


def test_counts_difference_and_interval_on_shared_problems(tmp_path):
    base = write_run(tmp_path / "a.json", {"p1": True, "p2": True, "p3": False, "p4": False, "extra": True})
    other = write_run(tmp_path / "b.json", {"p1": True, "p2": False, "p3": True, "p4": True}, strategy="beam_search")
    baseline, run = compare_results([base, other])
    assert (baseline.total, baseline.correct, baseline.only_this, baseline.only_baseline) == (4, 2, 0, 0)
    assert (run.correct, run.both, run.only_this, run.only_baseline, run.neither) == (3, 1, 2, 1, 0)
    assert run.difference == pytest.approx(0.25)
    low, high = run.difference_interval()
    half = 1.96 * math.sqrt(3 - 1 / 4) / 4
    assert (low, high) == pytest.approx((0.25 - half, 0.25 + half))
    assert run.p_value == pytest.approx(1.0)
    table = format_comparison([baseline, run])
    assert "4 shared problems" in table and "beam_search" in table and "+25.0%" in table


@pytest.mark.parametrize(
    "runs, message",
    [
        ([{"p1": True}], "at least two"),
        ([{"p1": True}, {"p2": True}], "share no problem"),
    ],
)
def test_rejects_unpairable_files(tmp_path, runs, message):
    paths = [write_run(tmp_path / f"{k}.json", r) for k, r in enumerate(runs)]
    with pytest.raises(ValueError, match=message):
        compare_results(paths)


def test_rejects_same_id_for_different_problems(tmp_path):
    a = write_run(tmp_path / "a.json", {"p1": True})
    b = write_run(tmp_path / "b.json", {"p1": True}, problems={"p1": "Compute 9 - 9."})
    with pytest.raises(ValueError, match="differs"):
        compare_results([a, b])


def test_cli_prints_table_and_reports_bad_input(tmp_path, capsys):
    a = write_run(tmp_path / "a.json", {"p1": True, "p2": False})
    b = write_run(tmp_path / "b.json", {"p1": True, "p2": True})
    assert main(["compare", str(a), str(b)]) == 0
    assert "McNemar p" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["compare", str(a), str(tmp_path / "bad.json")]) == 2
    assert "not a treeserve results file" in capsys.readouterr().err
    assert main(["compare", str(a), str(tmp_path / "missing.json")]) == 2
    assert "not found" in capsys.readouterr().err
