"""Qwen3-MoE experts kept quantised: a GGUF file's stacked experts as one matrix of blocks an
expert, and int8 of a Hugging Face checkpoint, each expert on the dense `Linear` kernels.

References as in `test_quantized_models.py`: the GGUF file dequantised on load; for int8 the
checkpoint with every matrix rounded to int8 and back (the weights the kernels multiply), and
the dense fp32 checkpoint. Quantised experts are not stacked for the grouped GEMM (CUDA's path),
so `SparseMoE.stack_experts` declines and leaves them as they are.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.gguf_files import write_gguf
from tests.tiny_models import build_checkpoint
from treeserve import LLM, ScoreParams
from treeserve.config import EngineConfig
from treeserve.layers.quant import QuantTensor, kernels_available, quantize_int8, quantized_weights
from treeserve.models.qwen3_moe import SparseMoE

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C compiler: quantised kernels not built")
IDS = list(range(3, 40))


def _logits(llm: LLM) -> torch.Tensor:
    out = llm.score([IDS], ScoreParams(positions=list(range(len(IDS))), return_hidden_states=True))[0]
    return llm.engine.model.compute_logits(out.hidden_states)


def _experts_quantised(llm: LLM, formats: set[str]) -> None:
    """Every expert's gate_up and down are QuantTensors of `formats`, and stacking declines."""
    layers = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
    assert layers
    for moe in layers:
        weights = [w for e in moe.experts for w in (e.gate_up_proj.weight, e.down_proj.weight)]
        assert all(isinstance(w, QuantTensor) for w in weights)
        assert {f for w in weights for f in w.formats} <= formats
        assert not moe.stack_experts() and moe.stacked is None and not moe.use_triton
        after = [w for e in moe.experts for w in (e.gate_up_proj.weight, e.down_proj.weight)]
        assert all(a is b for a, b in zip(after, weights, strict=True))  # left as they were


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, llm: LLM) -> None:
    # any matrix with 8-bit activations (a VNNI CPU; the experts' narrow ones may not be): their
    # rounding, as test_quantized_models bounds it
    if any(w.plan.q8 for w in quantized_weights(llm.engine.model).values()):
        assert ((ours - ref).norm() / ref.norm()).item() < 0.05
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
        return
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_gguf_experts_run_in_their_blocks(tmp_path, make_llm):
    """llama.cpp's stacked experts (Q8_0, Q5_0, Q4_0 over the tensors) sliced into one matrix an
    expert, gate and up fused in their blocks: the dequantised file's logits."""
    hf = build_checkpoint(str(tmp_path / "hf"), "qwen3_moe", mlp_only_layers=[])  # llama.cpp: every layer routed
    path = write_gguf(hf, str(tmp_path / "tiny.gguf"), "qwen3moe")
    quantised, dense = make_llm(path), make_llm(path, dequantize=True)
    _experts_quantised(quantised, {"Q8_0", "Q5_0", "Q4_0"})
    expert = quantised.engine.model.layers[0].mlp.experts[5]
    assert len(expert.gate_up_proj.weight.parts) == 2  # gate's blocks, then up's: as the file has them
    _assert_close(_logits(quantised), _logits(dense), quantised)


def _int8_rounded(hf: str, out: str) -> str:
    """The checkpoint with every matrix (2-D, or stacked experts) rounded to int8 per row and back."""
    os.makedirs(out)
    tensors = load_file(os.path.join(hf, "model.safetensors"))
    for name, t in tensors.items():
        if t.dim() >= 2:
            tensors[name] = quantize_int8(t.reshape(-1, t.shape[-1]), torch.float32).dequantize().reshape(t.shape)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(hf, name), out)
    return out


def test_int8_experts_are_quantised_and_match_their_rounded_weights(tmp_path, make_llm):
    hf = build_checkpoint(str(tmp_path / "hf"), "qwen3_moe")
    # activations as they are: 8-bit ones (a VNNI CPU) move the router's input enough to pick other
    # experts (0.07 of the logits' norm), which says nothing of the weights
    int8 = make_llm(hf, quantization="int8", quant_activations="bf16")
    assert int8.engine.quantization == "int8, bf16 activations"
    _experts_quantised(int8, {"I8"})
    ours = _logits(int8)
    _assert_close(ours, _logits(make_llm(_int8_rounded(hf, str(tmp_path / "rounded")))), int8)
    ref = _logits(make_llm(hf))  # fp32: the rounded router may pick another expert (0.07 here, 0.05 dense)
    assert ((ours - ref).norm() / ref.norm()).item() < 0.1
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    with pytest.raises(ValueError, match="experts' intermediate size"):  # 32 wide: 16 a rank, no whole block
        EngineConfig.from_kwargs(model=hf, dtype="float32", quantization="int8", tensor_parallel_size=2)
