"""PRM adapters: the real models' input formats, scores equal to a transformers reference (fp32),
prefix-stable inputs, `start=` equal to the tail of a full scoring, prefix-cache hits on
extended solutions, and `load_prm`'s style detection."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.search.prm_fixtures import build_arith_step_tag, build_reward_head, build_rlhflow, build_value_head
from treeserve.config import DeviceConfig
from treeserve.runtime.runtime import ModelSpec, Runtime
from treeserve.search.prm import PRMInputTooLong, RewardHeadPRM, RLHFlowPRM, StepTagPRM, ValueHeadPRM, load_prm

QUESTION = "Compute (12 + 7) * 3 - 15."
STEPS = ["Step 1: 12 + 7 = 19.", "Step 2: 19 * 3 = 57.", "Step 3: 57 - 15 = 42.", "The answer is 42."]
ARITH_QUESTION = "Compute 3 * (25 - 7) + 40."
ARITH_STEPS = [
    "25 - 7 = 18, leaving 3 * 18 + 40.",
    "3 * 18 = 54, leaving 54 + 40.",
    "54 + 40 = 94.",
    "The answer is 94.",
]
SHIPPED_PRM = os.path.join(os.path.dirname(__file__), "..", "..", "treeserve", "assets", "arith-prm")
TOL = 1e-4


@pytest.fixture(scope="module")
def prm_dirs(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("prms")
    return {
        "rlhflow": build_rlhflow(str(base / "rlhflow")),
        "reward_head": build_reward_head(str(base / "reward_head")),
        "value_head": build_value_head(str(base / "value_head")),
    }


@pytest.fixture(scope="module")
def arith_dir(tmp_path_factory) -> str:
    pytest.importorskip("tools.arith.prm_io")
    return build_arith_step_tag(str(tmp_path_factory.mktemp("arith_prm")))


def serve(dirs: dict[str, str], body: Callable[[Runtime], Awaitable[object]]) -> object:
    """Run `body` against a fresh runtime hosting `dirs`; afterwards no page may be leaked."""
    runtime = Runtime.load(
        [ModelSpec(name, path, 1 / len(dirs), page_size=4) for name, path in dirs.items()],
        kv_cache_memory=len(dirs) << 23,
        device_config=DeviceConfig(dtype="float32"),
    )

    async def main() -> object:
        try:
            return await body(runtime)
        finally:
            await runtime.close()

    result = asyncio.run(main())
    runtime.check_pages_idle()
    return result


def hf_tokenizer(model_dir: str):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


# ---- references: each model's own recipe, run with transformers -------------------------
def rlhflow_reference(model_dir: str, question: str, steps: list[str]) -> tuple[list[int], list[float]]:
    """RLHFlow's evaluation script: one conversation per prefix, P('+') at position -3."""
    tok = hf_tokenizer(model_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    candidates = [tok.encode("+", add_special_tokens=False)[-1], tok.encode("-", add_special_tokens=False)[-1]]
    conversation, scores = [], []
    for i, step in enumerate(steps):
        conversation.append({"role": "user", "content": f"{question} {step}" if i == 0 else step})
        conversation.append({"role": "assistant", "content": "+"})
        ids = tok.encode(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -3, candidates]
        scores.append(logits.softmax(-1)[0].item())
    return ids, scores


def reward_head_reference(model_dir: str, question: str, steps: list[str]) -> tuple[list[int], list[float]]:
    """Qwen2.5-Math-PRM's model card: the whole chat, `<extra_0>` positions, softmax(head)[1]."""
    tok = hf_tokenizer(model_dir)
    messages = [
        {"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"},
    ]
    ids = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))
    hidden = qwen2_hidden_states(model_dir, ids)
    head = load_file(os.path.join(model_dir, "model.safetensors"))
    h = torch.relu(hidden @ head["score.0.weight"].T + head["score.0.bias"])
    probs = (h @ head["score.2.weight"].T + head["score.2.bias"]).softmax(-1)[:, 1]
    return ids, probs[torch.tensor(ids) == tok.convert_tokens_to_ids("<extra_0>")].tolist()


def value_head_reference(model_dir: str, question: str, steps: list[str]) -> tuple[list[int], list[float]]:
    """Skywork's prepare_input + derive_step_rewards: BOS + question + newline, a step token after each step."""
    tok = hf_tokenizer(model_dir)
    step_id = tok.encode("\n")[-1]
    ids, flags = tok.encode(tok.bos_token + question + "\n"), []
    for step in steps:
        ids += tok.encode(step) + [step_id]
        flags.append(len(ids) - 1)
    head = load_file(os.path.join(model_dir, "model.safetensors"))
    values = qwen2_hidden_states(model_dir, ids) @ head["v_head.summary.weight"].T + head["v_head.summary.bias"]
    return ids, torch.sigmoid(values[flags, 0]).tolist()


