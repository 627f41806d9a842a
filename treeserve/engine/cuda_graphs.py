"""CUDA graphs for decode-only steps: the model's forward captured once per batch-size bucket.

A decode step of B sequences replays the graph of the smallest bucket >= B on static inputs
(one packed copy); rows B.. are padding that touches no page a sequence holds, so a real row's
bits do not depend on them. Other steps, parallel models and non-Triton backends run eagerly.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from treeserve.engine.attention import AttentionBatch, SeqGroup
from treeserve.engine.forward_batch import ForwardBatch, attention_inputs

MAX_CAPTURE = 512
PAD_PAGE = -1  # a padding row's KV slot: the store skips it


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """The buckets for `max_num_seqs`: `sizes` (cut to max_num_seqs), else vLLM's list."""
    if sizes is not None:
        return sorted({min(s, max_num_seqs) for s in sizes})
    limit = min(max_num_seqs, MAX_CAPTURE)
    steps = [1, 2, 4, 8, *range(16, 257, 8), *range(272, limit + 1, 16)]
    return sorted({s for s in steps if s <= limit} | {limit})


def graphs_apply(device: torch.device, backend: str, enforce_eager: bool, parallel: bool) -> bool:
    """Whether an engine captures decode graphs: on CUDA, with the Triton backend, one rank."""
    return device.type == "cuda" and backend == "triton" and not enforce_eager and not parallel


@dataclass
class StaticInputs:
    """The graphs' inputs at fixed addresses: views of one flat int64 device buffer (one copy fills it)."""

    rows: int
    width: int  # page table columns: the widest a sequence can have, so one graph serves every length
    flat: torch.Tensor  # [rows * (5 + width)]

    @classmethod
    def allocate(cls, rows: int, width: int, device: torch.device) -> StaticInputs:
        return cls(rows, width, torch.zeros(rows * (5 + width), dtype=torch.int64, device=device))

    def field(self, index: int) -> torch.Tensor:
        """0 tokens, 1 positions, 2 slot pages, 3 slot offsets, 4 context lengths ([rows] each)."""
        return self.flat[index * self.rows : (index + 1) * self.rows]

    @property
    def tables(self) -> torch.Tensor:
        return self.flat[5 * self.rows :].view(self.rows, self.width)

    def pack(self, batch: ForwardBatch, page_size: int, bucket: int) -> np.ndarray:
        """`batch` (at most `bucket` decodes) and its padding, laid out as `flat`."""
        positions, slot_pages, slot_offsets, [group] = attention_inputs(batch, page_size)
        n, head = positions.shape[0], np.zeros((5, self.rows), dtype=np.int64)
        for field, values in enumerate((batch.token_ids, positions, slot_pages, slot_offsets, group.context_lens)):
            head[field, :n] = values
        head[2, n:bucket] = PAD_PAGE
        head[4, n:bucket] = 1  # a padding row reads one key of page 0 and writes nothing
        tables = np.zeros((self.rows, self.width), dtype=np.int64)
        tables[:n, : group.page_tables.shape[1]] = group.page_tables
        return np.concatenate([head.reshape(-1), tables.reshape(-1)])

    def attention(self, bucket: int, arena: Any, backend: Any, scale: float | None) -> AttentionBatch:
        """The attention batch of the first `bucket` rows (views: what a graph captures)."""
        rows = torch.arange(bucket, device=self.flat.device)
        positions = self.field(1)[:bucket]
        group = SeqGroup(
            self.tables[:bucket],
            self.field(4)[:bucket],
            rows[:, None],
            positions[:, None],
            rows,
            torch.ones(bucket, dtype=torch.int64, device=self.flat.device),
        )
        return AttentionBatch(arena, self.field(2)[:bucket], self.field(3)[:bucket], [group], backend, scale)


