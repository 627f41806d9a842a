"""Invariant 2: our logits equal transformers' (fp32) for every supported architecture."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from tests.tiny_models import build_checkpoint
from treeserve import SamplingParams, ScoreParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away",
    "Compute (12 + 7) * 3 - 15.\n\nStep 1:",
    "Unicode: café, naïve, 日本語",
]


def reference_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def our_logits(llm, ids: list[int]) -> torch.Tensor:
    out = llm.score([ids], ScoreParams(positions=list(range(len(ids))), return_hidden_states=True))[0]
    return llm.engine.model.compute_logits(out.hidden_states.to(llm.engine.device)).cpu()


def assert_parity(model_dir: str, make_llm, **engine_kwargs) -> None:
    llm = make_llm(model_dir, **engine_kwargs)
    for prompt in PROMPTS:
        ids = llm.get_tokenizer().encode(prompt)
        diff = (our_logits(llm, ids) - reference_logits(model_dir, ids)).abs().max().item()
        assert diff <= 1e-4, f"max abs logit diff {diff} for {prompt!r}"


def assert_greedy_matches(model_dir: str, make_llm, max_tokens: int = 24) -> None:
    llm = make_llm(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for out in llm.generate(PROMPTS, params):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()


def test_llama_gqa_logits(llama_dir, make_llm):
    assert_parity(llama_dir, make_llm)


def test_llama_greedy(llama_dir, make_llm):
    assert_greedy_matches(llama_dir, make_llm)


def test_qwen2_bias_tied_logits(qwen2_dir, make_llm):
    assert_parity(qwen2_dir, make_llm)


def test_qwen2_greedy(qwen2_dir, make_llm):
    assert_greedy_matches(qwen2_dir, make_llm)


def test_llama3_rope_scaling(tmp_path, make_llm):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    model_dir = build_checkpoint(str(tmp_path), "llama", rope_scaling=scaling, rope_theta=500000.0)
    assert_parity(model_dir, make_llm)


def test_mistral_sliding_window(tmp_path, make_llm):
    """A window shorter than the prompts, also across chunked prefill."""
    model_dir = build_checkpoint(str(tmp_path), "mistral", sliding_window=8)
    assert_parity(model_dir, make_llm)
    assert_parity(model_dir, make_llm, max_num_batched_tokens=5, enable_prefix_caching=False)


def test_sharded_checkpoint(tmp_path, make_llm, llama_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    hf.save_pretrained(str(tmp_path), max_shard_size="50KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{llama_dir}/{name}", tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert_parity(str(tmp_path), make_llm)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bf16_close_to_fp32(llama_dir, make_llm, dtype):
    ids = make_llm(llama_dir).get_tokenizer().encode(PROMPTS[0])
    low = our_logits(make_llm(llama_dir, dtype=dtype), ids)
    ref = reference_logits(llama_dir, ids)
    assert (low - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_demo_checkpoint_loads_in_transformers_and_treeserve(tmp_path, make_llm):
    """The checkpoint `treeserve generate` writes when no trained model is installed is a real one."""
    from treeserve.models.demo_checkpoint import build_demo_checkpoint

    model_dir = str(build_demo_checkpoint(tmp_path / "demo"))
    llm = make_llm(model_dir, max_model_len=256)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    diff = (our_logits(llm, ids) - reference_logits(model_dir, ids)).abs().max().item()
    assert diff <= 1e-4
