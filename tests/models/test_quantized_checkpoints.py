"""GPTQ, AWQ and compressed-tensors checkpoints, as users download them.

References, per format:
- compressed-tensors files are written by compressed-tensors itself (tests/quantized_files.py);
  transformers decompresses the same file (`CompressedTensorsConfig(dequantize=True)`), and our
  dequantised load must give its logits (fp32);
- GPTQ files were written by GPTQModel (tests/models/data/quantized/make_fixtures.py), with each
  layer's weight as GPTQModel dequantises it: our unpacking must give those weights;
- AWQ files are packed in AutoAWQ's GEMM layout from known integer codes.
Then the quantised path against the dequantised one: with bf16 activations (no activation
rounding) the same weights, so fp32-close (compressed-tensors' fp32 scales round to fp16 in the
CPU blocks: a 2^-11 relative change); with 8-bit activations, the activations' rounding.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.quantized_files import awq_pack, write_awq, write_compressed_tensors
from tests.tiny_models import build_checkpoint
from treeserve import LLM, SamplingParams, ScoreParams
from treeserve.layers.group_quant import Fp8Weight, GroupQuantWeight, checkpoint_linear
from treeserve.layers.quant import QuantTensor, kernels_available
from treeserve.models.loader import iter_safetensors, read_hf_config
from treeserve.models.quantized_checkpoint import quantized_tensors, read_scheme

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C compiler: quantised kernels not built")
FIXTURES = Path(__file__).parent / "data" / "quantized"
GPTQ = ("gptq-4bit-sym", "gptq-4bit-asym-act-order", "gptq-8bit-sym")
CT_SCHEMES = {"W4A16": "Q4_0", "W4A16_ASYM": "Q5_0", "W8A16": "Q8_0", "W8A8": "I8", "FP8_DYNAMIC": None}
IDS = list(range(3, 40))


def _logits(llm: LLM) -> torch.Tensor:
    out = llm.score([IDS], ScoreParams(positions=list(range(len(IDS))), return_hidden_states=True))[0]
    return llm.engine.model.compute_logits(out.hidden_states)


def _stored_weights(path: str) -> dict[str, GroupQuantWeight | Fp8Weight]:
    scheme = read_scheme(path, read_hf_config(path))
    return {name: w for name, w in quantized_tensors(iter_safetensors(path), scheme) if not isinstance(w, torch.Tensor)}


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """Each quantised layer's weight as treeserve unpacks it, fp32 [out, in]."""
    scheme = read_scheme(path, read_hf_config(path))
    return {
        name.removesuffix(".weight"): w.dequantize()
        for name, w in quantized_tensors(iter_safetensors(path), scheme)
        if not isinstance(w, torch.Tensor)
    }


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("dense")))


@pytest.fixture(scope="module")
def compressed(dense, tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("compressed_tensors")
    root = tmp_path_factory.mktemp("compressed")
    return {name: write_compressed_tensors(dense, str(root / name), name) for name in CT_SCHEMES}


@pytest.mark.parametrize("name", GPTQ)
def test_gptq_unpacks_to_gptqmodels_own_weights(name):
    ours = _read_weights(str(FIXTURES / name))
    reference = load_file(str(FIXTURES / "references" / f"{name}.safetensors"))
    assert set(ours) == set(reference) and len(ours) == 14
    for layer, weight in ours.items():
        # GPTQModel dequantises the 8-bit files in bf16 (its CPU kernel has no fp32 there)
        rtol = 0 if name != "gptq-8bit-sym" else 2**-7  # the scale and the product rounded
        assert ((weight - reference[layer].float()).abs() <= rtol * weight.abs()).all(), layer


@pytest.mark.parametrize("name", list(CT_SCHEMES))
def test_compressed_tensors_dequantised_matches_transformers(compressed, make_llm, name):
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    path = compressed[name]
    reference = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    with torch.no_grad():
        expected = reference(torch.tensor([IDS])).logits[0]
    dense = make_llm(path, dequantize=True)
    assert "dequantised" in dense.engine.quantization
    torch.testing.assert_close(_logits(dense), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CT_SCHEMES))
