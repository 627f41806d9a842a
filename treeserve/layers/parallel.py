"""Tensor parallelism: the collectives of one model's ranks, and how its checkpoint splits k ways.

Owns `TPGroup` (one model's ranks: a process group of their own, built from a TCP store, so a
process may hold several models at different sizes: gloo on a CPU, NCCL on CUDA) and the split
(Megatron's), for rank r of k:

- qkv_proj, gate_up_proj: column-parallel, each fused part (q, k, v; gate, up) cut into k
  slices of whole heads (q: num_heads / k, k and v: num_kv_heads / k) or intermediate rows;
- o_proj, down_proj: row-parallel (the rank's input columns), bias on rank 0 only; their
  outputs are all-reduced (`TPGroup.all_reduce`), once per block;
- embed_tokens: vocab-parallel (rows [r V/k, (r+1) V/k)); ids outside the slice look up
  zeros, and the sum over ranks is the row;
- lm_head (or the tied table): vocab-parallel; logits are gathered along the vocabulary;
- norms and q/k norms: replicated.

KV heads are split with q's, so each rank's arena holds its heads. `shard_config` gives a
rank's config (heads, KV heads and intermediate size divided); the vocabulary stays whole in
the config (requests are checked against it) and the two tables take `vocab_size // k` rows.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from treeserve.models.llama import LlamaConfig

ROW_PARALLEL = ("o_proj", "down_proj")  # split along their input; everything else fused is split along its output


@dataclass
class TPGroup:
    rank: int
    size: int
    group: Any  # a torch.distributed ProcessGroup (gloo or NCCL)
    wait_s: float = 0.0  # seconds this rank spent in collectives and receives (waiting included)

    @classmethod
    def connect(cls, rank: int, size: int, port: int, device: torch.device, timeout_s: float) -> TPGroup:
        """Join (rank 0: host) the group of `size` ranks that meet at 127.0.0.1:`port`; a
        collective that waits longer than `timeout_s` (a rank died or hangs) raises."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timeout)
        if device.type == "cuda":  # unmeasured: this workplace lends one GPU at a time
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
        return cls(rank, size, group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (bf16 and fp16 summed in fp32 and rounded once)."""
        wide = x if x.dtype == torch.float32 or x.device.type == "cuda" else x.float()
        self._wait(self.group.allreduce([wide]))
        if wide is not x:
            x.copy_(wide)
        return x

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, V/k] per rank -> [rows, V], the ranks' slices in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._wait(self.group.allgather([parts], [x]))
        return torch.cat(parts, dim=-1)

    def isend(self, x: torch.Tensor, dst: int) -> Any:
        """Start sending `x` to rank `dst` (a pipeline stage's activations); wait() on the result."""
        return self.group.send([x.contiguous()], dst, 0)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        self._wait(self.group.recv([out], src, 0))
        return out

    def _wait(self, work: Any) -> None:
        start = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - start



def check_divisible(cfg: LlamaConfig, size: int, vocab_size: int) -> None:
    """Refuse a split that does not come out whole, naming the numbers (before any weight loads).
    Fewer KV heads than ranks are replicated (vLLM's rule) when the ranks are a multiple of them."""
    counts = {"attention heads": cfg.num_heads, "intermediate size": cfg.intermediate_size, "vocabulary": vocab_size}
    bad = [f"{name} {value}" for name, value in counts.items() if value % size]
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        bad.insert(1, f"KV heads {cfg.num_kv_heads} (or be a multiple of them)")
    if bad:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {', '.join(bad)}")


def kv_head_of(rank: int, size: int, num_kv_heads: int) -> int | None:
    """The one KV head rank `rank` holds when KV heads are replicated (fewer than ranks), else None."""
    return rank * num_kv_heads // size if num_kv_heads < size else None


def shard_config(cfg: LlamaConfig, rank: int, size: int) -> LlamaConfig:
    """Rank `rank`'s config: its heads, KV heads and intermediate rows (vocabulary whole)."""
    if size == 1:
        return cfg
    check_divisible(cfg, size, cfg.vocab_size)
    return replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(cfg.num_kv_heads // size, 1),
                   intermediate_size=cfg.intermediate_size // size, tp_rank=rank, tp_size=size,
                   full_kv_heads=cfg.num_kv_heads)  # fmt: skip


def stage_layers(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """(first layer, count) of pipeline stage `rank` of `size`: contiguous, the later stages one
    layer more when the split is uneven (stage 0 also embeds, norms and samples)."""
    base, extra = divmod(num_layers, size)
    counts = [base + (s >= size - extra) for s in range(size)]
    return sum(counts[:rank]), counts[rank]


def check_stages(cfg: LlamaConfig, size: int) -> None:
    """Refuse more pipeline stages than layers (before any weight loads)."""
    if cfg.num_layers < size:
        raise ValueError(f"pipeline_parallel_size={size} is more than the model's {cfg.num_layers} layers")


def stage_config(cfg: LlamaConfig, rank: int, size: int) -> LlamaConfig:
    """Stage `rank`'s config: its layers (num_layers, layer_windows) and where they start."""
    if size == 1:
        return cfg
    check_stages(cfg, size)
    first, count = stage_layers(cfg.num_layers, rank, size)
    return replace(cfg, num_layers=count, layer_windows=cfg.layer_windows[first : first + count], pp_rank=rank,
                   pp_size=size, first_layer=first)  # fmt: skip


def stage_name(name: str, cfg: LlamaConfig) -> str | None:
    """A checkpoint tensor's local name on `cfg`'s pipeline stage (its layer renumbered), or None
    when the stage does not hold it."""
    if cfg.pp_size == 1:
        return name
    if name.startswith("layers."):
        index, rest = name[len("layers.") :].split(".", 1)
        local = int(index) - cfg.first_layer
        return f"layers.{local}.{rest}" if 0 <= local < cfg.num_layers else None
    return name if cfg.pp_rank == 0 else None  # the embedding, final norm and LM head live on stage 0


def shard_tensor(name: str, tensor: torch.Tensor, part: str | None, cfg: LlamaConfig) -> torch.Tensor:
    """Rank `cfg.tp_rank`'s slice of checkpoint tensor `name` (a fused module's `part`, or whole)."""
    rank, size = cfg.tp_rank, cfg.tp_size
    if size == 1:
        return tensor
    module = name.rsplit(".", 2)[-2] if "." in name else name
    replicated = kv_head_of(rank, size, cfg.full_kv_heads)
    if part in ("k_proj", "v_proj") and replicated is not None:  # this rank's copy of one KV head
        return tensor[replicated * cfg.head_dim : (replicated + 1) * cfg.head_dim].contiguous()
    if name.endswith(("embed_tokens.weight", "lm_head.weight")) or part is not None:
        return tensor.chunk(size, dim=0)[rank].contiguous()  # vocab rows, or a part's heads / rows
    if module in ROW_PARALLEL:
        if name.endswith(".bias"):
            return tensor if rank == 0 else torch.zeros_like(tensor)
        return tensor.chunk(size, dim=1)[rank].contiguous()
    return tensor  # norms: replicated


def vocab_parallel_lookup(lookup: Any, ids: torch.Tensor, table: Any, rows: int, tp: TPGroup) -> torch.Tensor:
    """Rows of a table split by vocabulary (`rows` of them here): this rank's rows, zeros
    elsewhere, summed over ranks."""
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    out = lookup(local.clamp(0, rows - 1), table)
    out[outside] = 0
    return tp.all_reduce(out)
