"""The fact-table stage's training targets (tools/arith/facts.py): where they sit and what they say."""

from __future__ import annotations

import random
import re

import torch

from tools.arith.common import BAD_ID, GOOD_ID, VOCAB
from tools.arith.data import held_out_texts
from tools.arith.drills import fact_table
from tools.arith.facts import FACTS_PER_ROW, check_row, fact_check_targets, fact_row, result_targets, row_problem
from tools.arith.prm_io import prm_input
from treeserve.eval.arith import apply_op, evaluate, problem_expression

TOKENS = {i: t for t, i in VOCAB.items()}
STEPS = ["5 + 7 = 13, leaving 13 * 3.", "13 * 3 = 39.", "The answer is \\boxed{39}."]


def marked(ids: list[int], targets: list[int]) -> list[tuple[str, str]]:
    """(token at the position, target token) wherever there is a target."""
    return [(TOKENS[ids[i]], TOKENS[t]) for i, t in enumerate(targets) if t >= 0]


def test_fact_check_marks_each_result_right_or_wrong():
    ids, tags = prm_input("Compute (5 + 7) * 3.", STEPS)
    assert marked(ids, fact_check_targets(ids, tags)) == [("13", "-"), ("39", "+")]


def test_result_targets_predict_the_result_of_good_steps_only():
    ids, tags = prm_input("Compute (5 + 7) * 3.", STEPS)
    assert marked(ids, result_targets(ids, tags, [True, True, True])) == [(" ", "13"), (" ", "39")]
    assert marked(ids, result_targets(ids, tags, [False, True, True])) == [(" ", "39")]


def test_fact_rows_target_the_true_result_of_every_fact():
    facts = fact_table()[100 : 100 + FACTS_PER_ROW]
    ids, targets = fact_row(random.Random(0), facts)
    expected = [str(apply_op(op, a, b)) for a, op, b in facts]
    assert [t for _, t in marked(ids, targets)] == expected
    assert GOOD_ID not in targets and BAD_ID not in targets


def test_rows_sit_under_the_fact_alone_a_chain_starting_with_it_or_an_unrelated_problem():
    a, op, b = fact = (17, "+", 5)
    rng = random.Random(0)
    problems = [row_problem(rng, fact) for _ in range(300)]
    alone = [p for p in problems if p == f"Compute {a} {op} {b}."]
    chained = [p for p in problems if re.match(r"Compute \(+" + re.escape(f"{a} {op} {b})"), p)]
    for kind in (alone, chained):
        assert 0.2 < len(kind) / len(problems) < 0.47
    assert not set(problems) & held_out_texts()
    for text in problems:  # every one is a well-formed problem
        evaluate(problem_expression(text))


def test_check_rows_judge_each_written_result_and_target_the_true_one():
    facts = fact_table()[: FACTS_PER_ROW * 20]
    judged = []
    for i in range(0, len(facts), FACTS_PER_ROW):
        chunk = facts[i : i + FACTS_PER_ROW]
        ids, targets = check_row(random.Random(i), chunk)
        pairs = marked(ids, targets)
        assert len(pairs) == 2 * len(chunk)
        for (a, op, b), (_, truth), (written, verdict) in zip(chunk, pairs[0::2], pairs[1::2], strict=True):
            assert truth == str(apply_op(op, a, b))
            assert verdict == ("+" if written == truth else "-")
            judged.append(verdict)
    assert 0.3 < judged.count("-") / len(judged) < 0.7


def tiny_model(tmp_path):
    from transformers import LlamaForCausalLM

    from tools.arith.common import model_config, save_checkpoint

    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config(hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64))
    save_checkpoint(model, tmp_path / "init")
    return model


def test_a_stage_trains_only_its_new_layers_and_stops_at_its_target(tmp_path):
    from tools.arith.common import load_model, read_json, write_json
    from tools.arith.facts import build, curriculum, teach

    base = tiny_model(tmp_path)
    summary = build(
        "check",
        0,
        tmp_path / "init",
        tmp_path / "check",
        steps=2,
        rows_per_batch=2,
        lr=1e-2,
        warmup=1,
        target=1.0,
        extra_layers=1,
    )
    assert summary["steps"] == 2 and summary["extra_layers"] == 1
    assert list(curriculum(tmp_path / "check")) == ["check"] and curriculum(tmp_path / "init") == {}
    # a chain of stage directories moved elsewhere together still reads back
    import shutil

    (tmp_path / "moved").mkdir()
    shutil.copytree(tmp_path / "check", tmp_path / "moved" / "route")
    route = read_json(tmp_path / "moved" / "route" / "stage.json") | {"stage": "route", "init": str(tmp_path / "check")}
    write_json(tmp_path / "moved" / "route" / "stage.json", route)
    shutil.move(tmp_path / "check", tmp_path / "moved" / "check")
    assert list(curriculum(tmp_path / "moved" / "route")) == ["check", "route"]
    checked = load_model(tmp_path / "moved" / "check")
    assert checked.config.num_hidden_layers == 2
    before, after = base.state_dict(), checked.state_dict()
    # bf16 on disk: the frozen base is exactly what was saved, the new layer has learned
    for name, value in before.items():
        assert torch.equal(value.to(torch.bfloat16).float(), after[name]), name
    new_layer = checked.model.layers[1]
    assert new_layer.self_attn.o_proj.weight.abs().sum() > 0 and new_layer.mlp.down_proj.weight.abs().sum() > 0

    for stage in ("check", "route"):
        stopped = teach(
            checked.train(), stage, 0, steps=10, rows_per_batch=2, lr=1e-3, warmup=1, target=0.0, log_every=2
        )
        assert stopped["steps"] == 2 and stopped["max_steps"] == 10


def test_drill_rows_judge_the_step_at_its_tag():
    from tools.arith.common import STEP_TAG_ID
    from tools.arith.facts import drill_row, result_positions

    rng = random.Random(0)
    verdicts = []
    for a, op, b in fact_table()[:300]:
        ids, targets = drill_row(rng, [(a, op, b)])
        tags = [i for i, t in enumerate(targets) if t >= 0]
        assert tags and all(ids[i] == STEP_TAG_ID for i in tags)
        written = TOKENS[ids[result_positions(ids, tags)[0] + 1]]
        verdict = targets[tags[0]]
        # a wrong result is always judged '-'; '+' needs the right result (and a right carried value)
        assert verdict == BAD_ID or written == str(apply_op(op, a, b))
        assert written == str(apply_op(op, a, b)) or verdict == BAD_ID
        verdicts.append(verdict)
    assert 0.3 < verdicts.count(BAD_ID) / len(verdicts) < 0.7
