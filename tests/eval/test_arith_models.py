"""The shipped arithmetic checkpoints load in treeserve and behave as their model cards say."""

from __future__ import annotations

from pathlib import Path

import pytest

from treeserve import LLM, SamplingParams
from treeserve.eval.arith import arith_dataset, extract_boxed, grade
from treeserve.kernels import cpu as cpu_kernels

ASSETS = Path(__file__).resolve().parents[2] / "treeserve" / "assets"
GENERATOR, PRM = ASSETS / "arith-generator", ASSETS / "arith-prm"

pytestmark = pytest.mark.skipif(not (GENERATOR / "config.json").exists(), reason="shipped models not present")


def test_greedy_level1_accuracy_above_90_percent(make_llm):
    problems = arith_dataset(size=50, seed=0, levels=(1,))
    assert len(problems) == 50
    llm: LLM = make_llm(str(GENERATOR), kv_cache_memory=64 << 20)
    conversations = [[{"role": "user", "content": p["problem"]}] for p in problems]
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=256))
    correct = [grade(extract_boxed(o.outputs[0].text) or "", p["answer"]) for o, p in zip(outs, problems, strict=True)]
    assert sum(correct) / len(correct) > 0.9
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)  # ends with EOS, not the length cap


def test_prm_loads_and_reads_both_labels(make_llm):
    import json

    config = json.loads((PRM / "prm_config.json").read_text())
    llm = make_llm(str(PRM), kv_cache_memory=64 << 20)
    tokenizer = llm.get_tokenizer()
    for key in ("step_tag", "good_token", "bad_token"):
        assert tokenizer.hf.token_to_id(config[key]) is not None, key


@pytest.mark.slow
def test_model_card_claims_hold_on_a_sample():
    """The model cards' claims, re-measured on a sample of the test split (minutes, one thread):
    level-5 greedy accuracy in 20-70%, pass@16 at T=0.8 well above greedy at levels 4-5 (the
    issue's generator targets); the PRM's step-level ROC-AUC on held-out generator samples near
    its card's 0.977 (the issue's target is 0.9; 20 problems per level here, so allow sampling
    noise), and a PRM that checks the step itself: fact drills (nothing but the arithmetic to go
    on) and wrong results and wrong orders of operations in otherwise right solutions."""
    from tools.arith.evaluate import evaluate

    results = evaluate(GENERATOR, PRM, per_level_sampled=20, n=16, temperature=0.8, seed=0)
    levels = results["levels"]
    assert levels[1]["greedy_acc"] > 0.9
    assert 0.2 <= levels[5]["greedy_acc"] <= 0.7
    for lv in (4, 5):  # 20 problems per level here: allow a little sampling noise around +20 points
        assert levels[lv]["pass@16"] >= levels[lv]["greedy_acc"] + 0.15, levels[lv]
    prm = results["prm"]
    assert prm["auc"] >= 0.88, prm["auc"]
    assert prm["fact_drill_auc"] >= 0.95, prm["fact_drill_auc"]
    for kind in ("result", "order"):
        assert prm["corruptions"][kind]["auc"] >= 0.88, (kind, prm["corruptions"][kind])


@pytest.mark.skipif(not cpu_kernels.bf16_built(), reason="no AVX512-BF16: the bf16 attention kernels are not built")
def test_bf16_attention_kernels_give_the_sdpa_path_greedy_solutions(make_llm):
    """End to end in bf16 (the dtype search runs the shipped models in): the C decode and prefill
    attention kernels against gather + SDPA, on the shipped generator's greedy solutions."""
    problems = arith_dataset(size=12, seed=0, levels=(3, 4))
    conversations = [[{"role": "user", "content": p["problem"]}] for p in problems]
    params = SamplingParams(temperature=0.0, max_tokens=256)

    def solutions(backend: str) -> list[str]:
        llm = make_llm(str(GENERATOR), dtype="bfloat16", kv_cache_memory=64 << 20, attention_backend=backend)
        return [o.outputs[0].text for o in llm.chat(conversations, params)]

    assert solutions("sdpa") == solutions("cpu")
