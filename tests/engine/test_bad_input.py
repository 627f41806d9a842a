"""Invariant 6 at the Python API: bad input raises a clear error and changes no state."""

from __future__ import annotations

import json
import shutil

import pytest

from treeserve import LLM, SamplingParams, ScoreParams


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "n must be"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop strings"),
        ({"n_stop_occurrences": 0}, "n_stop_occurrences"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_score_params():
    with pytest.raises(ValueError, match="at least one"):
        ScoreParams(positions=[], token_ids=[1])
    with pytest.raises(ValueError, match="increasing"):
        ScoreParams(positions=[3, 1], token_ids=[1])


def test_bad_prompts_change_nothing(llama_dir, make_llm):
    llm = make_llm(llama_dir, max_model_len=64)
    engine = llm.engine
    before = engine.status
    good = "The quick brown fox"
    cases = [
        ([good, ""], "empty"),
        ([good, "word " * 80], "max_model_len"),
        ([good, {"prompt_token_ids": [1, 2, 10**6]}], "token ids"),
        ([good, {"bogus": 1}], "prompt dict"),
        ([good, 3.5], "string or a list"),
    ]
    for prompts, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, SamplingParams(max_tokens=4))
        assert engine.status == before and not engine.requests
    with pytest.raises(ValueError, match="outside"):
        llm.score([[1, 2, 3]], ScoreParams(positions=[3], token_ids=[1]))
    with pytest.raises(ValueError, match="parameter sets"):
        llm.generate([good, good], [SamplingParams()])
    engine.check_pages_idle()
    # the engine still works afterwards
    assert llm.generate(good, SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].finish_reason == "length"


def test_duplicate_request_id(llama_dir, make_llm):
    engine = make_llm(llama_dir).engine
    engine.add_request("a", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "hello", SamplingParams(max_tokens=2))
    engine.abort("a")
    assert not engine.requests


def test_abort_returns_pages(llama_dir, make_llm):
    engine = make_llm(llama_dir).engine
    engine.add_request("a", "The quick brown fox jumps over the lazy dog", SamplingParams(n=3, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.pages.num_used_pages > 0
    engine.abort("a")
    engine.check_pages_idle()


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="model not found"):
        LLM("/nonexistent/model")


@pytest.mark.parametrize("damage", ["config", "weights", "missing_tensor", "tokenizer", "model_type", "dtype"])
def test_malformed_checkpoint(llama_dir, tmp_path, damage):
    d = tmp_path / "ckpt"
    shutil.copytree(llama_dir, d)
    if damage == "config":
        (d / "config.json").write_text("{ not json")
    elif damage == "weights":
        (d / "model.safetensors").write_bytes(b"\x00" * 64)
    elif damage == "missing_tensor":
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(d / "model.safetensors"))
        tensors.pop("model.layers.0.mlp.up_proj.weight")
        save_file(tensors, str(d / "model.safetensors"))
    elif damage == "tokenizer":
        (d / "tokenizer.json").unlink()
    elif damage == "model_type":
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"] = "bert"
        (d / "config.json").write_text(json.dumps(cfg))
    expected = (FileNotFoundError, ValueError)
    with pytest.raises(expected) as info:
        LLM(str(d), dtype="int3" if damage == "dtype" else "float32", kv_cache_memory=1 << 20)
    assert str(info.value)


def test_kv_budget_too_small(llama_dir):
    with pytest.raises(ValueError, match="cannot hold one"):
        LLM(llama_dir, dtype="float32", kv_cache_memory=4096)
