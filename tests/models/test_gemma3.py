"""Gemma 3 text architecture: fp32 logits equal transformers' on a tiny random checkpoint.

The checkpoint has sliding-window and global layers (window 8, shorter than every prompt),
a softmax scale that differs from head_dim ** -0.5, linear rope scaling on the global
layers only and random norm weights, so each Gemma-specific piece changes the logits.
"""

from __future__ import annotations

import pytest

from tests.models.test_parity import PROMPTS, assert_greedy_matches, assert_parity, reference_logits
from tests.tiny_models import build_checkpoint
from treeserve import SamplingParams, ScoreParams


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> str:
    return build_checkpoint(
        str(tmp_path_factory.mktemp("gemma3")),
        "gemma3_text",
        head_dim=16,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=8,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )


def test_logits(gemma3_dir, make_llm):
    assert_parity(gemma3_dir, make_llm)


def test_logits_under_chunked_prefill(gemma3_dir, make_llm):
    """Chunks of 5 tokens: every chunk's sliding-window layers read keys from earlier chunks' pages."""
    assert_parity(gemma3_dir, make_llm, max_num_batched_tokens=5, enable_prefix_caching=False, page_size=4)


def test_logits_with_prefix_cache_hits(gemma3_dir, make_llm):
    """Scoring only the new tail of a prompt whose first pages come from the prefix cache."""
    llm = make_llm(gemma3_dir, page_size=4)
    tokenizer = llm.get_tokenizer()
    base = tokenizer.encode(PROMPTS[0])
    llm.generate([base], SamplingParams(max_tokens=1))
    longer = base + tokenizer.encode(" and then it ran home to count", add_special_tokens=False)
    tail = list(range(len(base), len(longer)))
    out = llm.score([longer], ScoreParams(positions=tail, return_hidden_states=True))[0]
    logits = llm.engine.model.compute_logits(out.hidden_states)
    assert llm.engine.pages.stats.hits >= len(base) // 4 - 1
    diff = (logits - reference_logits(gemma3_dir, longer)[tail]).abs().max().item()
    assert diff <= 1e-4, f"max abs logit diff {diff} after a prefix hit"


def test_greedy_decode_matches(gemma3_dir, make_llm):
    """Decode steps (the paged decode kernel with a window) continue exactly as transformers does."""
    assert_greedy_matches(gemma3_dir, make_llm, max_tokens=24)


def test_softcapping_is_refused(tmp_path, make_llm):
    model_dir = build_checkpoint(str(tmp_path), "gemma3_text", head_dim=16, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        make_llm(model_dir)
