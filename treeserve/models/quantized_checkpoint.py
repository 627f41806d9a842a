"""Quantised Hugging Face checkpoints: GPTQ, AWQ and compressed-tensors, read in their own layouts.

`read_scheme` reads `config.json`'s `quantization_config` (or a GPTQ `quantize_config.json`)
and refuses, naming what it found and what is supported, any method, bit width, group size or
layout treeserve does not run. `quantized_tensors` turns the checkpoint's tensors into the
canonical weights of `layers/group_quant.py`, one a linear layer, from each library's layout:

- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [k * bits / 32, n], input rows packed low bits
  first; `qzeros` int32 [groups, n * bits / 32], output columns packed the same way, stored minus
  one in the original ("gptq", v1) format and as they are in "gptq_v2"; `scales` fp16
  [groups, n]; `g_idx` int32 [k], each input's group (act-order when it is not i // group_size).
- AWQ (AutoAWQ, GEMM): `qweight` int32 [k, n / 8] and `qzeros` int32 [groups, n / 8], output
  columns packed in the order 0 2 4 6 1 3 5 7; `scales` fp16 [groups, n]; zeros as they are.
- compressed-tensors (llm-compressor): "pack-quantized" `weight_packed` int32 [n, k * bits / 32]
  (element i at bit i * bits, codes offset by 2^(bits-1)), `weight_scale` [n, groups] (or [n, 1],
  [1]), `weight_shape`, `weight_zero_point` packed along the output channels when asymmetric,
  `weight_g_idx` for act-order; "int-quantized" int8 `weight` with `weight_scale`;
  "float-quantized" float8_e4m3fn `weight` with `weight_scale`. Static activation scales
  (`input_scale`, `input_zero_point`) are read and checked, not used: the kernels quantise
  activations per row or block as they go (docs/decisions.md). Modules in `ignore` stay dense.

A quantised layer's tensors are buffered until its set is whole, then yielded as one
`<module>.weight`; a tensor of a quantised layer that is not in its format's set is an error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from treeserve.layers.group_quant import CheckpointWeight, Fp8Weight, GroupQuantWeight

# AutoAWQ packs output column [0, 2, 4, 6, 1, 3, 5, 7][j] of each 8 into nibble j: column c is nibble AWQ_ORDER[c]
AWQ_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
SUPPORTED = (
    "GPTQ 4/8-bit (groups of a multiple of 32 or per channel, act-order, symmetric or not, gptq and "
    "gptq_v2 formats), AWQ 4-bit GEMM, compressed-tensors pack-quantized 4/8-bit, int-quantized "
    "8-bit (W8A8 / W8A16) and float-quantized FP8 e4m3 (per-tensor or per-channel)"
)
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
# the linear layers of the families treeserve runs, by their checkpoint names' last part ("gate": a MoE router)
LINEAR_NAMES = {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "qkv_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "gate_up_proj",
    "gate",
    "lm_head",
}
DECODER_LAYERS = r"re:.*\blayers\.\d+\."  # GPTQ and AWQ quantise the decoder layers' linear layers


@dataclass
class WeightScheme:
    """How one linear layer's weight is stored."""

    format: str  # "gptq" | "awq" | one of CT_FORMATS
    bits: int
    group_size: int | None  # None: one group a row (per channel) or per tensor
    symmetric: bool = True
    activations: str = "none"  # "none" | "int8" | "fp8": what the checkpoint quantises inputs to
    static_activations: bool = False  # input_scale tensors in the file
    zeros_minus_one: bool = False  # GPTQ v1: qzeros stored as zero - 1
    act_order: bool = False  # compressed-tensors actorder="group": weight_g_idx tensors

    def tensor_names(self) -> tuple[set[str], set[str]]:
        """(the suffixes a layer's set needs, the ones it may also have)."""
        if self.format == "gptq":
            return {"qweight", "qzeros", "scales"}, {"g_idx"}
        if self.format == "awq":
            return {"qweight", "qzeros", "scales"}, set()
        need = {"weight_packed", "weight_shape"} if self.format == "pack-quantized" else {"weight"}
        need.add("weight_scale")
        if not self.symmetric:
            need.add("weight_zero_point")
        if self.act_order:
            need.add("weight_g_idx")
        optional = {"input_scale", "input_zero_point"} if self.static_activations else set()
        return need, optional


