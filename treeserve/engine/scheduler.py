"""Continuous batching with a token budget, chunked prefill and preemption.

Each step: running decodes (and their drafts), running prefills, then waiting sequences (after
their prefix-cache hit, if the running ones keep room to grow). Out of pages, the latest arrival
is preempted. On a shared arena, a model that cannot fit anything marks itself starving.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

from treeserve.engine.request import SeqStatus, Sequence
from treeserve.kv.page_manager import PageManager, PrefixHit

if TYPE_CHECKING:
    from treeserve.engine.input_batch import InputBatch
    from treeserve.engine.speculative.speculator import Speculator

# tokens of growth per running sequence admission leaves free (else a full arena preempts them)
GROWTH_HEADROOM_TOKENS = 32


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int
    num_tokens: int
    draft: list[int] | tuple[()] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


RUNNING = SeqStatus.RUNNING
_ARRIVAL_ORDER = attrgetter("order")


class Scheduler:
    def __init__(
        self,
        page_manager: PageManager,
        rows: InputBatch,
        speculator: Speculator | None,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        # what a running sequence holds, given back when it stops (`_release`)
        self.pages = page_manager
        self.rows = rows
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._in_order = True
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        self.running.append(seq)
        self._in_order = False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, can_preempt: bool = True) -> tuple[list[ScheduledSeq], list[tuple[int, int]]] | None:
        """This step's batch and the page copies to do first; None if making room would preempt
        while `can_preempt` is False."""
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        if not self._in_order:
            self.running.sort(key=_ARRIVAL_ORDER)
            self._in_order = True
        pages = self.pages
        page_size, ref_counts, pool = pages.page_size, pages.ref_counts, pages.pool
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
                table = seq.page_table
                grows = len(table) * page_size < start + n or (  # its first page written is copied if shared
                    pool.shared_pages and start < len(table) * page_size and ref_counts[table[start // page_size]] > 1
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
                    grows = grows or len(table) * page_size < start + n
                if grows:
                    copies += pages.grow(table, start, start + n)
                batch.append(ScheduledSeq(seq, start, n, draft))
                budget -= n
            queue = prefills
        promised = self._promised_pages() if self.waiting else set()
        deferred: list[Sequence] = []
        owner = self.pages.owner
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
            item = self._admit(seq, hit, budget, copies)
            if item is None:
                starving = not self.running
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._in_order = False
            batch.append(item)
            budget -= item.num_tokens
            promised.update(seq.promised_pages)
        self.waiting.extendleft(reversed(deferred))
        pool.set_starving(owner, starving)
        return batch, copies

    def _promised_pages(self) -> set[int]:
        """Keys of the full prompt pages that running prefills will cache: a waiting sequence
        needing one waits for the cache instead of computing it twice."""
        promised: set[int] = set()
        for seq in self.running:
            if seq.promised_pages:
                done = len(seq.page_hashes) - seq.promised_from
                if done >= len(seq.promised_pages):
                    seq.promised_pages = []
                else:
                    promised.update(seq.promised_pages[done:])
        return promised

    def _lookup(self, seq: Sequence) -> PrefixHit:
        limit = len(seq.token_ids) - 1
        if seq.request.score is not None:
            limit = min(limit, seq.request.score.positions[0])
        if seq.request.prompt_logprobs is not None:  # cached positions' logprobs are recomputed (as vLLM does)
            limit = 0
        return self.pages.find_prefix(seq.token_ids, limit)

    def _fit_draft(self, seq: Sequence, n: int, spare: int) -> list[int]:
        """The part of `seq.draft` the budget and free pages allow (drafts never preempt)."""
        draft = seq.draft[:spare] if n == seq.num_uncomputed else []
        start = seq.num_computed_tokens
        if (
            draft
            and self.pages.pages_to_grow(seq.page_table, start, start + n + len(draft)) > self.pages.num_free_pages
        ):
            return []
        return draft

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """The token in flight for `seq` is certainly its last (max_tokens or the context)."""
        if not seq.num_pending:
            return False
        max_tokens = seq.request.params.max_tokens
        return seq.num_tokens >= self.max_model_len or (
            max_tokens is not None and seq.num_tokens - seq.num_prompt_tokens >= max_tokens
        )

    def _make_room(self, seq: Sequence, n: int, batch: list[ScheduledSeq], can_preempt: bool) -> bool | None:
        """Preempt later sequences until `seq` can grow by n tokens; False if seq itself went; None
        if that needs a preemption and `can_preempt` is False."""
        start = seq.num_computed_tokens
        while self.pages.pages_to_grow(seq.page_table, start, start + n) > self.pages.num_free_pages:
            if not can_preempt:
                return None
            scheduled = {item.seq.seq_id for item in batch}
            victims = [s for s in self.running if s.seq_id not in scheduled]
            victim = max(victims, key=_ARRIVAL_ORDER)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence, hit: PrefixHit, budget: int, copies: list[tuple[int, int]]) -> ScheduledSeq | None:
        """Admit `seq` over `hit`; a cached tail it starts writing is copied (into `copies`)."""
        start = hit.num_tokens(self.pages.page_size)
        n = min(len(seq.token_ids) - start, budget)
        table = list(hit.pages)
        need = self.pages.pages_to_acquire(hit) + self.pages.pages_to_grow(table, start, start + n)
        if need + self.headroom() > self.pages.num_free_pages:
            return None
        self.pages.acquire_prefix(hit)
        seq.page_table = table
        seq.page_hashes = list(hit.hashes)
        seq.num_computed_tokens = start
        seq.promised_pages, seq.promised_from = hit.missed, len(hit.hashes)
        if seq.request.num_cached_tokens == 0:
            seq.request.num_cached_tokens = start
        copies += self.pages.grow(seq.page_table, start, start + n)
        return ScheduledSeq(seq, start, n)

    def headroom(self) -> int:
        """Pages a new sequence must leave free: GROWTH_HEADROOM_TOKENS for each running one."""
        return len(self.running) * -(-GROWTH_HEADROOM_TOKENS // self.pages.page_size)

    def preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.page_hashes.clear()
        seq.promised_pages = []
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        if not self.waiting:
            self.pages.pool.set_starving(self.pages.owner, False)

    def _release(self, seq: Sequence) -> None:
        self.pages.release(seq.page_table)
        self.rows.release(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
