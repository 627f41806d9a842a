"""Quantised checkpoints written for tests: compressed-tensors files by compressed-tensors itself,
AWQ files packed in AutoAWQ's GEMM layout (AutoAWQ needs CUDA to write them).

`write_compressed_tensors` applies one of compressed-tensors' preset schemes ("W4A16",
"W4A16_ASYM", "W8A16", "W8A8", "FP8", "FP8_DYNAMIC") to a dense checkpoint, computes each weight's
scales and zero points data-free from its min and max (llm-compressor's min-max observer, which
needs no calibration set for weights), compresses with `ModelCompressor` and saves as
llm-compressor does. `write_awq` rounds each decoder linear layer to 4 bits with zero points
in groups (the integer codes AWQ stores; AWQ's activation-aware scaling changes which codes, not
the layout) and packs them as AutoAWQ's `WQLinear_GEMM.from_linear` does.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble j of a word holds column AWQ_PACK_ORDER[j] of its 8
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _copy_side_files(src: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(src, name), out)


def write_compressed_tensors(
    src: str, out: str, scheme_name: str, group_size: int = 32, ignore: tuple[str, ...] = ("lm_head",)
) -> str:
    """`src`'s model quantised with compressed-tensors' preset `scheme_name` (its groups of
    `group_size` columns: the presets' 128 is wider than the tiny models), saved to `out`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()  # the source's dtype, as llm-compressor
    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    if scheme.weights.strategy == "group":
        scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight
            if args.strategy == "group":
                view = w.reshape(w.shape[0], -1, args.group_size)
                low, high = view.amin(-1), view.amax(-1)
            elif args.strategy == "channel":
                low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
            else:
                low, high = w.amin().reshape(1), w.amax().reshape(1)
            scale, zero = calculate_qparams(low, high, args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape
                )
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_side_files(src, out)
    return out


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] of 4-bit codes [rows, cols] in AutoAWQ's column order."""
    rows, cols = codes.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int32)
    grouped = codes.to(torch.int32).reshape(rows, cols // 8, 8)
    for j, column in enumerate(AWQ_PACK_ORDER):
        packed |= grouped[:, :, column] << (4 * j)
    return packed


def awq_round(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [n, k], fp16 scales [groups, n], zeros [groups, n]) of an [n, k] weight, AWQ's min-max rounding."""
    n, k = weight.shape
    view = weight.float().reshape(n, k // group, group)
    low, high = view.amin(-1).clamp(max=0), view.amax(-1).clamp(min=0)
    scales = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
    zeros = (-low / scales.float()).round().clamp(0, 15)
    codes = (view / scales.float().unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, 15)
    return codes.reshape(n, k).to(torch.int32), scales.t().contiguous(), zeros.t().to(torch.int32).contiguous()


def write_awq(src: str, out: str, group: int = 32) -> dict[str, torch.Tensor]:
    """`src` as an AutoAWQ GEMM checkpoint in `out`; returns each layer's dequantised weight [n, k]."""
    state = load_file(os.path.join(src, "model.safetensors"))
    written, reference = {}, {}
    for name, tensor in state.items():
        module, _, suffix = name.rpartition(".")
        if suffix != "weight" or module.rpartition(".")[2] not in LINEARS:
            written[name] = tensor
            continue
        codes, scales, zeros = awq_round(tensor, group)
        written[f"{module}.qweight"] = awq_pack(codes.t().contiguous())  # [k, n / 8]: inputs are rows
        written[f"{module}.qzeros"] = awq_pack(zeros)  # [groups, n / 8]
        written[f"{module}.scales"] = scales  # [groups, n]
        g = torch.arange(tensor.shape[1]) // group
        reference[module] = scales.float().t()[:, g] * (codes - zeros.t()[:, g]).float()
    os.makedirs(out, exist_ok=True)
    save_file(written, os.path.join(out, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    _copy_side_files(src, out)
    return reference
