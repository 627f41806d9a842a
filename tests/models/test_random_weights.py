"""Random-weights directories: config.json, a tokenizer and a seed, no weight file (models/loader.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.tiny_models import build_random_weights_dir
from treeserve import SamplingParams
from treeserve.layers.norm import GemmaRMSNorm, RMSNorm
from treeserve.models.loader import RANDOM_WEIGHTS, load_model, random_state


def state(model_dir: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return load_model(model_dir, dtype, "cpu").model.state_dict()


def test_loads_without_weight_files_and_is_deterministic(tmp_path):
    a = build_random_weights_dir(str(tmp_path / "a"), seed=3)
    b = build_random_weights_dir(str(tmp_path / "b"), seed=3)
    other = build_random_weights_dir(str(tmp_path / "c"), seed=4)
    assert not [f for f in os.listdir(a) if f.endswith(".safetensors")]
    first, again, different = state(a), state(b), state(other)
    assert first.keys() == again.keys() == different.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
        if "norm" in name:
            assert torch.all(tensor == 1), name
        else:
            assert not torch.equal(tensor, different[name]), name
            assert abs(tensor.std().item() - 0.02) < 0.005, name


def test_tensors_come_in_the_dtype_asked_for_with_unit_gain_norms_and_zero_biases():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), RMSNorm(8, 1e-6), GemmaRMSNorm(8, 1e-6))
    made = random_state(model, 0, torch.bfloat16, "cpu")
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in made.values())
    assert torch.all(made["0.bias"] == 0) and torch.all(made["1.weight"] == 1) and torch.all(made["2.weight"] == 0)
    assert made["0.weight"].std() > 0


def test_tied_embeddings_and_a_tensor_independent_of_the_others(tmp_path):
    tied = state(build_random_weights_dir(str(tmp_path / "tied"), tie_word_embeddings=True))
    deeper = state(build_random_weights_dir(str(tmp_path / "deep"), num_hidden_layers=3))
    assert "lm_head.weight" not in tied
    assert torch.equal(tied["layers.1.mlp.down_proj.weight"], deeper["layers.1.mlp.down_proj.weight"])


def test_generates_the_same_tokens_for_the_same_seed(tmp_path, make_llm):
    outs = []
    for name in ("a", "b"):
        llm = make_llm(build_random_weights_dir(str(tmp_path / name), seed=1))
        params = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
        outs.append(llm.generate(["Compute (12 + 7) * 3", "The quick brown fox"], params))
    for x, y in zip(*outs, strict=True):
        assert len(x.outputs[0].token_ids) == 12
        assert x.outputs[0].token_ids == y.outputs[0].token_ids


@pytest.mark.parametrize("marker", ['{"seed": -1}', '{"seed": "one"}', "[1]", "not json"])
def test_a_bad_marker_is_refused(tmp_path, marker):
    model_dir = build_random_weights_dir(str(tmp_path / "m"))
    with open(os.path.join(model_dir, RANDOM_WEIGHTS), "w") as f:
        f.write(marker)
    with pytest.raises(ValueError, match="random_weights.json"):
        load_model(model_dir, torch.float32, "cpu")


def test_marker_default_seed(tmp_path):
    model_dir = build_random_weights_dir(str(tmp_path / "m"), seed=0)
    with open(os.path.join(model_dir, RANDOM_WEIGHTS), "w") as f:
        json.dump({}, f)
    assert torch.equal(
        state(model_dir)["embed_tokens.weight"],
        state(build_random_weights_dir(str(tmp_path / "z")))["embed_tokens.weight"],
    )
