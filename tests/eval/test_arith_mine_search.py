"""tools/arith/mine_search.py: beam search's final beams on fresh training problems, judged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.arith.mine_search import excluded_texts, mine
from treeserve.eval.arith_labels import step_labels

ASSETS = Path(__file__).resolve().parents[2] / "treeserve" / "assets"
GENERATOR, PRM = ASSETS / "arith-generator", ASSETS / "arith-prm"

pytestmark = pytest.mark.skipif(not (GENERATOR / "config.json").exists(), reason="shipped models not present")


def test_mined_beams_are_labelled_training_problems_and_rounds_draw_new_ones():
    first = mine(GENERATOR, PRM, seed=0, per_level=1, temperature=0.8, round_=1, n=4)
    assert first, "beam search returned no solution with steps"
    problems = {problem for problem, _, _ in first}
    assert len(problems) <= 2 and not problems & excluded_texts()
    for problem, steps, labels in first:
        assert len(steps) == len(labels) and labels == step_labels(problem, steps)
    texts = ["\n\n".join(steps) for _, steps, _ in first]
    assert len(set(texts)) == len(texts), "final beams are deduplicated per problem"
    second = mine(GENERATOR, PRM, seed=0, per_level=1, temperature=0.8, round_=2, n=4)
    assert not problems & {problem for problem, _, _ in second}
