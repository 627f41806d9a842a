"""One step on the device: a plan built on the host in, sampled tokens and read-outs out.

The host (`input_batch.py`) describes a step as a `StepPlan`: the flat token ids (a token the
previous step sampled and has not reported yet is named by its row in that step's samples),
each item's start, length and block table, which items may be twins (`dedup.py`), and what
to sample and read. `ModelRunner.execute` turns it into the forward's tensors (positions, KV
slots, attention groups: built on the host from a few arrays, sent in one staged copy), runs
the model and samples. Nothing it reads changes after the plan is built, so it may run on a
worker thread while the host schedules the next step (`device_queue.py`); every write to the KV
arena (page copies, twins' slots, the forward's own) happens here, in step order.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from treeserve.distributed.groups import RankGroup
from treeserve.engine.attention import AttentionBackend, AttentionBatch, SdpaBackend, SeqGroup
from treeserve.engine.cuda_graphs import DecodeGraphs
from treeserve.engine.dedup import Twins
from treeserve.engine.forward_batch import ForwardBatch, attention_inputs, micro_batches
from treeserve.engine.inference_mode import inference_mode
from treeserve.engine.sampler import Draw, read_out, sample_plan
from treeserve.engine.staging import Staging
from treeserve.engine.step_plan import StepPlan
from treeserve.engine.step_result import PreviousStepFailed, StepResult
from treeserve.kv.arena import KVArena

if TYPE_CHECKING:
    from treeserve.engine.device_queue import Ran


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        arena: KVArena,
        device: torch.device,
        scale: float | None = None,
        backend: AttentionBackend | None = None,
        draw: Draw | None = None,
        vocab_size: int = 0,
        mirror: Callable[[tuple], None] | None = None,
        mirror_logits: bool = False,
        stage: tuple[RankGroup, int, int, torch.dtype] | None = None,
    ):
        self.model = model
        # rank 0 of a parallel model (distributed/ranks.py): sends each step to the other ranks, which
        # mirror its forward (and, tensor parallel, its logits: each rank holds a vocabulary slice)
        self.mirror, self.mirror_logits = mirror, mirror_logits
        # a pipeline stage: (group, this stage, stages, activation dtype); its forward runs micro-batches
        self.stage = stage
        self.arena = arena
        self.block_size = arena.block_size
        self.device = device
        self.scale = scale
        self.backend = backend or SdpaBackend()
        self.draw = draw
        self.vocab_size = vocab_size
        self.staging = Staging(device)
        # a token the previous step sampled is written into the inputs on the device (CUDA: the
        # host does not wait for it; twins are then not looked for) or here (a CPU, or the other
        # ranks' inputs are sent from here)
        self.fill_on_device = device.type != "cpu" and mirror is None
        self.graphs: DecodeGraphs | None = None  # CUDA graphs for decode-only steps (the engine captures them)

    @inference_mode
    def execute(self, plan: StepPlan, previous: Future | Ran | None = None) -> StepResult:
        """Run one step; `previous` is the step before it when this one reads its samples."""
        prev_tokens = None
        if previous is not None:
            try:
                prev_tokens = previous.result().tokens
            except BaseException as e:
                raise PreviousStepFailed("the step this one continues failed") from e
        self._copy_pages(plan.copies)
        batch, fill = plan.batch, None
        if plan.pending_at.size:
            if self.fill_on_device:
                fill = (plan.pending_at, plan.pending_from, prev_tokens)
            else:
                batch.token_ids[plan.pending_at] = prev_tokens.numpy()[plan.pending_from]
        twins_of = plan.twins if fill is None and self.stage is None else None  # pipelines split the batch
        if self.mirror is not None:
            self.mirror(("step", plan.copies, batch, twins_of))
        twins = Twins.find(batch, twins_of, self.block_size) if twins_of is not None else None
        hidden = self.forward(twins.computed if twins else batch, fill)
        if plan.fail is not None:
            raise plan.fail
        result = StepResult(num_computed=hidden.shape[0])
        if twins:
            hidden = twins.expand(hidden, self.arena, self.staging.to_device)
        if plan.sample is not None:
            result.tokens, result.logprobs = sample_plan(
                plan.sample, hidden, self.compute_logits, self.staging.to_device, self.draw, self.vocab_size
            )
            result.host_tokens = to_host(result.tokens)
        if plan.scores is not None or plan.prompt_logprobs:
            scores, states, result.prompt_logprobs = read_out(
                plan.scores, plan.prompt_logprobs, hidden, self.compute_logits, self.staging.to_device
            )
            result.scores, result.states = to_host(scores), to_host(states)
        if self.device.type == "cuda":  # the host waits on this, not on the whole device (StepResult.wait)
            result.copied = torch.cuda.Event()
            result.copied.record()
        return result

    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """The step's copy-on-write page copies (src, dst), their indices sent with the staging copy."""
        if copies:
            src, dst = self.staging.to_device(*torch.tensor(copies, dtype=torch.int64).T.contiguous())
            self.arena.copy_pages(src, dst)

    @inference_mode
    def mirror_step(self, copies: list[tuple[int, int]], batch: ForwardBatch, twins_of: np.ndarray | None) -> None:
        """On a rank > 0: what `execute` does to this rank's arena and collectives for the step
        rank 0 sent (page copies, the forward of `batch` and its twins' slots); nothing sampled."""
        self._copy_pages(copies)
        twins = Twins.find(batch, twins_of, self.block_size) if twins_of is not None else None
        hidden = self.forward(twins.computed if twins else batch)
        if twins:
            twins.expand(hidden, self.arena, self.staging.to_device)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The model's logits of rows `hidden`; with tensor parallelism every rank computes its
        slice of the vocabulary (they are sent the rows) and the slices are gathered."""
        if self.mirror_logits:
            self.mirror(("logits", hidden.cpu()))  # each rank moves it to its device
        return self.model.compute_logits(hidden, float32)

    @inference_mode
    def forward(self, batch: ForwardBatch, fill: tuple | None = None) -> torch.Tensor | None:
        """The final hidden state of every row of `batch` ([T, hidden]; None on a pipeline stage
        past the first); `fill` (CUDA): (rows, sample rows, previous samples) to write into the
        token ids once they are on the device."""
        if self.stage is not None:
            return self._pipelined(batch)
        if self.graphs is not None and (bucket := self.graphs.bucket(batch)) is not None:
            return self.graphs.run(batch, bucket, self.staging, fill)
        return self.model(*self._inputs(batch, fill))

    def _pipelined(self, batch: ForwardBatch) -> torch.Tensor | None:
        """This stage's layers over `batch` in micro-batches: each stage works on one while the
        next works on the one before. Stage 0 embeds and sends; the last stage sends back to
        stage 0, which norms."""
        group, rank, stages, dtype = self.stage
        hidden_size = self.model.config.hidden_size
        parts = [batch.take(items) for items in micro_batches(batch, stages)]
        sends = []
        for part in parts:
            tokens, positions, attn = self._inputs(part, None)
            if rank == 0:
                x = self.model.embed(tokens)
            else:
                x = group.recv((part.token_ids.shape[0], hidden_size), dtype, rank - 1, self.device)
            sends.append(group.isend(self.model.run_layers(x, positions, attn), (rank + 1) % stages))
        if rank > 0:
            for work in sends:
                work.wait()
            return None
        outs = [group.recv((part.token_ids.shape[0], hidden_size), dtype, stages - 1, self.device) for part in parts]
        for work in sends:
            work.wait()
        return self.model.norm(torch.cat(outs))

    def _inputs(self, batch: ForwardBatch, fill: tuple | None) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """The forward's token ids, positions and attention batch, on the device."""
        positions, slot_pages, slot_offsets, groups = attention_inputs(batch, self.block_size)
        host = [batch.token_ids, positions, slot_pages, slot_offsets]
        host += [getattr(g, name) for g in groups for name in GROUP_FIELDS]
        if fill is not None:
            host += fill[:2]
        staged = iter(self.staging.to_device(*(torch.from_numpy(np.ascontiguousarray(a)) for a in host)))
        tokens, positions, slot_pages, slot_offsets = (next(staged) for _ in range(4))
        groups = [SeqGroup(*(next(staged) for _ in GROUP_FIELDS)) for _ in groups]
        if fill is not None:
            at, source = next(staged), next(staged)
            tokens[at] = fill[2][source]
        attn = AttentionBatch(self.arena, slot_pages, slot_offsets, groups, self.backend, self.scale)
        return tokens, positions, attn


def to_host(values: torch.Tensor | None) -> torch.Tensor | None:
    """`values` on the host: a device tensor is copied into pinned memory without blocking (its
    values are there once the step's `copied` event has passed); a host tensor as it is."""
    if values is None or values.device.type == "cpu":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


GROUP_FIELDS = [f.name for f in fields(SeqGroup) if f.name != "masks"]