def qwen2_hidden_states(model_dir: str, ids: list[int]) -> torch.Tensor:
    model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


def math_shepherd_reference(model_dir: str, question: str, steps: list[str]) -> tuple[list[int], list[float]]:
    """Math-Shepherd's example: f"{question} {step 1} ки\\n{step 2} ки", P('+') at every tag id."""
    tok = hf_tokenizer(model_dir)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok.encode(question + " " + "\n".join(f"{s} ки" for s in steps))
    tag, good, bad = (tok.encode(t, add_special_tokens=False)[-1] for t in ("ки", "+", "-"))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0][:, [good, bad]]
    return ids, logits.softmax(-1)[torch.tensor(ids) == tag, 0].tolist()


REFERENCES = {"rlhflow": rlhflow_reference, "reward_head": reward_head_reference, "value_head": value_head_reference}
ADAPTERS = {"rlhflow": RLHFlowPRM, "reward_head": RewardHeadPRM, "value_head": ValueHeadPRM}


# ---- parity with the references ----------------------------------------------------------
@pytest.mark.parametrize("style", sorted(REFERENCES))
def test_scores_match_transformers_reference(prm_dirs, style):
    ref_ids, ref_scores = REFERENCES[style](prm_dirs[style], QUESTION, STEPS)

    async def body(runtime: Runtime) -> tuple[list[int], list[float]]:
        prm = load_prm(runtime, style, style="rlhflow" if style == "rlhflow" else None)
        assert type(prm) is ADAPTERS[style]
        return prm.build(QUESTION, STEPS)[0], await prm.score(QUESTION, STEPS)

    ids, scores = serve({style: prm_dirs[style]}, body)
    assert ids == ref_ids[: len(ids)]  # reward_head leaves the assistant turn open: a prefix of the reference
    assert len(scores) == len(ref_scores) == len(STEPS)
    assert max(abs(a - b) for a, b in zip(scores, ref_scores, strict=True)) <= TOL
    assert max(ref_scores) - min(ref_scores) > 1e-3  # the random heads give distinct scores: the test can fail


def test_arith_step_tag_matches_training_format(arith_dir):
    from tools.arith import common, prm_io

    ref_ids, ref_tags = prm_io.prm_input(ARITH_QUESTION, ARITH_STEPS)
    ref_scores = prm_io.score_steps(common.load_model(arith_dir), [(ARITH_QUESTION, ARITH_STEPS)])[0]

    async def body(runtime: Runtime) -> tuple[tuple[list[int], list[int]], list[float]]:
        prm = load_prm(runtime, "arith")  # style from prm_config.json
        assert isinstance(prm, StepTagPRM) and prm.format.step_tag == "<|step|>"
        return prm.build(ARITH_QUESTION, ARITH_STEPS), await prm.score(ARITH_QUESTION, ARITH_STEPS)

    (ids, tags), scores = serve({"arith": arith_dir}, body)
    assert (ids, tags) == (ref_ids, ref_tags)
    assert max(abs(a - b) for a, b in zip(scores, ref_scores, strict=True)) <= TOL


def test_math_shepherd_defaults(llama_dir):
    ref_ids, ref_scores = math_shepherd_reference(llama_dir, QUESTION, STEPS)

    async def body(runtime: Runtime) -> tuple[list[int], list[float]]:
        prm = load_prm(runtime, "ms", style="step_tag")  # no prm_config.json: Math-Shepherd's format
        return prm.build(QUESTION, STEPS)[0], await prm.score(QUESTION, STEPS)

    ids, scores = serve({"ms": llama_dir}, body)
    assert ids == ref_ids
    assert max(abs(a - b) for a, b in zip(scores, ref_scores, strict=True)) <= TOL


@pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED_PRM, "prm_config.json")), reason="no shipped PRM yet")
def test_shipped_arith_prm_matches_training_format():
    prm_io = pytest.importorskip("tools.arith.prm_io")
    from tools.arith import common

    ref_scores = prm_io.score_steps(common.load_model(SHIPPED_PRM), [(ARITH_QUESTION, ARITH_STEPS)])[0]

    async def body(runtime: Runtime) -> tuple[list[int], list[float]]:
        prm = load_prm(runtime, "prm")
        assert isinstance(prm, StepTagPRM)
        return prm.build(ARITH_QUESTION, ARITH_STEPS)[0], await prm.score(ARITH_QUESTION, ARITH_STEPS)

    ids, scores = serve({"prm": SHIPPED_PRM}, body)
    assert ids == prm_io.prm_input(ARITH_QUESTION, ARITH_STEPS)[0]
    assert max(abs(a - b) for a, b in zip(scores, ref_scores, strict=True)) <= TOL


# ---- incremental scoring -------------------------------------------------------------------
def all_dirs(prm_dirs: dict[str, str], arith_dir: str) -> dict[str, str]:
    return {**prm_dirs, "step_tag": arith_dir}


