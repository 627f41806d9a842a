"""`tools.arith.evaluate.first_mistakes`: which of the generator's own mistakes the PRM catches."""

from __future__ import annotations

import pytest

from tools.arith.evaluate import first_mistakes


def test_first_mistakes_counts_only_the_first_wrong_step_against_every_good_step():
    verdicts = [
        ["good", "result", "operation"],  # first mistake: result (the carried-in operation is not counted)
        ["good", "good", "rest"],
        ["rest", "final"],
        ["good", "good"],  # no mistake
    ]
    scores = [[0.9, 0.1, 0.95], [0.8, 0.7, 0.75], [0.2, 0.99], [0.6, 0.5]]
    out = first_mistakes(scores, verdicts)
    assert set(out) == {"result", "rest"}
    assert out["result"] == {"share": pytest.approx(1 / 3), "solutions": 1, "auc": 1.0}  # 0.1 below every good step
    # rest: 0.75 and 0.2 against the good steps 0.9, 0.8, 0.7, 0.6, 0.5 -> (2 + 5) / 10 pairs ranked right
    assert out["rest"]["solutions"] == 2 and out["rest"]["share"] == pytest.approx(2 / 3)
    assert out["rest"]["auc"] == pytest.approx(0.7)
