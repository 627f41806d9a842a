"""How a checkpoint and config split over tensor- and pipeline-parallel ranks (Megatron's split):
qkv/gate_up column-parallel in whole heads or rows (every routed expert alike), o/down
row-parallel (bias on rank 0, outputs all-reduced), embedding and LM head vocab-parallel, norms
replicated. Quantised matrices split in whole rows or blocks, a rank's bytes the file's. KV heads
go with q's; the config's vocabulary stays whole. Pipeline stages hold contiguous layers.
Shapes and slices only: the process groups are `distributed/`'s.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from treeserve.layers.quant import QuantTensor
from treeserve.models.config import ModelConfig

ROW_PARALLEL = ("o_proj", "down_proj")  # everything else fused splits along its output


def check_divisible(cfg: ModelConfig, size: int, vocab_size: int) -> None:
    """Refuse a split that does not come out whole, before any weight loads; fewer KV heads than
    ranks are replicated (vLLM's rule) when the ranks are a multiple of them."""
    counts = {"attention heads": cfg.num_heads, "intermediate size": cfg.intermediate_size, "vocabulary": vocab_size}
    if cfg.moe is not None:
        counts["experts' intermediate size"] = cfg.moe.intermediate_size
    bad = [f"{name} {value}" for name, value in counts.items() if value % size]
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        bad.insert(1, f"KV heads {cfg.num_kv_heads} (or be a multiple of them)")
    if bad:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {', '.join(bad)}")


def kv_head_of(rank: int, size: int, num_kv_heads: int) -> int | None:
    """The one KV head rank `rank` holds when KV heads are replicated (fewer than ranks), else None."""
    return rank * num_kv_heads // size if num_kv_heads < size else None


def shard_config(cfg: ModelConfig, rank: int, size: int) -> ModelConfig:
    if size == 1:
        return cfg
    check_divisible(cfg, size, cfg.vocab_size)
    moe = None if cfg.moe is None else replace(cfg.moe, intermediate_size=cfg.moe.intermediate_size // size)
    return replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(cfg.num_kv_heads // size, 1),
        intermediate_size=cfg.intermediate_size // size,
        moe=moe,
        tp_rank=rank,
        tp_size=size,
        full_kv_heads=cfg.num_kv_heads,
    )


def stage_layers(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """(first layer, count) of stage `rank`: the later stages a layer more when uneven."""
    base, extra = divmod(num_layers, size)
    counts = [base + (s >= size - extra) for s in range(size)]
    return sum(counts[:rank]), counts[rank]


def check_stages(cfg: ModelConfig, size: int) -> None:
    if cfg.num_layers < size:
        raise ValueError(f"pipeline_parallel_size={size} is more than the model's {cfg.num_layers} layers")


def stage_config(cfg: ModelConfig, rank: int, size: int) -> ModelConfig:
    if size == 1:
        return cfg
    check_stages(cfg, size)
    first, count = stage_layers(cfg.num_layers, rank, size)
    return replace(
        cfg,
        num_layers=count,
        layer_windows=cfg.layer_windows[first : first + count],
        pp_rank=rank,
        pp_size=size,
        first_layer=first,
    )


def stage_name(name: str, cfg: ModelConfig) -> str | None:
    """A tensor's name on `cfg`'s stage (its layer renumbered), or None when the stage lacks it."""
    if cfg.pp_size == 1:
        return name
    if name.startswith("layers."):
        index, rest = name[len("layers.") :].split(".", 1)
        local = int(index) - cfg.first_layer
        return f"layers.{local}.{rest}" if 0 <= local < cfg.num_layers else None
    return name if cfg.pp_rank == 0 else None  # the embedding, final norm and LM head live on stage 0


def shard_tensor(
    name: str, tensor: torch.Tensor | QuantTensor, part: str | None, cfg: ModelConfig
) -> torch.Tensor | QuantTensor:
    """Rank `cfg.tp_rank`'s slice of checkpoint tensor `name` (a fused module's `part`, or whole)."""
    rank, size = cfg.tp_rank, cfg.tp_size
    if size == 1:
        return tensor
    module = name.rsplit(".", 2)[-2] if "." in name else name
    replicated = kv_head_of(rank, size, cfg.full_kv_heads)
    if part in ("k_proj", "v_proj") and replicated is not None:  # this rank's copy of one KV head
        return _rows(tensor, replicated * cfg.head_dim, (replicated + 1) * cfg.head_dim)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")) or part is not None:
        rows = tensor.shape[0] // size
        return _rows(tensor, rank * rows, (rank + 1) * rows)
    if module in ROW_PARALLEL:
        if name.endswith(".bias"):
            return tensor if rank == 0 else torch.zeros_like(tensor)
        cols = tensor.shape[1] // size
        if not isinstance(tensor, torch.Tensor):  # quantised: whole blocks or groups
            return tensor.slice_columns(rank * cols, (rank + 1) * cols)
        return tensor[:, rank * cols : (rank + 1) * cols].contiguous()
    return tensor  # replicated


def _rows(tensor: torch.Tensor | QuantTensor, start: int, stop: int) -> torch.Tensor | QuantTensor:
    if not isinstance(tensor, torch.Tensor):
        return tensor.slice_rows(start, stop)
    return tensor[start:stop].contiguous()


def check_whole_blocks(blocks: dict[str, tuple[int, str, int]], size: int) -> None:
    """Refuse a split that cuts a quantised row-parallel matrix's blocks: `blocks` maps a name to
    (input width, format, weights a block)."""
    worst: dict[str, tuple[int, str, int]] = {}
    for name, (cols, qformat, block) in blocks.items():
        module = name.rsplit(".", 2)[-2] if "." in name else name
        if module in ROW_PARALLEL and (cols // size) % block and block > worst.get(module, (0, "", 0))[2]:
            worst[module] = (cols, qformat, block)
    if worst:
        bad = [
            f"{module}'s {cols} inputs / {size} = {cols // size} a rank, not whole {qformat} blocks of {block}"
            for module, (cols, qformat, block) in sorted(worst.items())
        ]
        raise ValueError(
            f"tensor_parallel_size={size} would cut quantised blocks: {'; '.join(bad)} (a rank "
            "multiplies whole blocks of its input columns; load dense with dequantize=True, or use "
            "another size)"
        )