@dataclass
class CheckpointScheme:
    """A checkpoint's quantisation: which layers hold which `WeightScheme`."""

    method: str  # "gptq" | "awq" | "compressed-tensors"
    groups: list[tuple[list[str], WeightScheme]]  # (targets, scheme), compressed-tensors' config_groups
    ignore: list[str] = field(default_factory=list)

    def for_module(self, module: str) -> WeightScheme | None:
        """The scheme of linear layer `module` (its checkpoint name), None where it stays dense."""
        if module.rpartition(".")[2] not in LINEAR_NAMES or any(_matches(p, module) for p in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(t, module) for t in targets):
                return scheme
        return None

    @property
    def label(self) -> str:
        schemes = {s.format + f":w{s.bits}" + ("a8" if s.activations != "none" else "a16") for _, s in self.groups}
        return f"{self.method}({', '.join(sorted(schemes))})"


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if pattern == "Linear":  # compressed-tensors' class target: every linear layer
        return True
    return module == pattern or module.endswith("." + pattern)


def read_scheme(model_dir: str, hf_config: dict) -> CheckpointScheme | None:
    """The checkpoint's quantisation, None for a dense checkpoint; a ValueError for one treeserve
    does not run, naming what was found and what is supported."""
    config = hf_config.get("quantization_config")
    legacy = os.path.join(model_dir, "quantize_config.json")
    if config is None and os.path.isfile(legacy):
        with open(legacy) as f:
            config = {"quant_method": "gptq", **json.load(f)}
    if not config:
        return None
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(config)
    if method == "awq":
        return _awq(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    raise ValueError(f"quantization_config quant_method={method!r} is not supported; treeserve runs {SUPPORTED}")


def _refuse(what: str) -> ValueError:
    return ValueError(f"quantization_config: {what} is not supported; treeserve runs {SUPPORTED}")


def _group(value: object, method: str) -> int | None:
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value % 32:
        raise _refuse(f"{method} group_size={value!r} (the CPU blocks take multiples of 32)")
    return value


def _gptq(config: dict) -> CheckpointScheme:
    bits = config.get("bits")
    if bits not in (4, 8):
        raise _refuse(f"GPTQ bits={bits!r}")
    fmt = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format={fmt!r}")
    if config.get("pack_dtype", "int32") != "int32":
        raise _refuse(f"GPTQ pack_dtype={config['pack_dtype']!r}")
    if config.get("dynamic") or config.get("lm_head"):
        raise _refuse("GPTQ per-module overrides (dynamic) or a quantised lm_head")
    scheme = WeightScheme(
        "gptq",
        bits,
        _group(config.get("group_size", 128), "GPTQ"),
        bool(config.get("sym", True)),
        zeros_minus_one=fmt == "gptq",
    )
    return CheckpointScheme("gptq", [([DECODER_LAYERS], scheme)])


def _awq(config: dict) -> CheckpointScheme:
    bits, version = config.get("bits", config.get("w_bit")), str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise _refuse(f"AWQ bits={bits!r} version={version!r} (only 4-bit GEMM)")
    if not config.get("zero_point", True):
        raise _refuse("AWQ without zero points")
    group = _group(config.get("group_size", config.get("q_group_size", 128)), "AWQ")
    ignore = list(config.get("modules_to_not_convert") or [])
    return CheckpointScheme("awq", [([DECODER_LAYERS], WeightScheme("awq", 4, group, False))], ignore)


def _compressed_tensors(config: dict) -> CheckpointScheme:
    if config.get("sparsity_config") or config.get("transform_config"):
        raise _refuse("compressed-tensors sparsity or transforms")
    if config.get("kv_cache_scheme"):
        raise _refuse("a compressed-tensors kv_cache_scheme (use kv_cache_dtype='fp8_e4m3')")
    default_format = config.get("format")
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        fmt = group.get("format") or default_format
        if fmt not in CT_FORMATS:
            raise _refuse(f"compressed-tensors format={fmt!r} (group {name})")
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        if group.get("output_activations"):
            raise _refuse(f"compressed-tensors output activation quantisation (group {name})")
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if strategy not in ("group", "channel", "tensor"):
            raise _refuse(f"compressed-tensors weight strategy={strategy!r} (group {name})")
        if (kind, fmt == "float-quantized") not in (("int", False), ("float", True)):
            raise _refuse(f"compressed-tensors {kind} weights in format {fmt!r} (group {name})")
        if bits not in ((8,) if kind == "float" else (4, 8)) or (fmt != "pack-quantized" and bits != 8):
            raise _refuse(f"compressed-tensors {bits}-bit {kind} weights in format {fmt!r} (group {name})")
        group_size = _group(weights.get("group_size"), "compressed-tensors") if strategy == "group" else None
        if strategy == "group" and group_size is None:
            raise _refuse(f"compressed-tensors group strategy without a group_size (group {name})")
        activations, static = "none", False
        if inputs:
            if inputs.get("num_bits") != 8 or inputs.get("strategy") not in ("token", "tensor"):
                raise _refuse(f"compressed-tensors input activations {inputs} (group {name})")
            activations = "fp8" if inputs.get("type") == "float" else "int8"
            static = not inputs.get("dynamic", False)
        actorder = weights.get("actorder")
        scheme = WeightScheme(
            fmt,
            bits,
            group_size,
            bool(weights.get("symmetric", True)),
            activations,
            static,
            act_order=actorder == "group",
        )
        groups.append((list(group.get("targets") or []), scheme))
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    return CheckpointScheme("compressed-tensors", groups, list(config.get("ignore") or []))


def quantized_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], scheme: CheckpointScheme
) -> Iterator[tuple[str, torch.Tensor | CheckpointWeight]]:
    """The checkpoint's tensors with each quantised layer's set replaced by one `<module>.weight`."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, suffix = name.rpartition(".")
        layer = scheme.for_module(module) if module else None
        need, optional = layer.tensor_names() if layer else (set(), set())
        if layer is None or suffix not in need | optional:
            if layer is not None and suffix != "bias":
                raise ValueError(
                    f"checkpoint tensor {name!r}: a {layer.format} layer has no {suffix!r} "
                    f"(its tensors: {sorted(need | optional)})"
                )
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        if suffix in parts:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        parts[suffix] = tensor
        if need | optional <= set(parts):
            yield f"{module}.weight", read_layer(module, pending.pop(module), layer)
    for module, parts in pending.items():  # whole but for optional tensors (a GPTQ file without g_idx)
        layer = scheme.for_module(module)
        assert layer is not None
        missing = layer.tensor_names()[0] - set(parts)
        if missing:
            raise ValueError(f"quantised layer {module!r} lacks {sorted(missing)} ({layer.format})")
        yield f"{module}.weight", read_layer(module, parts, layer)


def read_layer(module: str, parts: dict[str, torch.Tensor], layer: WeightScheme) -> CheckpointWeight:
    """One linear layer's weight from its tensors in `layer`'s format."""
    if layer.format == "gptq":
        return _read_gptq(module, parts, layer)
    if layer.format == "awq":
        return _read_awq(module, parts)
    static = parts.get("input_scale")  # checked, not used: the kernels scale activations as they go
    if static is not None and not bool(torch.isfinite(static.float()).all() and (static > 0).all()):
        raise ValueError(f"{module}.input_scale holds a non-positive or non-finite scale")
    scale = parts["weight_scale"].float()
    if layer.format == "float-quantized":
        weight = parts["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{module}.weight is {weight.dtype}, a float-quantized layer's is float8_e4m3fn")
        return Fp8Weight(weight, _row_scales(module, scale, weight.shape[0]))
    if layer.format == "pack-quantized":
        shape = [int(v) for v in parts["weight_shape"].tolist()]
        codes = _unpack_rows(parts["weight_packed"], layer.bits, shape[1], f"{module}.weight_packed")
        if list(codes.shape) != shape:
            raise ValueError(f"{module}.weight_packed unpacks to {list(codes.shape)}, weight_shape says {shape}")
    else:
        weight = parts["weight"]
        if weight.dtype != torch.int8:
            raise ValueError(f"{module}.weight is {weight.dtype}, an int-quantized layer's is int8")
        codes = (weight.to(torch.int16) + 128).to(torch.uint8)
    n, k = codes.shape
    group = layer.group_size or k
    scales = scale.reshape(n, -1) if scale.numel() != 1 else scale.reshape(1, 1).expand(n, 1)
    zeros = None
    if not layer.symmetric:
        offset = 1 << (layer.bits - 1)
        zp = parts["weight_zero_point"]
        if layer.format == "pack-quantized":  # packed along the output channels
            zp = _unpack_rows(zp.t().contiguous(), layer.bits, n, f"{module}.weight_zero_point").t()
        else:
            zp = zp.to(torch.int16) + offset
        zeros = zp.reshape(n, -1).to(torch.uint8)
    order = _act_order(module, parts["weight_g_idx"], group) if layer.act_order else None
    if order is not None:
        codes = codes[:, order]
    activations = "int8" if layer.activations == "int8" else "weights-only"
    return _group_weight(module, codes, layer.bits, scales, zeros, group, k, order, activations)


def _group_weight(
    module: str,
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    k: int,
    order: torch.Tensor | None,
    activations: str,
) -> GroupQuantWeight:
    n = codes.shape[0]
    if k % group or scales.shape != (n, k // group) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError(f"{module}: scales {tuple(scales.shape)} do not fit a [{n}, {k}] weight in groups of {group}")
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    return GroupQuantWeight(packed.contiguous(), bits, scales.contiguous(), zeros, group, k, order, activations)


def _row_scales(module: str, scale: torch.Tensor, n: int) -> torch.Tensor:
    if scale.numel() == 1:
        return scale.reshape(1).expand(n).contiguous()
    if scale.numel() != n:
        raise ValueError(f"{module}.weight_scale has {scale.numel()} values: per-tensor or per-channel ({n}) only")
    return scale.reshape(n).contiguous()


def _unpack_rows(packed: torch.Tensor, bits: int, cols: int, what: str) -> torch.Tensor:
    """uint8 [rows, cols] of int32 words packing `bits`-bit values along each row, low bits first
    (`what`: the tensor, for the error)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(packed.shape[0], packed.shape[1] * per_word)
    if values.shape[1] < cols:
        raise ValueError(f"{what}: its packed rows hold {values.shape[1]} values, its shapes say {cols}")
    return values[:, :cols].to(torch.uint8)


