"""Iteration-level (continuous) batching with a token budget, chunked prefill and preemption.

Each step: running decodes first (one token each), then running prefills, then waiting
sequences, each taking what is left of `max_num_batched_tokens` (a long prompt is split
into chunks over several steps). A decode with drafted tokens (speculative decoding) runs them
too, as far as the budget and the free pages allow. A waiting sequence first takes what the prefix cache
holds of it, and is admitted only if the running ones keep room to grow (headroom). When
pages run out, the most recently arrived running sequence is preempted: its pages are
released and it is recomputed later (its outputs are kept). On an arena shared with other
models, a model whose next sequence does not fit while it runs nothing marks itself
starving in the page pool; the other models then admit nothing new until it is served.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from treeserve.engine.request import SeqStatus, Sequence
from treeserve.kv.block_manager import BlockManager, PrefixHit

if TYPE_CHECKING:
    from treeserve.engine.input_batch import InputBatch
    from treeserve.engine.speculative.speculator import Speculator

# Admission leaves this many tokens of growth per running sequence free. Without it, a full
# arena preempts (and later recomputes) running sequences to make room for new ones: on beam
# search at N=16 in an 8 MiB arena, 0 tokens gave 1838 preemptions, 32 tokens 38 and 1.6x the
# throughput (a search step is about 25 tokens).
GROWTH_HEADROOM_TOKENS = 32


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens already computed (cached) before this step
    num_tokens: int  # tokens computed this step (a speculating decode: its last token + the draft)
    draft: list[int] | tuple[()] = ()  # drafted tokens run after the sequence's own

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


RUNNING = SeqStatus.RUNNING
_ARRIVAL_ORDER = attrgetter("order")  # (request arrival, completion index)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        rows: InputBatch,
        speculator: Speculator | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        # what a running sequence holds, each given back when it stops running (`_release`): its
        # pages, its row of the input batch, a draft model's pages
        self.blocks = block_manager
        self.rows = rows
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._in_order = True  # `running` is in arrival order (an append may break it; a removal never does)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sibling forked from a running sequence: it already holds (shared) pages."""
        self.running.append(seq)
        self._in_order = False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, can_preempt: bool = True) -> tuple[list[ScheduledSeq], list[tuple[int, int]]] | None:
        """Pick this step's work; returns the batch and the page copies to do before it runs, or
        None if making room would preempt a sequence while `can_preempt` is False (a step is in
        flight: the engine reads it back first, then schedules again)."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        if not self._in_order:
            self.running.sort(key=_ARRIVAL_ORDER)
            self._in_order = True
        blocks = self.blocks
        block_size, ref_counts, pool = blocks.block_size, blocks.ref_counts, blocks.pool
        # decodes first, then prefills (`prefills`, deferred by the first pass), each in arrival order
        queue, prefills = list(self.running), []
        for decoding in (True, False):
            for seq in queue:
                if budget == 0:
                    break
                start = seq.num_computed_tokens
                uncomputed = len(seq.token_ids) + seq.num_pending - start
                if decoding and uncomputed > 1:
                    prefills.append(seq)
                    continue
                if seq.status is not RUNNING or uncomputed == 0 or (seq.num_pending and self._ends_in_flight(seq)):
                    continue  # preempted to make room for an earlier one; or waiting for its step's results
                n = uncomputed if uncomputed < budget else budget
                table = seq.block_table
                grows = len(table) * block_size < start + n or (  # its first page written is copied if shared
                    pool.shared_pages and start < len(table) * block_size and ref_counts[table[start // block_size]] > 1
                )
                if grows:
                    room = self._make_room(seq, n, batch, can_preempt)
                    if room is None:
                        return None
                    if not room:
                        continue
                draft = ()
                if seq.draft:
                    draft = self._fit_draft(seq, n, budget - n)
                    n += len(draft)
                    grows = grows or len(table) * block_size < start + n
                if grows:
                    copies += blocks.grow(table, start, start + n)
                batch.append(ScheduledSeq(seq, start, n, draft))
                budget -= n
            queue = prefills
        promised = self._promised_blocks() if self.waiting else set()
        deferred: list[Sequence] = []
        owner = self.blocks.owner
        starving = False
        while self.waiting and budget > 0 and pool.may_admit(owner):
            seq = self.waiting[0]
            width = 1 + seq.pending_forks
            if self.running and len(self.running) + width > self.max_num_seqs:
                break
            hit = self._lookup(seq)
            if hit.missed and hit.missed[0] in promised:  # a running prefill is computing it: wait for the cache
                deferred.append(self.waiting.popleft())
                continue
            item = self._admit(seq, hit, budget)
            if item is None:
                starving = not self.running  # it waits for pages another model holds
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._in_order = False
            batch.append(item)
            budget -= item.num_tokens
            promised.update(seq.promised_blocks)
        self.waiting.extendleft(reversed(deferred))
        pool.set_starving(owner, starving)
        return batch, copies

    def _promised_blocks(self) -> set[int]:
        """Keys of the full prompt blocks that running prefills will compute and cache. A waiting
        sequence whose next block is among them waits a step and then finds it cached, instead of
        computing it a second time (n beams sent the same prompt at once)."""
        promised: set[int] = set()
        for seq in self.running:
            if seq.promised_blocks:
                done = len(seq.block_hashes) - seq.promised_from
                if done >= len(seq.promised_blocks):
                    seq.promised_blocks = []
                else:
                    promised.update(seq.promised_blocks[done:])
        return promised

    def _lookup(self, seq: Sequence) -> PrefixHit:
        limit = len(seq.token_ids) - 1  # always compute at least the last token
        if seq.request.score is not None:
            limit = min(limit, seq.request.score.positions[0])
        if seq.request.prompt_logprobs is not None:  # cached positions' logprobs are recomputed (as vLLM does)
            limit = 0
        return self.blocks.find_prefix(seq.token_ids, limit)

    def _fit_draft(self, seq: Sequence, n: int, spare: int) -> list[int]:
        """The part of `seq.draft` this step verifies: what the token budget and the free pages
        allow (drafts never preempt anything), none unless the sequence runs its last token."""
        draft = seq.draft[:spare] if n == seq.num_uncomputed else []
        start = seq.num_computed_tokens
        if (
            draft
            and self.blocks.blocks_to_grow(seq.block_table, start, start + n + len(draft)) > self.blocks.num_free_blocks
        ):
            return []
        return draft

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """The token a step in flight samples for `seq` is certainly its last (max_tokens or the
        context): nothing more to compute for it."""
        if not seq.num_pending:
            return False
        max_tokens = seq.request.params.max_tokens
        return seq.num_tokens >= self.max_model_len or (
            max_tokens is not None and seq.num_tokens - seq.num_prompt_tokens >= max_tokens
        )

    def _make_room(self, seq: Sequence, n: int, batch: list[ScheduledSeq], can_preempt: bool) -> bool | None:
        """Preempt later sequences (not in `batch`) until `seq` can grow by n tokens; False if seq
        itself went; None if that needs a preemption and `can_preempt` is False."""
        start = seq.num_computed_tokens
        while self.blocks.blocks_to_grow(seq.block_table, start, start + n) > self.blocks.num_free_blocks:
            if not can_preempt:
                return None
            scheduled = {item.seq.seq_id for item in batch}
            victims = [s for s in self.running if s.seq_id not in scheduled]
            victim = max(victims, key=_ARRIVAL_ORDER)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence, hit: PrefixHit, budget: int) -> ScheduledSeq | None:
        start = len(hit.blocks) * self.blocks.block_size
        n = min(len(seq.token_ids) - start, budget)
        table = list(hit.blocks)
        need = self.blocks.pages_to_acquire(hit) + self.blocks.blocks_to_grow(table, start, start + n)
        if need + self.headroom() > self.blocks.num_free_blocks:
            return None
        self.blocks.acquire_prefix(hit)
        seq.block_table = table
        seq.block_hashes = list(hit.hashes)
        seq.num_computed_tokens = start
        seq.promised_blocks, seq.promised_from = hit.missed, len(hit.blocks)
        if seq.request.num_cached_tokens == 0:
            seq.request.num_cached_tokens = start
        self.blocks.grow(seq.block_table, start, start + n)
        return ScheduledSeq(seq, start, n)

    def headroom(self) -> int:
        """Pages a new sequence must leave free: room for every running sequence to grow by
        GROWTH_HEADROOM_TOKENS, so that admitting it does not soon force a running one out."""
        return len(self.running) * -(-GROWTH_HEADROOM_TOKENS // self.blocks.block_size)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.block_hashes.clear()
        seq.promised_blocks = []
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that ended (done or aborted), wherever it is."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        if not self.waiting:  # nothing left to wait for pages (e.g. the waiting ones were aborted)
            self.blocks.pool.set_starving(self.blocks.owner, False)

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        self.rows.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