class DecodeGraphs:
    """One engine's decode graphs: captured at load, replayed for decode-only steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        arena: Any,
        backend: Any,
        scale: float | None,
        sizes: list[int],
        width: int,
        graph_class: type | None = None,
    ) -> None:
        self.model, self.arena, self.page_size = model, arena, arena.page_size
        self.sizes = sizes
        self.inputs = StaticInputs.allocate(max(sizes), width, arena.buffer.device)
        self.graph_class = graph_class or GRAPH_CLASS
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (graph, its output [bucket, hidden])
        self.stats: dict[str, Any] = {
            "sizes": sizes,
            "capture_s": 0.0,
            "memory_bytes": 0,
            "replays": 0,
            "eager": {"prefill or drafted rows": 0, "more rows than captured": 0, "wider page table": 0},
        }
        self._attn = {b: self.inputs.attention(b, arena, backend, scale) for b in sizes}

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket that runs `batch`, or None when it runs eagerly (counted in `stats`)."""
        n = batch.lens.shape[0]
        reason = None
        if batch.drafted.any() or not (batch.lens == 1).all():
            reason = "prefill or drafted rows"
        elif n > self.sizes[-1]:
            reason = "more rows than captured"
        elif batch.tables.shape[1] > self.inputs.width:
            reason = "wider page table"
        if reason is not None:
            self.stats["eager"][reason] += 1
            return None
        self.stats["replays"] += 1
        return next(b for b in self.sizes if b >= n)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        device = self.inputs.flat.device
        cuda = device.type == "cuda"
        start = time.perf_counter()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0] if cuda else 0
        pool = torch.cuda.graph_pool_handle() if cuda else None
        try:
            with frozen_gc():
                for bucket in sorted(self.sizes, reverse=True):
                    self._forward(bucket)  # warm-up outside the graph: Triton compiles, cuBLAS picks kernels
                    graph = self.graph_class()
                    self.graphs[bucket] = (graph, graph.capture(lambda b=bucket: self._forward(b), pool))
        except torch.cuda.OutOfMemoryError as e:
            raise ValueError(
                f"capturing CUDA graphs for decode batches of {self.sizes} ran out of device memory: "
                "run with --enforce-eager (enforce_eager=True), a smaller --max-num-seqs, or fewer "
                f"cuda_graph_sizes ({e})"
            ) from e
        if cuda:
            torch.cuda.synchronize(device)
            self.stats["memory_bytes"] = free_before - torch.cuda.mem_get_info(device)[0]
        self.stats["capture_s"] = time.perf_counter() - start

    def _forward(self, bucket: int) -> torch.Tensor:
        attn = self._attn[bucket]
        for group in attn.groups:  # masks (the sdpa backend's, on a CPU) are per step, not per capture
            group.masks.clear()
        return self.model(self.inputs.field(0)[:bucket], self.inputs.field(1)[:bucket], attn)

    def run(
        self, batch: ForwardBatch, bucket: int, staging: Any, fill: tuple | None, eager: bool = False
    ) -> torch.Tensor:
        """The real rows' final hidden states (a view, valid until the next replay) of `bucket`'s
        graph on `batch`; `fill` as `ModelRunner.forward`'s; `eager`: the same padded forward unreplayed."""
        host = [torch.from_numpy(self.inputs.pack(batch, self.page_size, bucket))]
        if fill is not None:
            host += [torch.from_numpy(fill[0]), torch.from_numpy(fill[1])]
        staged = staging.to_device(*host)
        self.inputs.flat.copy_(staged[0])
        if fill is not None:
            self.inputs.field(0)[staged[1]] = fill[2][staged[2]]
        graph, out = self.graphs[bucket]
        if eager:
            return self._forward(bucket)[: batch.lens.shape[0]]
        graph.replay()
        return out[: batch.lens.shape[0]]


@contextmanager
def frozen_gc() -> Iterator[None]:
    """GC frozen, and `gc.collect` / `torch.cuda.empty_cache` (which each capture calls) no-ops."""
    gc.collect()
    gc.freeze()
    collect, empty_cache = gc.collect, torch.cuda.empty_cache
    gc.collect, torch.cuda.empty_cache = (lambda generation=2: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = collect, empty_cache
        gc.unfreeze()


class CudaGraph:
    """torch.cuda.CUDAGraph as `capture(fn, pool)` (fn's output, at a fixed address) and `replay()`."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Any, pool: Any) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


GRAPH_CLASS: type = CudaGraph  # tests substitute an eager stand-in