@pytest.mark.parametrize("style", ["step_tag", "rlhflow", "reward_head", "value_head"])
def test_prefix_stable_start_and_cache_hits(prm_dirs, arith_dir, style):
    question, steps = (ARITH_QUESTION, ARITH_STEPS) if style == "step_tag" else (QUESTION, STEPS)
    model_dir = all_dirs(prm_dirs, arith_dir)[style]

    async def body(runtime: Runtime) -> None:
        prm = load_prm(runtime, style, style=style)
        full_ids, full_positions = prm.build(question, steps)
        for k in range(1, len(steps)):
            ids, positions = prm.build(question, steps[:k])
            assert full_ids[: len(ids)] == ids and full_positions[:k] == positions
        stats = runtime.engine(style).pages.stats
        await prm.score(question, steps[:2])
        hits = stats.hits
        tail = await prm.score(question, steps, start=2)
        assert stats.hits > hits  # the extended solution re-used the pages of its scored prefix
        full = await prm.score(question, steps)
        assert len(tail) == len(steps) - 2
        assert max(abs(a - b) for a, b in zip(tail, full[2:], strict=True)) <= TOL

    serve({style: model_dir}, body)


@pytest.mark.parametrize("style", ["step_tag", "rlhflow", "reward_head", "value_head"])
def test_remembered_pieces_build_the_same_inputs_and_tokenize_each_once(prm_dirs, arith_dir, style):
    """A beam is scored again with all its steps each iteration: the prompt and each step's piece
    are tokenized once (`PRM.encode`), and the inputs are the ones a fresh adapter builds."""
    question, steps = (ARITH_QUESTION, ARITH_STEPS) if style == "step_tag" else (QUESTION, STEPS)
    model_dir = all_dirs(prm_dirs, arith_dir)[style]

    async def body(runtime: Runtime) -> None:
        prm = load_prm(runtime, style, style=style)
        calls: list[str] = []
        encode = prm.tokenizer.encode
        prm.tokenizer.encode = lambda text, **kw: calls.append(text) or encode(text, **kw)
        try:
            built = [prm.build(question, steps[:k]) for k in range(1, len(steps) + 1)]
        finally:
            prm.tokenizer.encode = encode
        assert len(calls) == len(set(calls))  # no piece tokenized twice
        fresh = load_prm(runtime, style, style=style)
        assert built == [fresh.build(question, steps[:k]) for k in range(1, len(steps) + 1)]

    serve({style: model_dir}, body)


# ---- choosing the adapter ----------------------------------------------------------------------
def test_load_prm_detects_style(prm_dirs, arith_dir):
    async def body(runtime: Runtime) -> None:
        assert isinstance(load_prm(runtime, "reward_head"), RewardHeadPRM)  # architectures
        assert isinstance(load_prm(runtime, "value_head"), ValueHeadPRM)  # v_head.* tensors
        assert isinstance(load_prm(runtime, "step_tag"), StepTagPRM)  # prm_config.json
        with pytest.raises(ValueError, match="--prm-style"):
            load_prm(runtime, "rlhflow")
        assert isinstance(load_prm(runtime, "rlhflow", "rlhflow"), RLHFlowPRM)
        with pytest.raises(ValueError, match="unknown PRM style"):
            load_prm(runtime, "rlhflow", "shepherd")
        with pytest.raises(ValueError, match="reward head tensors"):
            load_prm(runtime, "value_head", "reward_head")
        with pytest.raises(ValueError, match="at least one step"):
            await load_prm(runtime, "value_head").score(QUESTION, [])

    serve(all_dirs(prm_dirs, arith_dir), body)


def test_an_input_past_the_prm_context_is_refused(arith_dir):
    """A beam longer than the PRM's context is refused with an error naming both lengths, never
    scored 0 or cut; what fits keeps the scores it has in a full read."""

    async def body(runtime: Runtime) -> None:
        prm = load_prm(runtime, "step_tag", style="step_tag")
        _, positions = prm.build(ARITH_QUESTION, ARITH_STEPS)
        full = await prm.score(ARITH_QUESTION, ARITH_STEPS)
        runtime.engine("step_tag").max_model_len = limit = positions[1] + 1  # room for the first two tags only
        for start in (0, 2):
            with pytest.raises(PRMInputTooLong, match=f"needs {positions[-1] + 1} tokens .* at most {limit}") as e:
                await prm.score(ARITH_QUESTION, ARITH_STEPS, start=start)
            assert (e.value.needed, e.value.limit) == (positions[-1] + 1, limit) and isinstance(e.value, ValueError)
        fits = await prm.score(ARITH_QUESTION, ARITH_STEPS[:2])
        assert max(abs(a - b) for a, b in zip(fits, full[:2], strict=True)) <= TOL

    serve({"step_tag": arith_dir}, body)
