"""Load a Hugging Face directory (safetensors, sharded or not) or a GGUF file into our models:
names mapped onto local modules (q/k/v and gate/up fused), cast to the dtype and device. Tensors
outside the decoder go to `LoadedModel.extra_tensors`; an unread one inside it is an error.
`quantization`: "gguf" keeps a GGUF file's blocks, "int8" quantises per channel at load, None is
dense. A directory with `random_weights.json` (`{"seed": S}`) instead of weights draws every
tensor on the device from a generator seeded by (S, name): real shapes, noise answers.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from torch import nn

from treeserve.layers import pick_kernels
from treeserve.layers.embedding import Embedding
from treeserve.layers.group_quant import CheckpointWeight, Fp8Weight, GroupQuantWeight
from treeserve.layers.linear import Linear
from treeserve.layers.norm import GemmaRMSNorm, RMSNorm
from treeserve.layers.quant import QuantTensor, describe, quantize_int8, set_quantized
from treeserve.models.config import ModelConfig
from treeserve.models.gemma3 import Gemma3Config, Gemma3ForCausalLM
from treeserve.models.gguf_loader import GGUFCheckpoint, is_gguf
from treeserve.models.llama import LlamaForCausalLM
from treeserve.models.quantized_checkpoint import CheckpointScheme, quantized_tensors, read_scheme
from treeserve.models.qwen3_moe import Qwen3MoeForCausalLM
from treeserve.models.sharding import shard_config, shard_tensor, stage_config, stage_name

# model_type in config.json -> (config class, model class)
ARCHITECTURES: dict[str, tuple[type[ModelConfig], type[LlamaForCausalLM]]] = {
    "llama": (ModelConfig, LlamaForCausalLM),
    "mistral": (ModelConfig, LlamaForCausalLM),
    "qwen2": (ModelConfig, LlamaForCausalLM),
    "qwen3": (ModelConfig, LlamaForCausalLM),
    "qwen3_moe": (ModelConfig, Qwen3MoeForCausalLM),
    "phi3": (ModelConfig, LlamaForCausalLM),
    "gemma3_text": (Gemma3Config, Gemma3ForCausalLM),
}


QUANTIZATIONS = ("gguf", "int8")
CHECKPOINT = "checkpoint"  # a quantised checkpoint run as stored
# A tensor under these names must be one the decoder reads (never silently dropped); rope tables
# and the tied head's copy are ignorable; reward heads go to `extra_tensors`.
DECODER_PREFIXES = ("layers.", "embed_tokens.", "norm.")
RANDOM_WEIGHTS = "random_weights.json"
log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    hf_config: dict
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # e.g. "gguf:Q5_0+Q6_K+Q8_0", "int8" (+ ", bf16 activations" where set); None: dense weights
    quantization: str | None = None


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed config.json in {model_dir!r}: {e}") from e


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {model_dir!r}")
    return [os.path.join(model_dir, f) for f in files]


def iter_safetensors(model_dir: str):
    for path in safetensors_files(model_dir):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"missing weight shard {path!r}")
        try:
            handle = safe_open(path, framework="pt")
        except Exception as e:  # safetensors' own error type on corrupt headers
            raise ValueError(f"malformed safetensors file {path!r}: {e}") from e
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, f.get_tensor(name)


@contextmanager
def _skip_init():
    """Make module constructors' weight fills no-ops: we overwrite them (and the meta device's first
    fill costs seconds importing decompositions)."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    device: str | torch.device,
    quantization: str | None = None,
    quant_activations: str = "int8",
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    max_positions: int | None = None,
) -> LoadedModel:
    """`model_dir`: a Hugging Face directory or a GGUF file; `quantization` one of QUANTIZATIONS;
    `quant_activations` as layers/quant.py's ACTIVATIONS; `tp_rank`/`pp_rank` load that shard or
    stage only; `max_positions`: what the fp32 rope tables cover (None: the model's limit)."""
    if is_gguf(model_dir):
        gguf = GGUFCheckpoint(model_dir)
        hf_config, tensors = gguf.config, gguf.tensors(keep_quantized=quantization == "gguf")
    else:
        hf_config, tensors = read_hf_config(model_dir), iter_safetensors(model_dir)
    scheme = None if is_gguf(model_dir) else read_scheme(model_dir, hf_config)
    if scheme is not None:
        if quantization not in (None, CHECKPOINT):
            raise ValueError(
                f"{model_dir!r} is a {scheme.method} checkpoint: it runs its own quantisation, "
                f"not quantization={quantization!r}"
            )
        tensors = quantized_tensors(tensors, scheme)
    config = stage_config(shard_config(_config(model_dir, hf_config), tp_rank, tp_size), pp_rank, pp_size)
    model_class = ARCHITECTURES[hf_config["model_type"]][1]
    if quantization == "int8":
        check_int8_shapes(config)
    with torch.device("meta"), _skip_init():
        model = model_class(config)
    if pp_rank > 0:
        for name in ("embed_tokens", "norm", "lm_head"):
            if hasattr(model, name):
                delattr(model, name)
    seed = random_weights_seed(model_dir)
    if seed is None:
        state, extra = _collect_state(model, model_dir, tensors, dtype)
    else:
        state, extra = random_state(model, seed, dtype, device), {}
    if quantization == "int8":
        state = _quantize_int8(model, state, dtype)
    expected = set(model.state_dict().keys())
    if "lm_head.weight" in expected - set(state) and extra:
        # a reward/value model's own head
        del model.lm_head
        model.config.has_lm_head = False
        expected.discard("lm_head.weight")
    missing = expected - set(state)
    if missing:
        raise ValueError(f"checkpoint {model_dir!r} lacks tensors: {sorted(missing)[:8]}")
    for name, tensor in state.items():
        want = model.state_dict()[name].shape
        if tensor.shape != want:
            raise ValueError(
                f"tensor {name} in {model_dir!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(want)}"
            )
    for name, tensor in list(state.items()):
        if isinstance(tensor, GroupQuantWeight | Fp8Weight):
            state[name] = tensor = _checkpoint_weight(name, tensor, quantization == CHECKPOINT, dtype, device)
        if isinstance(tensor, torch.Tensor):
            continue
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(tensor, QuantTensor) and isinstance(module, Linear | Embedding):
            set_quantized(module, attr, tensor.with_activations(quant_activations))
            del state[name]
        elif isinstance(module, Linear) and not isinstance(tensor, QuantTensor):  # CUDA: as stored
            set_quantized(module, attr, tensor)
            del state[name]
        else:
            state[name] = tensor.dequantize().to(dtype)
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True)
    model.init_rope(min(max_positions or config.max_position_embeddings, config.max_position_embeddings), device)
    model.eval().requires_grad_(False)
    pick_kernels(model)
    formats = describe(model)
    label = None if formats is None else ("int8" if quantization == "int8" else f"gguf:{formats}")
    if scheme is not None:
        label = _checkpoint_label(scheme, model, quantization == CHECKPOINT)
    if label is not None and quant_activations != "int8":
        label += f", {quant_activations} activations"
    return LoadedModel(model, config, hf_config, extra, label)


