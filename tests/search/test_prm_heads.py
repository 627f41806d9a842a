"""PRM and verifier heads written by transformers itself: TRL token-classification PRMs and
outcome reward models (sequence classification, Qwen2ForRewardModel). Scores equal a
transformers reference (fp32), `architectures` picks the style, and beam search, best-of-N
and a verifier run end to end with every page back after."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from itertools import chain

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.search.prm_fixtures import build_qwen_reward_model, build_sequence_classification, build_token_classification
from tests.search.test_prm_adapters import QUESTION, STEPS, TOL, qwen2_hidden_states, serve
from treeserve.config import DeviceConfig
from treeserve.eval.runner import DEFAULT_GENERATOR
from treeserve.runtime.runtime import ModelSpec, Runtime
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import OutcomeRM, TokenClassificationPRM, load_prm
from treeserve.search.run import search_problems
from treeserve.search.types import STEP_STOP

ARITH_QUESTION = "Compute 3 * (25 - 7) + 40."


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("heads")
    dirs = {
        "tc_qwen2": build_token_classification(str(base / "tc_qwen2"), "qwen2", bias=True),
        "tc_llama": build_token_classification(str(base / "tc_llama"), "llama", bias=False),
        "orm_llama": build_sequence_classification(str(base / "orm_llama")),
        "orm_qwen2": build_qwen_reward_model(str(base / "orm_qwen2")),
    }
    # the same Llama PRM trained with "\n\n" (HuggingFaceH4's PRM-0.2 recipe): said in prm_config.json
    dirs["tc_llama_nn"] = str(base / "tc_llama_nn")
    shutil.copytree(dirs["tc_llama"], dirs["tc_llama_nn"])
    with open(os.path.join(dirs["tc_llama_nn"], "prm_config.json"), "w") as f:
        json.dump({"style": "token_classification", "step_separator": "\n\n"}, f)
    return dirs


# ---- references -------------------------------------------------------------------------------
def trl_reference(model_dir: str, question: str, steps: list[str], separator: str) -> tuple[list[int], list[float]]:
    """TRL's PRMTrainer.tokenize_row (trl/trainer/prm_trainer.py) for the input and its label
    positions, then P(label 1) from the transformers model at them."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tok(question, add_special_tokens=False)["input_ids"]
    separator_ids = tok.encode(separator, add_special_tokens=False)
    completions = [tok(s, add_special_tokens=False)["input_ids"] + separator_ids for s in steps]
    labels = list(chain(*([-100] * (len(c) - 1) + [1] for c in completions)))
    if tok.bos_token_id is not None:
        prompt_ids = [tok.bos_token_id] + prompt_ids
    ids = prompt_ids + list(chain(*completions))
    labels = [-100] * len(prompt_ids) + labels
    model = transformers.AutoModelForTokenClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        probs = model(torch.tensor([ids])).logits[0].softmax(-1)[:, 1]
    return ids, probs[torch.tensor(labels) != -100].tolist()


