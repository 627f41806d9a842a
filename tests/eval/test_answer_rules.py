"""Every accuracy names the answer rule that produced it: the summary (JSON and the CLI line),
`treeserve compare` (like with like), plot titles, and bad `--select` values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.eval.test_metrics import completion, three_way_problem
from treeserve.cli import main
from treeserve.eval.compare import compare_by_rule, compare_results
from treeserve.eval.metrics import DEFAULT_SELECTION, SELECTIONS, ProblemOutcome, describe_accuracy, summarize
from treeserve.eval.plots import headline_title
from treeserve.eval.report import RunStats, build_results, read_results, write_results
from treeserve.eval.runner import EvalSettings


def test_the_summary_names_its_rule_and_gives_the_others():
    problem = three_way_problem()  # naive picks a wrong A, weighted the right B, majority a wrong C
    problem.correct = True  # chosen by weighted
    summary = summarize([problem], agg="last", rule="weighted")
    assert summary["accuracy_rule"] == "weighted"
    assert summary["accuracy_by_rule"] == {"naive": 0.0, "weighted": 1.0, "majority": 0.0, "pass@N": 1.0}
    assert describe_accuracy(summary) == "accuracy 1.000 (weighted@6; naive 0.000, majority 0.000, pass@6 1.000)"
    unknown = summarize([problem], agg="last")
    assert describe_accuracy(unknown).startswith("accuracy 1.000 (rule not recorded; naive 0.000, weighted 1.000")
    old = {k: v for k, v in unknown.items() if k not in ("accuracy_rule", "accuracy_by_rule")}
    assert describe_accuracy(old) == "accuracy 1.000 (rule not recorded)"
    with pytest.raises(ValueError, match="naive"):
        summarize([problem], rule="best")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.search.step_world import build_step_world

    return build_step_world(str(tmp_path_factory.mktemp("rules_world")))


@pytest.mark.parametrize(
    ("strategy", "select"),
    [(s, None) for s in DEFAULT_SELECTION] + [("beam_search", "naive"), ("best_of_n", "majority")],
)
def test_every_strategy_prints_and_records_its_rule(world, tmp_path, capsys, strategy, select):
    generator, prm = world
    out = tmp_path / "r.json"
    args = [
        "eval",
        "--dataset",
        "arith:level=1,size=3,seed=0",
        "--generator",
        generator,
        "--prm",
        prm,
        "--strategy",
        strategy,
        "--n",
        "4",
        "--beam-width",
        "2",
        "--num-iterations",
        "3",
        "--max-tokens",
        "16",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        str(64 << 20),
        "--output",
        str(out),
    ]
    assert main(args + (["--select", select] if select else [])) == 0
    rule = select or DEFAULT_SELECTION[strategy]
    summary = json.loads(out.read_text())["summary"]
    assert summary["accuracy_rule"] == rule
    assert summary["accuracy"] == summary["accuracy_by_rule"][rule] == summary[f"{rule}@n"]["4"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"{strategy} n=4:"))
    others = ", ".join(f"{m} {summary['accuracy_by_rule'][m]:.3f}" for m in SELECTIONS if m != rule)
    assert f"accuracy {summary['accuracy']:.3f} ({rule}@4; {others}, pass@4 " in line


def write_run(path: Path, rule: str) -> Path:
    """Two problems of one run, its answers chosen by `rule`: on "p" naive is wrong and weighted
    right; on "q" both are right."""
    easy = ProblemOutcome("q", 1, "Compute 1+1.", "2", [completion("2", [0.9], True), completion("3", [0.1], False)])
    problems = [three_way_problem(), easy]
    for p in problems:
        chosen = {"naive": 0, "weighted": 1, "majority": 3}[rule] if p is problems[0] else 0
        p.pred, p.correct = p.completions[chosen].answer, p.completions[chosen].correct
    config = {"search": {"strategy": "beam_search", "n": 6, "agg": "last"}, "selection": rule}
    return write_results(build_results(config, problems, RunStats(wall_time_s=1.0)), path)


def test_compare_pairs_like_with_like_when_rules_differ(tmp_path, capsys):
    weighted, naive = write_run(tmp_path / "weighted.json", "weighted"), write_run(tmp_path / "naive.json", "naive")
    as_recorded = compare_results([weighted, naive])  # what compare did before: 100% against 50%
    assert [c.correct for c in as_recorded] == [2, 1]
    by_rule = compare_by_rule([weighted, naive])
    assert list(by_rule) == ["naive", "weighted"]
    for rule, (base, run) in by_rule.items():  # the same run under one rule: no difference
        assert base.rule == run.rule == rule
        assert (run.only_this, run.only_baseline) == (0, 0) and run.correct == base.correct
    assert by_rule["naive"][0].correct == 1 and by_rule["weighted"][0].correct == 2
    assert main(["compare", str(weighted), str(naive)]) == 0
    out = capsys.readouterr().out
    assert "different rules (weighted.json: weighted, naive.json: naive)" in out
    assert "answer rule: naive" in out and "answer rule: weighted" in out
    same = compare_by_rule([weighted, write_run(tmp_path / "again.json", "weighted")])
    assert list(same) == ["weighted"]  # one rule: one table, as recorded


def test_plot_titles_name_each_files_rule(tmp_path):
    paths = [write_run(tmp_path / "w.json", "weighted"), write_run(tmp_path / "n.json", "naive")]
    title = headline_title([(p, read_results(p)) for p in paths])
    assert title == "accuracy vs N; headline rule: beam_search N=6 weighted, beam_search N=6 naive"


def test_an_unknown_rule_is_refused_with_the_list(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--select", "best"])
    assert exit_info.value.code == 2
    assert re.search(r"invalid choice: 'best' \(choose from .*naive.*weighted.*majority", capsys.readouterr().err)
    with pytest.raises(ValueError, match="selection must be one of naive, weighted, majority"):
        EvalSettings(selection="best").check()