def _checkpoint_weight(
    name: str, weight: CheckpointWeight, keep: bool, dtype: torch.dtype, device: str | torch.device
) -> torch.Tensor | CheckpointWeight | QuantTensor:
    """What a quantised checkpoint's layer runs as: dense when not `keep`; on a CPU the 8-bit
    kernels' blocks (FP8 dense); on CUDA as stored."""
    if not keep or (isinstance(weight, Fp8Weight) and torch.device(device).type == "cpu"):
        return weight.dequantize().to(dtype)
    if torch.device(device).type == "cpu":
        try:
            return weight.to_quant_tensor()
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
    return weight.on(torch.device(device))


def _checkpoint_label(scheme: CheckpointScheme, model: nn.Module, keep: bool) -> str:
    formats = describe(model)
    if not keep or formats is None:  # dequantize=True, or FP8 on a CPU
        return f"{scheme.label}, dequantised"
    return f"{scheme.label} as {formats}"


def random_weights_seed(model_dir: str) -> int | None:
    """The seed of a random-weights directory, else None."""
    path = os.path.join(model_dir, RANDOM_WEIGHTS)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            seed = json.load(f).get("seed", 0)
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f'{path!r} must hold a JSON object such as {{"seed": 0}}: {e}') from e
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"the seed in {path!r} must be an integer in [0, 2**31), got {seed!r}")
    return seed


def random_state(
    model: nn.Module, seed: int, dtype: torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """Every tensor `model` expects, on `device` in `dtype`: unit-gain norms, zero biases, the rest
    normal(0, 0.02), each from a generator seeded by (seed, name)."""
    gains = {
        name: 0.0 if isinstance(m, GemmaRMSNorm) else 1.0
        for name, m in model.named_modules()
        if isinstance(m, RMSNorm | GemmaRMSNorm)
    }
    state = {}
    for name, meta in model.state_dict().items():
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        module, _, attr = name.rpartition(".")
        if module in gains:
            tensor.fill_(gains[module])
        elif attr == "bias":
            tensor.zero_()
        else:
            # a CPU generator reads 32 bits of its seed
            generator = torch.Generator(device=tensor.device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
            tensor.normal_(0.0, 0.02, generator=generator)
        state[name] = tensor
    return state


def _config(model_dir: str, hf_config: dict) -> ModelConfig:
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported model_type {model_type!r} in {model_dir!r} (supported: {sorted(ARCHITECTURES)})")
    try:
        return ARCHITECTURES[model_type][0].from_hf(hf_config)
    except KeyError as e:
        raise ValueError(f"config.json in {model_dir!r} lacks required field {e}") from e


def read_model_config(model_dir: str) -> ModelConfig:
    hf_config = GGUFCheckpoint(model_dir).config if is_gguf(model_dir) else read_hf_config(model_dir)
    return _config(model_dir, hf_config)


def check_int8_shapes(config: ModelConfig) -> None:
    widths = {
        "hidden_size": config.hidden_size,
        "num_attention_heads x head_dim": config.num_heads * config.head_dim,
        "intermediate_size": config.intermediate_size,
    }
    if config.moe is not None:
        widths["moe_intermediate_size"] = config.moe.intermediate_size
    bad = {name: width for name, width in widths.items() if width % 32}
    if bad:
        raise ValueError(f"int8 quantisation needs matrix input widths that are multiples of 32, got {bad}")


def _quantize_int8(
    model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor | QuantTensor]:
    targets = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear | Embedding)}
    return {k: quantize_int8(v, dtype) if k in targets else v for k, v in state.items()}


