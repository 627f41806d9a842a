"""The built-in arithmetic world: dataset, grading, step labels and the shipped checkpoints.

Checkpoints are checked with `safetensors` headers, `tokenizers` and `jinja2` only (no torch,
no transformers); running them through the engine is tested with the engine.
"""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from treeserve.eval.arith import (
    LEVELS,
    BinOp,
    arith_dataset,
    evaluate,
    extract_boxed,
    grade,
    make_problem,
    parse,
    problem_expression,
    render,
    solve,
)
from treeserve.eval.arith_labels import corrupt_value, split_steps, step_labels, step_verdicts

ASSETS = Path(__file__).resolve().parents[2] / "treeserve" / "assets"
CHECKPOINTS = [ASSETS / "arith-generator", ASSETS / "arith-prm"]
shipped = pytest.mark.skipif(
    not all((c / "config.json").is_file() for c in CHECKPOINTS), reason="the trained checkpoints are not shipped yet"
)


@pytest.fixture(scope="module")
def split() -> list[dict]:
    return arith_dataset(500, seed=0)


def test_dataset_is_deterministic_and_seeded(split: list[dict]) -> None:
    assert split == arith_dataset(500, seed=0)
    other = arith_dataset(500, seed=1)
    assert [r["problem"] for r in other] != [r["problem"] for r in split]
    assert arith_dataset(10, seed=3, levels=(2, 4)) == arith_dataset(10, seed=3, levels=(2, 4))


def test_dataset_has_math500_shape(split: list[dict]) -> None:
    assert len(split) == 500
    assert {lv: sum(r["level"] == lv for r in split) for lv in LEVELS} == {lv: 100 for lv in LEVELS}
    assert len({r["problem"] for r in split}) == 500
    assert len({r["unique_id"] for r in split}) == 500
    for r in split:
        assert set(r) == {"problem", "solution", "answer", "level", "subject", "unique_id"}
        assert r["subject"] == "arithmetic"
        assert r["unique_id"].startswith(f"arith/L{r['level']}/")
        assert isinstance(r["answer"], str) and r["problem"].startswith("Compute ")
    assert split[0]["unique_id"] == "arith/L1/0000"


def test_levels_follow_their_spec() -> None:
    rng = random.Random(7)
    for level, spec in LEVELS.items():
        for _ in range(200):
            problem = make_problem(rng, level)
            text = render(problem.expr)
            assert text.count(" ") // 2 == spec.n_ops  # one operator per two spaces
            assert parse(text) == problem.expr
            assert text.count("(") == text.count(")") == spec.n_ops - 1  # fully parenthesised
            assert 0 <= problem.answer <= spec.max_value
    with pytest.raises(ValueError):
        make_problem(rng, 6)


def test_reference_solutions_format_and_grade(split: list[dict]) -> None:
    for r in split:
        steps = r["solution"].split("\n\n")
        assert len(steps) == r["level"] + 1  # one operation per step, then the answer
        assert steps[-1] == f"The answer is \\boxed{{{r['answer']}}}."
        assert extract_boxed(r["solution"]) == r["answer"]
        assert grade(r["solution"], r["answer"])
        assert grade(r["answer"], int(r["answer"]))
        assert int(r["answer"]) == evaluate(problem_expression(r["problem"]))


def test_grading_rejects_corrupted_solutions(split: list[dict]) -> None:
    rng = random.Random(0)
    for r in split:
        wrong = corrupt_value(rng, int(r["answer"]))
        assert wrong != int(r["answer"])
        corrupted = r["solution"].replace(f"\\boxed{{{r['answer']}}}", f"\\boxed{{{wrong}}}")
        assert not grade(corrupted, r["answer"])
        assert not grade(r["solution"].replace("\\boxed", "boxed"), r["answer"])  # no boxed answer


