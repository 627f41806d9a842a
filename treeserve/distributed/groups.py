"""The process groups a parallel model's ranks meet in (`RankGroup`: its own gloo or NCCL group
from a TCP store, so a process may hold several models) and where a rank sits (`Placement`)."""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class RankGroup:
    """A pipeline stage's tensor shards, or a shard's stages."""

    rank: int
    size: int
    group: Any
    wait_s: float = 0.0  # in collectives and receives, waiting included

    @classmethod
    def join(cls, store: Any, name: str, rank: int, size: int, device: torch.device, timeout_s: float) -> RankGroup:
        """A collective that waits longer than `timeout_s` (a rank died or hangs) raises."""
        timeout, store = datetime.timedelta(seconds=timeout_s), dist.PrefixStore(name, store)
        if device.type == "cuda":  # untested on more than one GPU
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return cls(rank, size, dist.ProcessGroupNCCL(store, rank, size, options))
        return cls(rank, size, dist.ProcessGroupGloo(store, rank, size, timeout))

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
        return self.group.send([x.contiguous()], dst, 0)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        self._wait(self.group.recv([out], src, 0))
        return out

    def _wait(self, work: Any) -> None:
        start = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - start


@dataclass
class Placement:
    """Global rank `rank` of tp_size x pp_size (vLLM's order: a stage's shards are consecutive)."""

    rank: int
    tp_size: int
    pp_size: int
    tp: RankGroup | None = None
    pp: RankGroup | None = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    def connect(self, host: str, port: int, device: torch.device, timeout_s: float) -> Placement:
        size = self.tp_size * self.pp_size
        store = dist.TCPStore(host, port, size, is_master=self.rank == 0, timeout=datetime.timedelta(seconds=timeout_s))
        if self.tp_size > 1:  # every rank joins tp first: no rank waits on a later join
            self.tp = RankGroup.join(store, f"tp{self.pp_rank}", self.tp_rank, self.tp_size, device, timeout_s)
        if self.pp_size > 1:
            self.pp = RankGroup.join(store, f"pp{self.tp_rank}", self.pp_rank, self.pp_size, device, timeout_s)
        return self

    @property
    def wait_s(self) -> float:
        return sum(g.wait_s for g in (self.tp, self.pp) if g is not None)
