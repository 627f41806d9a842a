"""Constrained steps (`step_regex`, `answer_regex`; issue 36) on the step world of `step_world.py`.

Every strategy (fp32) runs with a step regex and an answer regex, optimised and reference:
both select the same beams, and every step of every returned completion fullmatches the
step regex, except a final step, which fullmatches the answer regex. Lookahead rollouts
obey the same constraint. A bad regex, `fixed_steps` or `decode_ahead` with a
constraint fail when the `SearchConfig` is built, and in the CLI before any model loads.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

import pytest

from tests.search.step_world import build_step_world
from tests.search.test_lookahead import first_beams, run, search_context
from treeserve.cli import main
from treeserve.search.config import SearchConfig

# bounded, so no step reaches max_tokens (each character is at least one token)
STEP = r"[abc0-9]{1,5}"
ANSWER = r"=[0-9]{1,3}"
CONSTRAINED = {"step_regex": STEP, "answer_regex": ANSWER}
CONFIGS = {
    "beam_search": SearchConfig(strategy="beam_search", n=4, beam_width=2, num_iterations=5, max_tokens=24),
    "beam_lookahead_final_to_eos": SearchConfig(
        strategy="beam_search", n=4, beam_width=2, num_iterations=4, max_tokens=200, lookahead=1, final_to_eos=True
    ),
    "dvts_lookahead": SearchConfig(strategy="dvts", n=4, beam_width=2, num_iterations=10, max_tokens=24, lookahead=1),
    "best_of_n": SearchConfig(strategy="best_of_n", n=4, max_tokens=200),
    "majority": SearchConfig(strategy="majority", n=4, max_tokens=200),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_step_world(str(tmp_path_factory.mktemp("constrained_world")))


def signature(doc: dict) -> list:
    return [
        (p["unique_id"], p["pred"], [(c["text"], [round(s, 5) for s in c["step_scores"]]) for c in p["completions"]])
        for p in doc["problems"]
    ]


def well_formed(steps: list[str], step: str = STEP, answer: str = ANSWER) -> bool:
    """Every step matches `step`; the last may instead be the final answer."""
    *middle, last = steps
    return all(re.fullmatch(step, s) for s in middle) and bool(re.fullmatch(step, last) or re.fullmatch(answer, last))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_constrained_steps_are_well_formed_and_search_equals_reference(world, name):
    config = replace(CONFIGS[name], **CONSTRAINED)
    fast = run(world, config)
    assert signature(fast) == signature(run(world, config, reference=True))
    completions = [c for p in fast["problems"] for c in p["completions"]]
    assert completions and all(well_formed(c["text"].split("\n\n")) for c in completions)
    finals = [c["text"].split("\n\n")[-1] for c in completions]
    assert any(re.fullmatch(ANSWER, s) for s in finals)  # some solutions end with an answer
    if config.strategy in ("best_of_n", "majority"):  # a whole solution ends with EOS: its last step is the answer
        assert all(re.fullmatch(ANSWER, s) for s in finals)
    if config.strategy in ("beam_search", "dvts"):
        assert max(len(c["step_scores"]) for c in completions) >= 2  # several iterations really ran
    unconstrained = run(world, CONFIGS[name])
    assert not all(well_formed(c["text"].split("\n\n")) for p in unconstrained["problems"] for c in p["completions"])


def test_step_regex_alone_leaves_the_final_step_free(world):
    config = replace(CONFIGS["beam_search"], step_regex=STEP)
    completions = [c for p in run(world, config)["problems"] for c in p["completions"]]
    assert all(well_formed(c["text"].split("\n\n"), STEP, r"(?s:.)*") for c in completions)
    assert not all(well_formed(c["text"].split("\n\n")) for c in completions)  # some final steps are free


@pytest.mark.parametrize(
    ("fields", "whole", "accepted", "refused"),
    [
        (CONSTRAINED, False, ["ab\n\n", "=12"], ["ab", "=12\n\n", "zz\n\n", "ab\n\nab\n\n"]),
        (CONSTRAINED, True, ["=1", "ab\n\n1\n\n=12"], ["ab\n\n", "ab\n\nzz\n\n=1"]),
        ({"step_regex": STEP}, False, ["ab\n\n", "zz", "z\nz\n", ""], ["zz\n\n", "ab\n\nzz", "a\n\n\n"]),
        ({"answer_regex": ANSWER}, False, ["any text\n\n", "=12", "a\nb\n\n"], ["any text", "a\n\nb\n\n", "\n\n"]),
        ({"answer_regex": ANSWER}, True, ["x\n\ny z\n\n=1"], ["x\n\ny z", "x\n\n\n\n=1"]),
    ],
    ids=["step", "whole", "step-only", "answer-only", "answer-only-whole"],
)
def test_constraint_construction(fields, whole, accepted, refused):
    """The combined regex (plain syntax, so Python's `re` reads it the same way): a step ends
    at the separator and matches STEP, or is the final ANSWER; a part not given is any text
    without a blank line."""
    regex = SearchConfig(**fields).constraint(whole).regex
    assert [t for t in accepted if not re.fullmatch(regex, t)] == []
    assert [t for t in refused if re.fullmatch(regex, t)] == []


def test_rollout_steps_obey_the_constraint(world):
    ctx = search_context(world, replace(CONFIGS["beam_search"], lookahead=3, **CONSTRAINED))
    runtime = ctx.runtime

    async def go() -> None:
        problem, beams = await first_beams(ctx)
        rolled = 0
        for beam in beams:
            rollout = await ctx.rollout(problem, beam)
            assert well_formed(beam.steps)
            if rollout:
                assert well_formed(rollout)
                rolled += 1
        assert rolled > 0
        await runtime.close()

    asyncio.run(go())
    runtime.check_pages_idle()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"step_regex": "("}, "(?s)step_regex '\\(' is not a valid regex: .*unclosed group"),
        ({"answer_regex": "a)|(b"}, "answer_regex .* is not a valid regex"),  # valid only inside the combination
        ({"step_regex": ""}, "step_regex must be a non-empty regex"),
        ({"answer_regex": "x", "fixed_steps": True}, "fixed_steps .* cannot take step_regex"),
        ({"step_regex": "x", "decode_ahead": 1}, "decode_ahead .* use decode_ahead=0"),
    ],
)
def test_bad_constraints_fail_at_config(fields, message):
    with pytest.raises(ValueError, match=message):
        SearchConfig(strategy="beam_search", n=4, beam_width=2, **fields)


def test_reference_keeps_the_constraint():
    config = SearchConfig(strategy="beam_search", n=4, beam_width=2, **CONSTRAINED)
    assert config.reference().constraint(whole=False) == config.constraint(whole=False)
    assert SearchConfig().constraint(whole=False) is None


@pytest.mark.parametrize("command", ["solve", "eval"])
def test_cli_refuses_a_bad_regex_before_loading(command, capsys, tmp_path):
    target = ["q"] if command == "solve" else ["--dataset", "arith:size=2", "--output", str(tmp_path / "o.json")]
    argv = [command, *target, "--generator", str(tmp_path / "missing"), "--answer-regex", "\\boxed{"]
    assert main(argv) == 2  # the regex fails first: the missing model is never looked at
    assert "answer_regex" in capsys.readouterr().err
