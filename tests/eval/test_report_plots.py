"""Results documents (build, grade, write, read, validate) and the accuracy-vs-N and -vs-compute plots."""

from __future__ import annotations

import json

import pytest

from treeserve.eval.datasets import load_dataset
from treeserve.eval.grading import Grader
from treeserve.eval.metrics import summarize
from treeserve.eval.plots import pareto_front, plot_accuracy_vs_compute, plot_accuracy_vs_n
from treeserve.eval.report import (
    COMPLETION_KEYS,
    PROBLEM_KEYS,
    RunStats,
    build_results,
    grade_problems,
    problems_from_results,
    read_results,
    write_results,
)
from treeserve.search.config import SearchConfig


def graded_builtin_run(preds=None):
    records = load_dataset("arith:level=1,2,size=2,seed=0")
    a0, a1 = records[0]["answer"], records[1]["answer"]
    wrong0 = str(int(a0) + 1)
    completions = [
        [  # weighted: the two right answers (one written as a decimal) outweigh one high-scoring wrong one
            (f"step\n\nThe answer is \\boxed{{{wrong0}}}.", [0.5, 0.9]),
            (f"The answer is \\boxed{{{a0}}}.", [0.6]),
            {"text": f"The answer is \\boxed{{{a0}.0}}.", "step_scores": [0.7]},
            ("I give up.", [0.1]),
        ],
        [(f"\\boxed{{{a1}}}", [0.2, 0.3])],
    ]
    with Grader() as grader:
        problems = grade_problems(records, completions, grader, preds=preds, selection="weighted", agg="last")
    return records, problems


def test_grade_problems_groups_and_selects():
    records, problems = graded_builtin_run()
    first = problems[0]
    assert [c.correct for c in first.completions] == [False, True, True, False]
    assert [c.group for c in first.completions] == [0, 1, 1, None]  # "94" and "94.0" are one answer
    assert first.completions[3].answer is None
    assert first.pred == records[0]["answer"] and first.correct
    assert problems[1].correct and problems[1].level == 2

    _, chosen = graded_builtin_run(preds=["\\boxed{0}", None])  # the strategy's own choice wins
    assert chosen[0].pred == "0" and not chosen[0].correct and not chosen[1].correct


def test_grade_problems_rejects_misaligned_input():
    records = load_dataset("arith:size=2")
    with pytest.raises(ValueError, match="2 records but completions for 1"):
        grade_problems(records, [[]], Grader())
    with pytest.raises(TypeError, match="completion"):
        grade_problems(records[:1], [[42]], Grader())


def results_doc(strategy="best_of_n", n=4):
    _, problems = graded_builtin_run()
    stats = RunStats(
        wall_time_s=2.0, generated_tokens=300, prm_tokens_prefilled=120, prm_unique_tokens=100, prefix_hit_rate=0.5
    )
    return build_results({"strategy": strategy, "n": n, "dataset": "arith"}, problems, stats, agg="last"), problems


def test_build_results_shape_and_summary():
    results, problems = results_doc()
    assert set(results) == {"config", "summary", "problems"}
    summary = results["summary"]
    assert summary["accuracy"] == 1.0 and summary["problems_per_s"] == 1.0
    assert summary["generated_tokens_per_s"] == 150.0 and summary["prm_tokens_prefilled"] == 120
    assert summary["prm_unique_tokens"] == 100 and summary["prefix_hit_rate"] == 0.5
    assert summary["wall_time_s"] == 2.0 and summary["num_problems"] == 2
    assert summary["weighted@n"] == {"1": 0.5, "2": 0.5, "4": 1.0}
    assert summary["naive@n"]["4"] == 0.5 and summary["majority@n"]["4"] == 1.0 and summary["pass@N"] == 1.0
    assert summary["accuracy_by_level"] == {"1": 1.0, "2": 1.0}
    record = results["problems"][0]
    assert tuple(record) == PROBLEM_KEYS and tuple(record["completions"][0]) == (*COMPLETION_KEYS, "group")
    assert record["completions"][0]["score"] == 0.9 and record["completions"][3]["answer"] is None


def test_write_read_round_trip(tmp_path):
    results, _ = results_doc()
    path = write_results(results, tmp_path / "out" / "results.json")
    again = read_results(path)
    assert again == json.loads(json.dumps(results))
    recomputed = summarize(problems_from_results(again), agg="last")
    assert recomputed["accuracy"] == results["summary"]["accuracy"]
    assert recomputed["naive@n"] == results["summary"]["naive@n"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "top level is a list"),
        ('{"config": {}, "summary": {}}', "missing 'problems'"),
        ('{"config": {}, "summary": {"accuracy": 1.0}, "problems": []}', "problems_per_s"),
        (
            '{"config": {}, "summary": {"accuracy": 1, "problems_per_s": 1}, "problems": [{"unique_id": "x"}]}',
            "problems\\[0\\] lacks",
        ),
    ],
)
def test_read_rejects_non_results(tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message) as info:
        read_results(path)
    assert str(path) in str(info.value) and "not a treeserve results file" in str(info.value)
    with pytest.raises(FileNotFoundError):
        read_results(tmp_path / "missing.json")