def test_compressed_tensors_runs_quantised(compressed, make_llm, name):
    path, blocks = compressed[name], CT_SCHEMES[name]
    quantised, dense = make_llm(path, quant_activations="bf16"), make_llm(path, dequantize=True)
    weight = quantised.engine.model.layers[0].self_attn.qkv_proj.weight
    if blocks is None:  # FP8: no CPU multiplies it, the weights are dequantised
        assert isinstance(weight, torch.Tensor) and "dequantised" in quantised.engine.quantization
    else:
        assert isinstance(weight, QuantTensor) and weight.formats == [blocks]
        assert quantised.engine.quantization.endswith(f"as {blocks}, bf16 activations")
    ours, ref = _logits(quantised), _logits(dense)
    torch.testing.assert_close(ours, ref, rtol=0, atol=5e-3 * float(ref.abs().max()))
    assert isinstance(make_llm(path).engine.model.layers[0].mlp.down_proj.weight, QuantTensor) or blocks is None


@pytest.mark.parametrize("name", GPTQ)
def test_gptq_runs_quantised_and_greedy(make_llm, name):
    path = str(FIXTURES / name)
    quantised, dense = make_llm(path, quant_activations="bf16"), make_llm(path, dequantize=True)
    qkv = quantised.engine.model.layers[0].self_attn.qkv_proj.weight
    assert isinstance(qkv, QuantTensor) and len(qkv.parts) == 1  # q, k and v fused in the file's groups
    assert (qkv.input_order is not None) == ("act-order" in name)  # q, k and v share GPTQ's input order
    ours, ref = _logits(quantised), _logits(dense)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5 * float(ref.abs().max()) + 1e-5)
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    int8 = make_llm(path)  # 8-bit activations: the default
    assert int8.generate(["the quick brown fox"], greedy)[0].outputs[0].token_ids
    assert (
        quantised.generate(["the quick"], greedy)[0].outputs[0].token_ids
        == dense.generate(["the quick"], greedy)[0].outputs[0].token_ids
    )


def test_awq_unpacks_and_runs(dense, make_llm, tmp_path):
    path = str(tmp_path / "awq")
    expected = write_awq(dense, path)
    ours = _read_weights(path)
    assert set(ours) == set(expected)
    for layer, weight in ours.items():
        torch.testing.assert_close(weight, expected[layer], rtol=0, atol=0, msg=layer)
    quantised, reference = make_llm(path, quant_activations="bf16"), make_llm(path, dequantize=True)
    assert quantised.engine.quantization == "awq(awq:w4a16) as Q5_0, bf16 activations"
    ref = _logits(reference)
    torch.testing.assert_close(_logits(quantised), ref, rtol=0, atol=1e-5 * float(ref.abs().max()) + 1e-5)


def test_stored_weights_multiply_as_the_gpu_kernels_take_them(compressed):
    """What a CUDA engine runs (`checkpoint_linear` over the weights as stored); CPU tensors take
    the kernels' references, the Triton kernels themselves are held to those in
    tests/kernels/test_triton_quant_matmul.py. W8A8 rounds activations per row (exact integer sums)."""
    paths = [str(FIXTURES / name) for name in GPTQ] + [
        compressed[name] for name in ("W4A16_ASYM", "W8A8", "FP8_DYNAMIC")
    ]
    torch.manual_seed(0)
    for path in paths:
        for name, stored in _stored_weights(path).items():
            weight = stored.on(torch.device("cpu"))
            x = torch.randn(3, weight.shape[1])
            if isinstance(weight, GroupQuantWeight) and weight.int8_rows is not None:  # x rounded per row
                step = x.abs().amax(dim=1, keepdim=True) / 127
                x_used = (x / step).round().clamp(-127, 127) * step
            else:
                x_used = x
            expected = x_used @ weight.dequantize().t()
            torch.testing.assert_close(checkpoint_linear(x, weight), expected, rtol=1e-5, atol=1e-5, msg=name)