def orm_reference(model_dir: str, question: str, steps: list[str]) -> float:
    """The model cards' recipe: the closed chat rendered by transformers, tokenized without
    special tokens, the head at the last token (Skywork-Reward-V2: `logits[0][0]` of the
    sequence-classification model; Qwen2.5-Math-RM: its score.0/ReLU/score.2 head)."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": STEP_STOP.join(steps)}]
    ids = tok.encode(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
    with open(os.path.join(model_dir, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    if architecture == "LlamaForSequenceClassification":
        model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            return model.eval()(torch.tensor([ids])).logits[0][0].item()
    head = load_file(os.path.join(model_dir, "model.safetensors"))
    h = torch.relu(qwen2_hidden_states(model_dir, ids)[-1] @ head["score.0.weight"].T + head["score.0.bias"])
    return (h @ head["score.2.weight"].T + head["score.2.bias"])[0].item()


# ---- parity -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "separator"), [("tc_qwen2", "\n"), ("tc_llama", "\n"), ("tc_llama_nn", "\n\n")])
def test_token_classification_matches_trl_and_transformers(head_dirs, name, separator):
    ref_ids, ref_scores = trl_reference(head_dirs[name], QUESTION, STEPS, separator)

    async def body(runtime: Runtime) -> tuple[list[int], list[float]]:
        prm = load_prm(runtime, name)  # detected from architectures / prm_config.json
        assert type(prm) is TokenClassificationPRM and prm.separator == separator
        return prm.build(QUESTION, STEPS)[0], await prm.score(QUESTION, STEPS)

    ids, scores = serve({name: head_dirs[name]}, body)
    assert ids == ref_ids
    assert len(scores) == len(ref_scores) == len(STEPS)
    assert max(abs(a - b) for a, b in zip(scores, ref_scores, strict=True)) <= TOL
    assert max(ref_scores) - min(ref_scores) > 1e-3  # distinct scores: the test can fail


@pytest.mark.parametrize("name", ["orm_llama", "orm_qwen2"])
def test_orm_matches_transformers_with_the_prefix_rule(head_dirs, name):
    ref_rewards = [orm_reference(head_dirs[name], QUESTION, STEPS[: i + 1]) for i in range(len(STEPS))]

    async def body(runtime: Runtime) -> tuple[float, list[float], list[float]]:
        orm = load_prm(runtime, name)
        assert type(orm) is OutcomeRM and orm.outcome
        return await orm.reward(QUESTION, STEPS), await orm.score(QUESTION, STEPS), await orm.score(QUESTION, STEPS, 2)

    reward, scores, tail = serve({name: head_dirs[name]}, body)
    assert abs(reward - ref_rewards[-1]) <= TOL
    expected = torch.sigmoid(torch.tensor(ref_rewards)).tolist()  # step i: the ORM on steps 0..i
    assert max(abs(a - b) for a, b in zip(scores, expected, strict=True)) <= TOL
    assert max(abs(a - b) for a, b in zip(tail, expected[2:], strict=True)) <= TOL
    assert max(ref_rewards) - min(ref_rewards) > 1e-3


def test_styles_detected_and_overridden(head_dirs):
    async def body(runtime: Runtime) -> None:
        assert isinstance(load_prm(runtime, "tc_qwen2"), TokenClassificationPRM)  # ...ForTokenClassification
        assert isinstance(load_prm(runtime, "orm_llama"), OutcomeRM)  # ...ForSequenceClassification
        assert isinstance(load_prm(runtime, "orm_qwen2"), OutcomeRM)  # ...ForRewardModel
        with pytest.raises(ValueError, match="one output"):  # a 2-label head is no outcome RM
            load_prm(runtime, "tc_qwen2", "orm")
        with pytest.raises(ValueError, match="2 labels"):
            load_prm(runtime, "orm_llama", "token_classification")
        with pytest.raises(ValueError, match="reward head tensors"):
            load_prm(runtime, "tc_qwen2", "reward_head")

    serve({k: head_dirs[k] for k in ("tc_qwen2", "orm_llama", "orm_qwen2")}, body)


def test_token_classification_inputs_are_prefix_stable(head_dirs):
    async def body(runtime: Runtime) -> None:
        prm = load_prm(runtime, "tc_qwen2")
        full_ids, full_positions = prm.build(QUESTION, STEPS)
        for k in range(1, len(STEPS)):
            ids, positions = prm.build(QUESTION, STEPS[:k])
            assert full_ids[: len(ids)] == ids and full_positions[:k] == positions
        hits = runtime.engine("tc_qwen2").pages.stats.hits
        full = await prm.score(QUESTION, STEPS)
        tail = await prm.score(QUESTION, STEPS + ["Done."], start=len(STEPS))
        assert runtime.engine("tc_qwen2").pages.stats.hits > hits
        again = await prm.score(QUESTION, STEPS + ["Done."])
        assert max(abs(a - b) for a, b in zip(full + tail, again, strict=True)) <= TOL

    serve({"tc_qwen2": head_dirs["tc_qwen2"]}, body)


# ---- end to end ---------------------------------------------------------------------------------
def search(dirs: dict[str, str], config: SearchConfig, verifier: str | None = None):
    """`search_problems` over one question with the shipped generator and the PRM `dirs["prm"]`
    (and a verifier); afterwards every page is free or cached."""
    specs = [ModelSpec("generator", DEFAULT_GENERATOR, 0.5)]
    specs += [ModelSpec(name, path, 0.5 / len(dirs)) for name, path in dirs.items()]
    runtime = Runtime.load(specs, kv_cache_memory=48 << 20, device_config=DeviceConfig(dtype="float32"))

    async def main():
        try:
            ctx = SearchContext(
                config,
                runtime,
                "generator",
                load_prm(runtime, "prm"),
                verifier=load_prm(runtime, verifier) if verifier else None,
            )
            results = await search_problems(ctx, [("q", ARITH_QUESTION)])
            return ctx, results[0]
        finally:
            await runtime.close()

    out = asyncio.run(main())
    runtime.check_pages_idle()
    return out


def test_beam_search_with_a_token_classification_prm(head_dirs):
    config = SearchConfig(n=4, beam_width=2, num_iterations=3, max_tokens=48, seed=3, trace=True)
    ctx, result = search({"prm": head_dirs["tc_qwen2"]}, config)
    assert result.beams and ctx.prm_requests > 0 and ctx.prm_too_long == 0
    for beam in result.beams:
        assert len(beam.scores) == len(beam.steps) and all(0.0 < s < 1.0 for s in beam.scores)
    assert any(node[7] == "kept" for node in result.trace["nodes"])


def test_best_of_n_selects_by_the_orm(head_dirs):
    """An ORM as the PRM with agg last: each completion's score is the ORM's on the whole of it."""
    config = SearchConfig(strategy="weighted_best_of_n", n=4, max_tokens=48, seed=1, agg="last")
    ctx, result = search({"prm": head_dirs["orm_llama"]}, config)
    assert len(result.beams) == 4
    tok = transformers.AutoTokenizer.from_pretrained(head_dirs["orm_llama"])
    model = transformers.AutoModelForSequenceClassification.from_pretrained(head_dirs["orm_llama"], dtype=torch.float32)
    for beam in result.beams:
        chat = [{"role": "user", "content": ARITH_QUESTION}, {"role": "assistant", "content": beam.text}]
        ids = tok.encode(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)
        with torch.no_grad():
            reward = model.eval()(torch.tensor([ids])).logits[0][0]
        assert abs(beam.scores[-1] - torch.sigmoid(reward).item()) <= TOL


def test_a_verifier_reranks_the_beams_beam_search_returns(head_dirs):
    config = SearchConfig(n=4, beam_width=2, num_iterations=2, max_tokens=48, seed=3)
    ctx, plain = search({"prm": head_dirs["tc_qwen2"]}, config)
    _, verified = search({"prm": head_dirs["tc_qwen2"], "orm": head_dirs["orm_qwen2"]}, config, verifier="orm")
    assert sorted(b.path for b in verified.beams) == sorted(b.path for b in plain.beams)  # the same search
    finals = [b.scores[-1] for b in verified.beams]
    assert finals == sorted(finals, reverse=True)  # re-ranked by the verifier (agg last)
    for beam in verified.beams:
        expected = orm_reference(head_dirs["orm_qwen2"], ARITH_QUESTION, beam.steps)
        assert abs(beam.scores[-1] - torch.sigmoid(torch.tensor(expected)).item()) <= TOL


def test_a_process_prm_is_no_verifier(head_dirs):
    runtime = Runtime.load(
        [ModelSpec("prm", head_dirs["tc_qwen2"], 1.0)],
        kv_cache_memory=8 << 20,
        device_config=DeviceConfig(dtype="float32"),
    )
    prm = load_prm(runtime, "prm")
    with pytest.raises(ValueError, match="outcome reward model"):
        SearchContext(SearchConfig(), runtime, "prm", prm, verifier=prm)
    asyncio.run(runtime.close())