def _act_order(module: str, g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input order that makes `g_idx`'s groups contiguous (None when they are already)."""
    g_idx = g_idx.to(torch.int64)
    k = g_idx.numel()
    expected = torch.arange(k) // group
    if torch.equal(g_idx, expected):
        return None
    order = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[order], expected):
        raise ValueError(f"{module} g_idx does not put {group} inputs in each group")
    return order


def _read_gptq(module: str, parts: dict[str, torch.Tensor], layer: WeightScheme) -> GroupQuantWeight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    bits, per_word = layer.bits, 32 // layer.bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    codes = _unpack_rows(qweight.t().contiguous(), bits, k, f"{module}.qweight")  # [n, k]
    zeros = _unpack_rows(qzeros, bits, n, f"{module}.qzeros").t().to(torch.int16)  # [n, groups]
    if layer.zeros_minus_one:
        zeros = zeros + 1
    if int(zeros.max()) > 255:
        raise ValueError(f"{module}.qzeros: a zero point of {int(zeros.max())} does not fit 8 bits")
    group = layer.group_size or k
    order = _act_order(module, parts["g_idx"], group) if "g_idx" in parts else None
    if order is not None:
        codes = codes[:, order]
    return _group_weight(module, codes, bits, scales.t(), zeros.to(torch.uint8), group, k, order, "weights-only")


def _read_awq(module: str, parts: dict[str, torch.Tensor]) -> GroupQuantWeight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    k, n = qweight.shape[0], qweight.shape[1] * 8
    reorder = lambda t: t.reshape(t.shape[0], -1, 8)[:, :, AWQ_ORDER].reshape(t.shape[0], -1)  # noqa: E731
    codes = reorder(_unpack_rows(qweight, 4, n, f"{module}.qweight")).t()  # [n, k]
    zeros = reorder(_unpack_rows(qzeros, 4, n, f"{module}.qzeros")).t()  # [n, groups]
    group = k // scales.shape[0]
    return _group_weight(module, codes, 4, scales.t(), zeros.contiguous(), group, k, None, "weights-only")
