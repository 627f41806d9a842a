"""tools/arith/copy_drills.py: miscopied steps beside right ones, judged by the step judge."""

from __future__ import annotations

import random
import re

import pytest

from tools.arith.copy_drills import copy_drill_pair, held_out_pairs, main, miscopied_steps
from tools.arith.data import held_out_texts, problem_stream
from treeserve.eval.arith_labels import step_verdicts


def test_pairs_differ_only_in_a_miscopied_last_step():
    rng = random.Random(0)
    stream = problem_stream(random.Random(1), 5, held_out_texts())
    kinds = set()
    for _ in range(60):
        problem = next(stream)
        pair = copy_drill_pair(rng, problem)
        if not pair:
            continue
        (_, bad, bad_labels), (_, right, right_labels) = pair
        assert len(bad) == len(right) and bad[:-1] == right[:-1] and bad[-1] != right[-1]
        assert right_labels == [True] * len(right) and bad_labels == [True] * (len(bad) - 1) + [False]
        verdict = step_verdicts(problem.text, bad)[-1]
        assert verdict in ("operation", "rest"), (bad[-1], verdict)
        kinds.add(verdict)
    assert kinds == {"operation", "rest"}


def test_a_miscopy_continues_consistently_and_stays_in_the_world():
    rng = random.Random(3)
    stream = problem_stream(random.Random(4), 4, held_out_texts())
    for _ in range(40):
        problem = next(stream)
        k = rng.randrange(len(problem.steps) - 1)
        steps = miscopied_steps(rng, problem, k)
        if steps is None:
            continue
        assert steps[:k] == problem.steps[:k]
        verdicts = step_verdicts(problem.text, steps)
        assert verdicts[k] in ("operation", "rest")
        assert all(int(c) >= 0 for c in re.findall(r"= (-?\d+)", "".join(steps)))  # no negative results


def test_held_out_pairs_are_fixed_and_never_test_problems():
    pairs = held_out_pairs(per_level=5)
    assert pairs == held_out_pairs(per_level=5)
    assert not {problem for problem, _, _ in pairs} & held_out_texts()


def test_the_cli_refuses_a_directory_without_a_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["copy_drills", "--prm", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_the_cli_refuses_a_copy_stage_without_new_layers(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(
        "sys.argv", ["copy_drills", "--prm", str(tmp_path), "--teach", str(tmp_path / "out"), "--extra-layers", "0"]
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert "--extra-layers" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