def test_an_engine_runs_weights_as_stored(monkeypatch, make_llm):
    """A CUDA engine's wiring on a CPU: the loader keeps the weights as stored (as on CUDA), the
    Linear layers pick `checkpoint_linear`, the planner counts their bytes, the logits match."""
    from treeserve.models import loader
    from treeserve.runtime.planner import weight_bytes

    path = str(FIXTURES / "gptq-4bit-asym-act-order")
    dense = make_llm(path, dequantize=True)
    monkeypatch.setattr(loader, "_checkpoint_weight", lambda name, weight, keep, dtype, device: weight.on(device))
    stored = make_llm(path)
    layer = stored.engine.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.weight, GroupQuantWeight) and layer.kernel is checkpoint_linear
    assert weight_bytes(stored.engine.model) < weight_bytes(dense.engine.model)
    ref = _logits(dense)
    torch.testing.assert_close(_logits(stored), ref, rtol=0, atol=1e-5 * float(ref.abs().max()) + 1e-5)


def test_awq_pack_order_is_autoawqs():
    codes = torch.arange(16, dtype=torch.int32).reshape(1, 16) % 16
    word = int(awq_pack(codes)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


# ---- bad input: every refusal names what it found


def _edit_config(src: str, dst: Path, **quant) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {**config.get("quantization_config", {}), **quant}
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "quantize_config.json").unlink(missing_ok=True)
    return str(dst)


@pytest.mark.parametrize(
    "quant,message",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        ({"bits": 3}, "GPTQ bits=3"),
        ({"group_size": 48}, "group_size=48"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ],
)
def test_unsupported_gptq_configs_are_refused(tmp_path, quant, message):
    path = _edit_config(str(FIXTURES / "gptq-4bit-sym"), tmp_path / "bad", **quant)
    with pytest.raises(ValueError, match="not supported") as error:
        LLM(path, dtype="float32")
    assert message in str(error.value)


def test_unsupported_compressed_tensors_configs_are_refused(compressed, tmp_path):
    groups = read_hf_config(compressed["W4A16"])["quantization_config"]["config_groups"]
    groups["group_0"]["format"] = "marlin-24"
    path = _edit_config(compressed["W4A16"], tmp_path / "bad", config_groups=groups)
    with pytest.raises(ValueError, match="format='marlin-24'"):
        LLM(path, dtype="float32")
    path = _edit_config(compressed["W8A8"], tmp_path / "kv", kv_cache_scheme={"num_bits": 8, "type": "float"})
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        LLM(path, dtype="float32")


def _edit_tensors(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"))
    return str(dst)


def test_tensor_a_quantised_layer_does_not_have_is_an_error(tmp_path):
    def add(state):
        state["model.layers.0.self_attn.q_proj.weight_scale_2"] = torch.ones(4)

    path = _edit_tensors(str(FIXTURES / "gptq-4bit-sym"), tmp_path / "extra", add)
    with pytest.raises(ValueError, match="q_proj.weight_scale_2.*has no 'weight_scale_2'"):
        LLM(path, dtype="float32")


def test_missing_and_misshapen_tensors_name_the_layer(compressed, tmp_path):
    def drop(state):
        del state["model.layers.1.mlp.up_proj.scales"]

    path = _edit_tensors(str(FIXTURES / "gptq-4bit-sym"), tmp_path / "missing", drop)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj' lacks \['scales'\]"):
        LLM(path, dtype="float32")

    def shrink(state):
        name = "model.layers.0.mlp.down_proj.weight_packed"
        state[name] = state[name][:, :-1].contiguous()

    path = _edit_tensors(compressed["W4A16"], tmp_path / "short", shrink)
    with pytest.raises(ValueError, match="down_proj.weight_packed: its packed rows hold 120 values"):
        LLM(path, dtype="float32")


def test_quantised_checkpoint_refuses_a_second_quantisation():
    with pytest.raises(ValueError, match="quantised already: quantization='int8' does not apply"):
        LLM(str(FIXTURES / "gptq-4bit-sym"), dtype="float32", quantization="int8")


def test_checkpoints_fixture_files_are_present():
    for name in GPTQ:
        assert os.path.isfile(FIXTURES / name / "model.safetensors")
        assert os.path.isfile(FIXTURES / "references" / f"{name}.safetensors")