def test_plot_writes_png(tmp_path):
    with_tables, _ = results_doc("best_of_n", 4)
    paths = [write_results(with_tables, tmp_path / "bon.json")]
    for n, acc in ((4, 0.25), (16, 0.5)):  # beam-search-like runs: accuracy only, one point per file
        doc, _ = results_doc("beam_search", n)
        doc["summary"] = {k: v for k, v in doc["summary"].items() if not k.endswith("@n")} | {"accuracy": acc}
        paths.append(write_results(doc, tmp_path / f"beam{n}.json"))
    out = plot_accuracy_vs_n(paths, tmp_path / "plots" / "acc.png", title="test")
    data = out.read_bytes()
    assert out == tmp_path / "plots" / "acc.png" and data.startswith(b"\x89PNG") and len(data) > 5000
    (tmp_path / "bad.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="not a treeserve results file"):
        plot_accuracy_vs_n([tmp_path / "bad.json"], tmp_path / "bad.png")


def test_pareto_front_membership():
    points = [(100, 0.5), (200, 0.5), (150, 0.6), (400, 0.7), (300, 0.4), (400, 0.65), (50, 0.2), (150, 0.6)]
    # (200, 0.5): (100, 0.5) costs less at the same accuracy; (300, 0.4), (400, 0.65): beaten; a duplicate kept once
    assert pareto_front(points) == [(50, 0.2), (100, 0.5), (150, 0.6), (400, 0.7)]
    assert pareto_front([(10, 0.3)]) == [(10, 0.3)] and pareto_front([]) == []
    assert pareto_front([(10, 0.9), (5, 0.1), (20, 0.95)]) == [(5, 0.1), (10, 0.9), (20, 0.95)]


def compute_doc(n, accuracy, tokens, certainty=None):
    doc, _ = results_doc("beam_search", n)
    doc["config"] = {
        "search": {"strategy": "beam_search", "n": n, "adaptive": certainty is not None, "certainty": certainty or 0.9},
        "dataset": "arith",
    }
    doc["summary"] |= {"accuracy": accuracy, "computed_tokens": tokens}
    return doc


def test_plot_vs_compute_writes_png(tmp_path):
    runs = [
        (4, 0.4, 20_000, None),
        (16, 0.55, 80_000, None),
        (64, 0.6, 320_000, None),
        (16, 0.54, 45_000, 0.8),
        (16, 0.5, 90_000, 0.95),
    ]
    paths = [write_results(compute_doc(*run), tmp_path / f"run{i}.json") for i, run in enumerate(runs)]
    out = plot_accuracy_vs_compute(paths, tmp_path / "plots" / "compute.png")
    data = out.read_bytes()
    assert out == tmp_path / "plots" / "compute.png" and data.startswith(b"\x89PNG") and len(data) > 5000


def test_an_adaptive_point_is_labelled_with_its_first_width_and_budget(tmp_path):
    """Runs from several first widths and budgets lie on one curve (bench/adaptive.py --curve-ns N:W:B):
    each point's label tells them apart."""
    from treeserve.eval.plots import _compute_point

    doc = compute_doc(32, 0.625, 963_952, certainty=0.9)
    doc["config"]["search"] |= {"first_width": 8, "budget_tokens": 3_300_000}
    series, label, tokens, accuracy = _compute_point(tmp_path / "run.json", doc)
    assert series == "beam_search adaptive" and (tokens, accuracy) == (963_952.0, 0.625)
    assert label == "beam_search N=32 adaptive T=0.9 w=8 budget=3300000"
    fixed = _compute_point(tmp_path / "fixed.json", compute_doc(32, 0.6, 1_391_994))
    assert fixed[:2] == ("beam_search fixed", "beam_search N=32")


def test_an_adaptive_point_says_whether_the_run_picked_its_budget(tmp_path):
    """`--adaptive` alone (the budget the run picks at the default fraction) is labelled the default
    and starred; another fraction says which; a run without a budget says so."""
    from treeserve.eval.plots import _compute_point

    doc = compute_doc(16, 0.6, 150_000, certainty=0.9)
    labels = []
    for fraction in (SearchConfig().budget_fraction, 0.5, None):
        doc["config"]["search"]["budget_fraction"] = fraction
        labels.append(_compute_point(tmp_path / "run.json", doc)[1])
    assert labels == [
        f"beam_search N=16 adaptive T=0.9 picked f={SearchConfig().budget_fraction} (default)",
        "beam_search N=16 adaptive T=0.9 picked f=0.5",
        "beam_search N=16 adaptive T=0.9 no budget",
    ]
    doc["config"]["search"]["budget_fraction"] = SearchConfig().budget_fraction
    path = write_results(doc, tmp_path / "default.json")
    out = plot_accuracy_vs_compute([path], tmp_path / "compute.png")
    assert out.read_bytes().startswith(b"\x89PNG")


def test_plot_vs_compute_needs_computed_tokens(tmp_path):
    good = write_results(compute_doc(16, 0.5, 1000), tmp_path / "good.json")
    old = compute_doc(16, 0.5, 1000)
    del old["summary"]["computed_tokens"]
    old_path = write_results(old, tmp_path / "old.json")
    with pytest.raises(ValueError, match="no 'computed_tokens'") as info:
        plot_accuracy_vs_compute([good, old_path], tmp_path / "x.png")
    assert str(old_path) in str(info.value) and not (tmp_path / "x.png").exists()


def test_cli_plot_x_computed_tokens(tmp_path, capsys):
    from treeserve.cli import main

    paths = [str(write_results(compute_doc(n, 0.1 * n, 1000 * n), tmp_path / f"n{n}.json")) for n in (4, 8)]
    png = tmp_path / "c.png"
    assert main(["plot", *paths, "--x", "computed-tokens", "--output", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    old = compute_doc(4, 0.5, 1)
    del old["summary"]["computed_tokens"]
    assert main(["plot", str(write_results(old, tmp_path / "old.json")), "--x", "computed-tokens"]) == 2
    assert "old.json" in capsys.readouterr().err