def test_extract_boxed_and_grade_edge_cases() -> None:
    assert extract_boxed("so \\boxed{1} then \\boxed{ 42 }.") == "42"
    assert extract_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{12") is None
    assert extract_boxed("no answer") is None
    assert grade("The answer is \\boxed{1,234}.", 1234)
    assert grade("\\boxed{42.0}", "42")
    assert grade(42, "42") and not grade(41, "42")
    assert not grade("The answer is \\boxed{forty-two}.", "42")
    assert not grade("", "42")


def test_step_labels_accept_reference_and_equivalent_steps(split: list[dict]) -> None:
    for r in split:
        steps = split_steps(r["solution"])
        assert step_labels(r["problem"], steps) == [True] * len(steps)
    # Any ready operation may go first, and + / * may swap their operands.
    steps = ["3 * 4 = 12, leaving (1 + 2) * 12.", "2 + 1 = 3, leaving 3 * 12.", "3 * 12 = 36."]
    steps.append("The answer is \\boxed{36}.")
    assert step_labels("Compute (1 + 2) * (3 * 4).", steps) == [True] * 4


def test_step_labels_flag_injected_wrong_step() -> None:
    problem = "Compute (12 + 7) * 3 - 15."
    expr = problem_expression(problem)
    calls = []

    def slip_first(node: BinOp, value: int) -> int:
        calls.append(node)
        return value + 1 if len(calls) == 1 else value

    steps = solve(expr, slip_first)
    assert steps[0] == "12 + 7 = 20, leaving (20 * 3) - 15."
    # The slip is bad, and so is everything that uses its wrong result.
    assert step_labels(problem, steps) == [False, False, False, False]
    # A slip in the last operation leaves the earlier steps good.
    steps = ["12 + 7 = 19, leaving 19 * 3 - 15.", "19 * 3 = 57, leaving 57 - 15.", "57 - 15 = 43."]
    steps.append("The answer is \\boxed{43}.")
    assert step_labels(problem, steps) == [True, True, False, False]
    # Wrong order of operations, a miscopied rest, an unparseable step, a wrong final answer.
    assert step_labels("Compute 3 + 4 * 5.", ["3 + 4 = 7, leaving 7 * 5."]) == [False]
    assert step_labels(problem, ["12 + 7 = 19, leaving 19 * 3 - 16."]) == [False]
    assert step_labels(problem, ["12 plus 7 is 19"]) == [False]
    assert step_labels(problem, ["The answer is \\boxed{41}."]) == [False]
    assert step_labels(problem, ["The answer is \\boxed{42}."]) == [True]


def test_step_verdicts_name_the_mistake() -> None:
    problem = "Compute (12 + 7) * 3 - 15."
    assert step_verdicts("Compute 3 + 4 * 5.", ["3 + 4 = 7, leaving 7 * 5."]) == ["operation"]
    assert step_verdicts(problem, ["13 + 7 = 20, leaving (20 * 3) - 15."]) == ["operation"]
    assert step_verdicts(problem, ["12 + 7 = 20, leaving (20 * 3) - 15."]) == ["result"]
    assert step_verdicts(problem, ["12 + 7 = 19, leaving 19 * 3 - 16."]) == ["rest"]
    assert step_verdicts(problem, ["12 plus 7 is 19"]) == ["format"]
    # A carried wrong value makes the next operation one the true state does not have.
    steps = ["12 + 7 = 20, leaving 20 * 3 - 15.", "20 * 3 = 60, leaving 60 - 15.", "The answer is \\boxed{45}."]
    assert step_verdicts(problem, steps) == ["result", "operation", "final"]
    assert step_verdicts(problem, ["12 + 7 = 19, leaving 19 * 3 - 15."]) == ["good"]


def _safetensors_header(path: Path) -> dict:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


@shipped
@pytest.mark.parametrize("ckpt", CHECKPOINTS, ids=lambda p: p.name)
def test_checkpoint_files_and_weights(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    weights = ckpt / "model.safetensors"
    assert weights.stat().st_size < 16 * 2**20
    header = _safetensors_header(weights)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    assert header["model.embed_tokens.weight"]["shape"] == [vocab, hidden]
    assert config["tie_word_embeddings"] and "lm_head.weight" not in header
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        assert header[layer + "self_attn.q_proj.weight"]["shape"] == [config["num_attention_heads"] * head_dim, hidden]
        assert header[layer + "self_attn.k_proj.weight"]["shape"] == [config["num_key_value_heads"] * head_dim, hidden]
        assert header[layer + "mlp.down_proj.weight"]["shape"] == [hidden, config["intermediate_size"]]
    assert {t["dtype"] for t in header.values()} <= {"BF16", "F32"}
    n_params = sum(int.__mul__(*t["shape"]) if len(t["shape"]) == 2 else t["shape"][0] for t in header.values())
    assert 1_000_000 < n_params < 10_000_000
    assert (ckpt / "README.md").read_text().strip()


@shipped
@pytest.mark.parametrize("ckpt", CHECKPOINTS, ids=lambda p: p.name)
def test_checkpoint_tokenizer_and_chat_template(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.token_to_id(tok_config["eos_token"]) == config["eos_token_id"]
    assert tokenizer.token_to_id(tok_config["bos_token"]) == config["bos_token_id"]
    for number in ("0", "7", "42", "007", "999"):
        assert tokenizer.encode(number).tokens == [number]  # numbers of up to 3 digits are one token
    assert tokenizer.encode("1234").tokens == ["123", "4"]
    text = "12 + 7 = 19, leaving 19 * 3 - 15.\n\nThe answer is \\boxed{42}."
    encoding = tokenizer.encode(text)
    assert encoding.tokens == re.findall(r"\d{1,3}|[\s\S]", text)  # other characters one token each
    assert tokenizer.decode(encoding.ids) == text

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    template = env.from_string(tok_config["chat_template"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compute 1 + 2."}]
    prompt = template.render(messages=messages, add_generation_prompt=True, bos_token=tok_config["bos_token"])
    assert prompt == "<|bos|><|user|>Compute 1 + 2.<|end|><|assistant|>"
    ids = tokenizer.encode(prompt).ids
    assert ids[0] == config["bos_token_id"] and ids[-1] == tokenizer.token_to_id("<|assistant|>")
    full = template.render(
        messages=messages[1:] + [{"role": "assistant", "content": "1 + 2 = 3."}],
        add_generation_prompt=False,
        bos_token=tok_config["bos_token"],
    )
    assert full == "<|bos|><|user|>Compute 1 + 2.<|end|><|assistant|>1 + 2 = 3.<|end|>"


@shipped
def test_prm_config_names_single_tokens() -> None:
    ckpt = ASSETS / "arith-prm"
    prm = json.loads((ckpt / "prm_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert prm["style"] == "step_tag" and prm["step_separator"] == "\n\n"
    for key in ("step_tag", "good_token", "bad_token"):
        assert tokenizer.encode(prm[key]).ids == [prm[key + "_id"]]
    problem, steps = "Compute 1 + 2.", ["1 + 2 = 3.", "The answer is \\boxed{3}."]
    text = prm["prompt_format"].format(problem=problem) + prm["step_separator"].join(
        prm["step_format"].format(step=s) for s in steps
    )
    ids = tokenizer.encode(text).ids
    assert ids.count(prm["step_tag_id"]) == 2 and ids[-1] == prm["step_tag_id"]
