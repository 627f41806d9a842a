"""The 2026 families (Qwen3, Qwen3-MoE, Phi-3/4-mini) and rope types (yarn, dynamic, longrope)
against transformers on checkpoints transformers wrote: fp32 logits, greedy tokens, and a row's
result independent of the rows beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.models.test_parity import PROMPTS, assert_greedy_matches, assert_parity, our_logits, reference_logits
from tests.tiny_models import build_checkpoint
from treeserve import SamplingParams, ScoreParams

FAMILIES = ("qwen3", "qwen3_moe", "phi3")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    return {arch: build_checkpoint(str(tmp_path_factory.mktemp(arch)), arch) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_match_transformers(family_dirs, make_llm, arch):
    assert_parity(family_dirs[arch], make_llm)


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_matches_transformers(family_dirs, make_llm, arch):
    assert_greedy_matches(family_dirs[arch], make_llm)


def test_chunked_prefill_and_prefix_cache_keep_moe_logits(family_dirs, make_llm):
    assert_parity(family_dirs["qwen3_moe"], make_llm, max_num_batched_tokens=5)


def test_moe_router_ties(tmp_path, make_llm):
    """A router whose logits tie exactly (all zero in layer 0) picks the experts transformers picks."""
    model_dir = build_checkpoint(str(tmp_path / "src"), "qwen3_moe")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hf.model.layers[0].mlp.gate.weight.zero_()
    hf.save_pretrained(str(tmp_path / "tied"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tied" / name).write_bytes((tmp_path / "src" / name).read_bytes())
    assert_parity(str(tmp_path / "tied"), make_llm)


def test_moe_experts_stacked_as_transformers_5_holds_them(family_dirs, tmp_path, make_llm):
    """A checkpoint saved from transformers 5's own tensors (`mlp.experts.gate_up_proj` [experts,
    2 x rows, cols], `mlp.experts.down_proj`) loads as the per-expert layout does."""
    from safetensors.torch import save_file

    source = family_dirs["qwen3_moe"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    save_file(state, tmp_path / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(source) / name).read_bytes())
    llm = make_llm(str(tmp_path))
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    assert (our_logits(llm, ids) - reference_logits(source, ids)).abs().max().item() <= 1e-4


def test_moe_row_is_batch_invariant(family_dirs, make_llm):
    """A sequence's hidden states are the same bits alone and beside others (experts see other rows)."""
    llm = make_llm(family_dirs["qwen3_moe"], enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    params = ScoreParams(positions=list(range(len(ids[0]))), return_hidden_states=True)
    alone = llm.score([ids[0]], params)[0].hidden_states
    together = llm.score(ids, [params] + [ScoreParams(positions=[0], return_hidden_states=True)] * 2)[0]
    assert torch.equal(alone, together.hidden_states)


@pytest.mark.parametrize("arch", FAMILIES)
def test_seeded_sampling_is_batch_invariant(family_dirs, make_llm, arch):
    llm = make_llm(family_dirs[arch])
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=3)
    alone = llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids
    beside = llm.generate(PROMPTS, params)[0].outputs[0].token_ids
    assert alone == beside


def test_phi3_longrope_switches_to_long_factors_past_the_pretraining_length(family_dirs, make_llm):
    """Past original_max_position_embeddings (64) the positions take the long factors, keys before
    keep the short ones: transformers' forward with a cache, fed a token at a time. (Its `generate`
    drops the cache at the crossing and re-reads everything with the long factors; we do not: a
    sequence's cached pages never change, docs/models.md.)"""
    model_dir = family_dirs["phi3"]
    llm = make_llm(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(5, 400, (80,), generator=torch.Generator().manual_seed(0))
    ours = our_logits(llm, ids.tolist())
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        ref = [hf(ids[None, :22], cache=cache, use_cache=True).logits[0]]
        for p in range(22, 80):
            step = hf(ids[None, p : p + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[p]]))
            ref.append(step.logits[0])
    diff = (ours - torch.cat(ref)).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
        (
            "qwen3",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 16,
                    "beta_slow": 2,
                }
            },
        ),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.5,
                    "truncate": False,
                }
            },
        ),
        ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ],
)
def test_rope_types_and_windows_match_transformers(tmp_path, make_llm, arch, overrides):
    model_dir = build_checkpoint(str(tmp_path), arch, **overrides)
    assert_parity(model_dir, make_llm)


def test_bf16_families_close_to_fp32(family_dirs, make_llm):
    for arch in FAMILIES:
        ids = make_llm(family_dirs[arch]).get_tokenizer().encode(PROMPTS[1])
        low = our_logits(make_llm(family_dirs[arch], dtype="bfloat16"), ids)
        ref = reference_logits(family_dirs[arch], ids)
        assert (low - ref).abs().max().item() < 0.1 * ref.abs().max().item(), arch


@pytest.mark.slow  # the Triton interpreter: ~15-30 s a family (CI runs the slow step)
@pytest.mark.parametrize("arch", FAMILIES)
def test_triton_backend_logits_match_transformers(family_dirs, make_llm, arch):
    """The Triton attention backend (a GPU, or the interpreter on CPU tensors) on each family:
    chunked, paged prefill with 4-token pages, fp32 logits equal to transformers'."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = {"page_size": 4, "max_num_batched_tokens": 16, "kv_cache_memory": 1 << 20}
    llm = make_llm(family_dirs[arch], attention_backend="triton", device=device, **small)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    diff = (our_logits(llm, ids) - reference_logits(family_dirs[arch], ids)).abs().max().item()
    assert diff <= 1e-4, f"max abs logit diff {diff}"
