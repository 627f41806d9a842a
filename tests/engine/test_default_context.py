"""max_model_len when none is given: the model's context, lowered to what the KV budget holds."""

from __future__ import annotations

import logging

import pytest

from tests.tiny_models import build_checkpoint
from treeserve import LLM, SamplingParams
from treeserve.engine.llm_engine import MIN_AUTO_MODEL_LEN


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory) -> str:
    # 2 layers x 2 KV heads x head_dim 16, fp32: 512 bytes of KV per token, 8 KiB a 16-token page
    return build_checkpoint(str(tmp_path_factory.mktemp("long")), "llama", max_position_embeddings=32768)


def test_lowered_to_what_fits_with_one_line(long_context_dir, make_llm, caplog):
    with caplog.at_level(logging.WARNING, logger="treeserve.engine.llm_engine"):
        llm = make_llm(long_context_dir, kv_cache_memory=4 << 20)  # 512 pages
    engine = llm.engine
    assert engine.max_model_len == (512 - 1) * 16 < 32768
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "lowered from the model's 32768 to 8176" in lines[0] and "max_model_len" in lines[0]
    out = llm.generate(["a b c"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_fits_needs_no_change(long_context_dir, make_llm, caplog):
    with caplog.at_level(logging.WARNING, logger="treeserve.engine.llm_engine"):
        llm = make_llm(long_context_dir, kv_cache_memory=20 << 20)
    assert llm.engine.max_model_len == 32768 and not caplog.records


def test_given_max_model_len_is_never_changed(long_context_dir):
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=32768"):
        LLM(long_context_dir, dtype="float32", kv_cache_memory=4 << 20, max_model_len=32768)


def test_below_the_minimum_is_an_error(long_context_dir):
    with pytest.raises(ValueError, match=f"not below {MIN_AUTO_MODEL_LEN}"):
        LLM(long_context_dir, dtype="float32", kv_cache_memory=512 << 10)  # 64 pages: 1008 tokens


@pytest.mark.parametrize("overlap", [False, True])
def test_rope_tables_cover_max_model_len_only(long_context_dir, make_llm, overlap):
    """A given max_model_len sizes the rotary tables (a 32k-position model need not hold 32k rows
    of cos and sin for 64-token sequences), and a sequence runs to that length on them."""
    llm = make_llm(long_context_dir, max_model_len=64, async_scheduling=overlap)
    assert llm.engine.model.rope.cos.shape[0] == llm.engine.model.rope.sin.shape[0] == 64
    out = llm.generate([{"prompt_token_ids": [5] * 40}], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 24 and out[0].outputs[0].finish_reason == "length"


def test_rope_tables_cover_the_model_without_max_model_len(long_context_dir, make_llm):
    llm = make_llm(long_context_dir, kv_cache_memory=20 << 20)
    assert llm.engine.model.rope.cos.shape[0] == 32768
