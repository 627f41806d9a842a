"""CUDA graphs for decode-only steps: the model's forward captured once per batch-size bucket.

Owns `capture_sizes` (the buckets) and `DecodeGraphs` (the static inputs, one graph a bucket,
replay). A decode step of B sequences runs the graph of the smallest bucket >= B: its inputs
are written into the static buffers the graph was captured on (one host-to-device copy of
one packed array, one device copy into place), rows B.. are padding, and one replay launches
every kernel of the forward (about a thousand launches become one).

- Buckets: vLLM's, 1, 2, 4, 8, then steps of 8 to 256 and of 16 above, up to `max_num_seqs` (at most MAX_CAPTURE,
  and `max_num_seqs` itself when the steps of 8 miss it, so every decode batch has a graph);
  a list given in `EngineConfig.cuda_graph_sizes` is cut to `max_num_seqs`.
- Padding rows: token 0 at position 0, KV slot page -1 (the Triton KV store writes nothing
  there), a context of one key in page 0 (read, never written): a padding row never touches
  a page a sequence holds, and every computation is row by row, so a real row's bits do not
  depend on them. Block tables are padded to the widest any sequence can have
  (`pages_per_seq`), so one graph serves every context length.
- A replay is compared with the same padded forward run eagerly (`run(..., eager=True)`: the
  same shapes, the same kernels): bit-identical (tested on CUDA). The plain eager path
  (`enforce_eager=True`, and every step graphs do not take) runs batches unpadded; on CUDA a
  row's last bits may differ between the two, as cuBLAS picks kernels by row count (on a CPU
  in fp32 every matmul is row-invariant, so they agree exactly there).
- Mixed and prefill steps run eagerly (attention shapes vary with chunk lengths), as do
  parallel models (their collectives) and the `sdpa`/`cpu` backends (they read the batch on
  the host). The sampler runs after the replay, eagerly.
- Captured once per engine, after its final arena is attached (`LLMEngine.capture_graphs`),
  with Python's garbage collector frozen (vLLM's practice: a collection inside a capture can
  finalise a Triton kernel the graph holds), and torch's per-capture `gc.collect` and
  `empty_cache` skipped (one of each before the first bucket instead).
- Capture time and the memory the graphs took (free device memory before minus after, read
  after `empty_cache` so the allocator's idle cache is not counted) are measured and kept in
  `stats` for the memory table and results, with how many steps replayed a graph and, for
  the others, why not (`stats["replays"]`, `stats["eager"]`).
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

MAX_CAPTURE = 512  # the largest bucket captured
PAD_PAGE = -1  # a padding row's KV slot: the store skips it


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """The buckets for `max_num_seqs`: `sizes` (cut to max_num_seqs), else vLLM's list."""
    if sizes is not None:  # sizes above max_num_seqs become max_num_seqs
        return sorted({min(s, max_num_seqs) for s in sizes})
    limit = min(max_num_seqs, MAX_CAPTURE)
    steps = [1, 2, 4, 8, *range(16, 257, 8), *range(272, limit + 1, 16)]
    return sorted({s for s in steps if s <= limit} | {limit})


def graphs_apply(device: torch.device, backend: str, enforce_eager: bool, parallel: bool) -> bool:
    """Whether an engine captures decode graphs: on CUDA, with the Triton backend, one rank."""
    return device.type == "cuda" and backend == "triton" and not enforce_eager and not parallel


@dataclass
class StaticInputs:
    """The graphs' inputs at fixed addresses: views of one flat int64 device buffer, so one
    copy fills them all (`pack` lays a batch out the same way on the host)."""

    rows: int  # the largest bucket
    width: int  # block table columns
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

    def pack(self, batch: ForwardBatch, block_size: int, bucket: int) -> np.ndarray:
        """`batch` (decodes only, at most `bucket` of them; its inputs as `attention_inputs` derives
        them for the eager path) and its padding, laid out as `flat`."""
        positions, slot_pages, slot_offsets, [group] = attention_inputs(batch, block_size)
        n, head = positions.shape[0], np.zeros((5, self.rows), dtype=np.int64)
        for field, values in enumerate((batch.token_ids, positions, slot_pages, slot_offsets, group.context_lens)):
            head[field, :n] = values
        head[2, n:bucket] = PAD_PAGE
        head[4, n:bucket] = 1
        tables = np.zeros((self.rows, self.width), dtype=np.int64)
        tables[:n, : group.block_tables.shape[1]] = group.block_tables
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
        self.model, self.arena, self.block_size = model, arena, arena.block_size
        self.sizes = sizes
        self.inputs = StaticInputs.allocate(max(sizes), width, arena.buffer.device)
        self.graph_class = graph_class or GRAPH_CLASS
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (graph, its output [bucket, hidden])
        self.stats: dict[str, Any] = {
            "sizes": sizes,
            "capture_s": 0.0,
            "memory_bytes": 0,
            "replays": 0,
            "eager": {"prefill or drafted rows": 0, "more rows than captured": 0, "wider block table": 0},
        }
        self._attn = {b: self.inputs.attention(b, arena, backend, scale) for b in sizes}

    def bucket(self, batch: ForwardBatch) -> int | None:
        """The bucket that runs `batch`, or None when it runs eagerly (not decodes only, more rows
        than the largest bucket, or a wider block table than captured); counted in `stats`."""
        n = batch.lens.shape[0]
        reason = None
        if batch.drafted.any() or not (batch.lens == 1).all():
            reason = "prefill or drafted rows"
        elif n > self.sizes[-1]:
            reason = "more rows than captured"
        elif batch.tables.shape[1] > self.inputs.width:
            reason = "wider block table"
        if reason is not None:
            self.stats["eager"][reason] += 1
            return None
        self.stats["replays"] += 1
        return next(b for b in self.sizes if b >= n)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool). A capture
        that runs out of device memory raises a ValueError naming `--enforce-eager`."""
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
                    self._forward(bucket)  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the graph
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
        """Replay `bucket`'s graph on `batch` (`fill`: the previous step's samples to write into the
        token ids on the device; `eager`: run the same padded forward without the graph, what
        the replay is compared against); the real rows' final hidden states (a view, valid
        until the next replay)."""
        host = [torch.from_numpy(self.inputs.pack(batch, self.block_size, bucket))]
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
    """One collection, then the collector frozen and `gc.collect` / `torch.cuda.empty_cache` made
    no-ops (torch.cuda.graph calls both on entering each capture) until the block ends."""
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
    """torch.cuda.CUDAGraph as `capture(fn, pool)` (returns fn's output, at a fixed address) and
    `replay()`; tests stand an eager twin in for it on a CPU."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Any, pool: Any) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


GRAPH_CLASS: type = CudaGraph  # what `DecodeGraphs` captures with (tests substitute an eager stand-in)