def _collect_state(
    model: LlamaForCausalLM, model_dir: str, tensors: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    expected = set(model.state_dict().keys())
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    extra: dict[str, torch.Tensor] = {}
    for hf_name, tensor in _unstacked(tensors):
        local, part = model.hf_to_local(hf_name)
        local = stage_name(local, model.config)
        if local is None:
            continue
        if local not in expected:
            if "rotary_emb" in hf_name or (hf_name == "lm_head.weight" and model.config.tie_word_embeddings):
                continue  # a cached rope table, or the tied head's copy
            if local.startswith(DECODER_PREFIXES):
                raise ValueError(
                    f"checkpoint {model_dir!r} has tensor {hf_name!r} that {type(model).__name__} does "
                    "not read (a quantised or other-architecture checkpoint?)"
                )
            extra[hf_name] = tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()
            continue
        pieces = [(part, tensor)] if part is not None else _fused_parts(local, tensor, model)
        for part, piece in pieces:
            piece = shard_tensor(local, piece, part, model.config)
            if part is None:
                state[local] = piece.to(dtype)
            else:
                parts.setdefault(local, {})[part] = piece.to(dtype)
    for local, pieces in parts.items():
        order = model.FUSED_ORDER[local.split(".")[-2]]
        if set(pieces) != set(order):
            raise ValueError(f"checkpoint {model_dir!r} lacks {set(order) - set(pieces)} for {local}")
        state[local] = _fuse([pieces[p] for p in order], dtype)
    return state, extra


def _unstacked(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, transformers 5's stacked experts split into the Hub's per-expert names."""
    for name, tensor in tensors:
        stem, _, matrix = name.rpartition(".experts.")
        if stem and matrix in ("gate_up_proj", "down_proj") and isinstance(tensor, torch.Tensor) and tensor.dim() == 3:
            for expert, weight in enumerate(tensor):
                yield f"{stem}.experts.{expert}.{matrix}.weight", weight
        else:
            yield name, tensor


def _fused_parts(
    local: str, tensor: torch.Tensor | QuantTensor, model: LlamaForCausalLM
) -> list[tuple[str | None, torch.Tensor | QuantTensor]]:
    """A tensor as (fused part, rows) pieces: Phi-3's fused qkv / gate_up split into its parts (so a
    rank takes its slice of each, quantised blocks as views), any other as (None, tensor)."""
    module = local.split(".")[-2] if local.count(".") else local
    if module not in model.FUSED_ORDER:
        return [(None, tensor)]
    cfg = model.config
    if module == "qkv_proj":
        q = cfg.num_heads * cfg.tp_size * cfg.head_dim
        kv = (cfg.full_kv_heads or cfg.num_kv_heads) * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [tensor.shape[0] // 2] * 2
    if sum(sizes) != tensor.shape[0]:
        raise ValueError(f"fused tensor {local} has {tensor.shape[0]} rows, config.json implies {sum(sizes)}")
    return list(zip(model.FUSED_ORDER[module], _split_rows(tensor, sizes), strict=True))


def _split_rows(tensor: torch.Tensor | QuantTensor, sizes: list[int]) -> list[torch.Tensor | QuantTensor]:
    if isinstance(tensor, torch.Tensor):
        return list(tensor.split(sizes, dim=0))
    starts = [0, *itertools.accumulate(sizes)]
    return [tensor.slice_rows(start, stop) for start, stop in itertools.pairwise(starts)]


def _fuse(pieces: list[torch.Tensor | QuantTensor], dtype: torch.dtype) -> torch.Tensor | QuantTensor:
    """Row-stack q/k/v or gate/up: quantised parts stay quantised when all of them are."""
    kind = type(pieces[0])
    if kind is not torch.Tensor and all(type(p) is kind for p in pieces):
        return kind.cat(pieces)
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize().to(dtype) for p in pieces], dim=0)
