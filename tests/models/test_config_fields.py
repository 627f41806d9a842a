"""Every config.json field transformers writes for a supported family is read, inert or refused,
and a refused field or an unread tensor stops the load with its name (nothing loads silently wrong)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.tiny_models import build_checkpoint
from treeserve import LLM
from treeserve.models.config_fields import INERT, READ, REFUSED, check_fields
from treeserve.models.loader import ARCHITECTURES

CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "mistral": transformers.MistralConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "qwen3_moe": transformers.Qwen3MoeConfig,
    "phi3": transformers.Phi3Config,
    "gemma3_text": transformers.Gemma3TextConfig,
}


def test_every_architecture_has_a_field_table():
    assert set(ARCHITECTURES) == set(CONFIG_CLASSES) == set(READ)


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_every_transformers_field_is_read_inert_or_refused(model_type):
    fields = set(CONFIG_CLASSES[model_type]().to_dict())
    unclassified = fields - READ[model_type] - INERT - set(REFUSED)
    assert not unclassified, f"{model_type}: classify {sorted(unclassified)} in treeserve/models/config_fields.py"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("is_encoder_decoder", True, "encoder-decoder"),
        ("use_bidirectional_attention", True, "bidirectional"),
    ],
)
def test_a_refused_field_names_itself(field, value, message):
    with pytest.raises(ValueError, match=message):
        check_fields({"model_type": "llama", field: value}, "llama")


def test_refused_fields_at_their_noop_values_load():
    check_fields({"model_type": "llama", "attn_logit_softcapping": None, "is_encoder_decoder": False}, "llama")


def test_an_unknown_moe_field_is_refused():
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        check_fields({"model_type": "qwen3_moe", "shared_expert_intermediate_size": 64}, "qwen3_moe")


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "mrope", "mrope_section": [2, 2]}, "unsupported rope type 'mrope'"),
        ({"rope_type": "yarn", "factor": 2.0, "mrope_section": [2]}, r"unsupported parameters \['mrope_section'\]"),
    ],
)
def test_an_unknown_rope_is_refused_at_load(tmp_path, rope, message):
    model_dir = build_checkpoint(str(tmp_path), "llama")
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(model_dir, dtype="float32", kv_cache_memory=8 << 20)


def test_a_quantised_checkpoint_is_refused_not_loaded_wrong(tmp_path):
    """What llm-compressor writes for W8A8 int8: int8 codes, a weight_scale per channel, a
    quantization_config. It used to load the codes as numbers and generate garbage."""
    model_dir = build_checkpoint(str(tmp_path), "llama")
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    weights[f"{name}.weight"] = weights[f"{name}.weight"].mul(100).round().clamp(-127, 127).to(torch.int8)
    weights[f"{name}.weight_scale"] = torch.full((weights[f"{name}.weight"].shape[0], 1), 0.01)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"{name}.weight_scale"):  # the tensor, even without the config's word
        LLM(model_dir, dtype="float32", kv_cache_memory=8 << 20)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config"):
        LLM(model_dir, dtype="float32", kv_cache_memory=8 << 20)


def test_a_tensor_of_another_architecture_is_an_error(tmp_path):
    """A MoE expert's weights in a dense Llama checkpoint: named, not dropped."""
    model_dir = build_checkpoint(str(tmp_path), "llama")
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.mlp.experts.0.down_proj.weight"] = torch.zeros(64, 16)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.0.down_proj.weight"):
        LLM(model_dir, dtype="float32", kv_cache_memory=8 << 20)
