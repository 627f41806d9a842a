"""One step on the device: a `StepPlan` in, sampled tokens and read-outs out.

`ModelRunner.execute` copies pages, finds twins (`dedup.py`), stages the forward's inputs in one
copy and runs the model, then hands the hidden states to the sampler. Nothing it reads changes
after the plan is built, so it may run on a worker thread (`device_queue.py`); every write to
the KV arena happens here, in step order.
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
        # rank 0 of a parallel model: sends each step (and, tensor parallel, its logits) to the other ranks
        self.mirror, self.mirror_logits = mirror, mirror_logits
        # a pipeline stage: (group, this stage, stages, activation dtype)
        self.stage = stage
        self.arena = arena
        self.page_size = arena.page_size
        self.device = device
        self.scale = scale
        self.backend = backend or SdpaBackend()
        self.draw = draw
        self.vocab_size = vocab_size
        self.staging = Staging(device)
        # the previous step's samples are written into the inputs on the device (the host does not
        # wait for them; twins are then not looked for), else here
        self.fill_on_device = device.type != "cpu" and mirror is None
        self.graphs: DecodeGraphs | None = None  # the engine captures them

    @inference_mode
    def execute(self, plan: StepPlan, previous: Future | Ran | None = None) -> StepResult:
        """Run one step; `previous` is the step before it when this one reads its samples."""
        prev_tokens = None
        if previous is not None:
            try:
                prev_tokens = previous.result().tokens
            except BaseException as e:
                raise PreviousStepFailed("the step this one continues failed") from e
        self.copy_pages(plan.copies)
        batch, fill = plan.batch, None
        if plan.pending_at.size:
            if self.fill_on_device:
                fill = (plan.pending_at, plan.pending_from, prev_tokens)
            else:
                batch.token_ids[plan.pending_at] = prev_tokens.numpy()[plan.pending_from]
        twins_of = plan.twins if fill is None and self.stage is None else None  # pipelines split the batch
        if self.mirror is not None:
            self.mirror(("step", plan.copies, batch, twins_of))
        twins = Twins.find(batch, twins_of, self.page_size) if twins_of is not None else None
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
        if self.device.type == "cuda":  # what `StepResult.wait` waits on
            result.copied = torch.cuda.Event()
            result.copied.record()
        return result

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """The step's copy-on-write page copies (src, dst)."""
        if copies:
            src, dst = self.staging.to_device(*torch.tensor(copies, dtype=torch.int64).T.contiguous())
            self.arena.copy_pages(src, dst)

    @inference_mode
    def mirror_step(self, copies: list[tuple[int, int]], batch: ForwardBatch, twins_of: np.ndarray | None) -> None:
        """On a rank > 0: `execute`'s page copies, forward and twins' slots for the step rank 0 sent."""
        self.copy_pages(copies)
        twins = Twins.find(batch, twins_of, self.page_size) if twins_of is not None else None
        hidden = self.forward(twins.computed if twins else batch)
        if twins:
            twins.expand(hidden, self.arena, self.staging.to_device)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """The model's logits of rows `hidden` (tensor parallel: each rank's vocabulary slice, gathered)."""
        if self.mirror_logits:
            self.mirror(("logits", hidden.cpu()))
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
        """This stage's layers over `batch` in micro-batches; stage 0 embeds, and norms what the last returns."""
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
        positions, slot_pages, slot_offsets, groups = attention_inputs(batch, self.page_size)
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
    """`values` on the host: a device tensor copied into pinned memory without blocking (valid once
    the step's `copied` event has passed)."""
    if values is None or values.device.type == "cpu":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


GROUP_FIELDS = [f.name for f in fields(SeqGroup) if f.name != "masks"]
