"""The host side of a step: per-sequence state in preallocated arrays, and the step's plan.

vLLM V1's persistent batch: a running sequence owns a row of arrays until it stops; a step writes
only what changed. `prepare` turns the scheduler's batch into the `StepPlan` the device runs and
the host's key to its results (`PreparedStep`); a token in flight is filled in on the device.
"""

from __future__ import annotations

import functools
from collections import Counter
from operator import add

import numpy as np
import torch

from treeserve.engine.forward_batch import ForwardBatch
from treeserve.engine.guided import Constraints
from treeserve.engine.penalties import RowHistory
from treeserve.engine.request import HISTORY_ANCHOR, Request, Sequence
from treeserve.engine.sampler import SamplingBatch, seeded_uniforms, stream_key
from treeserve.engine.scheduler import ScheduledSeq
from treeserve.engine.step_plan import (
    PreparedStep,
    PromptLogprobPlan,
    PromptRead,
    SamplePlan,
    SampleRow,
    ScorePlan,
    ScoreRead,
    StepPlan,
)
from treeserve.engine.thinking import ThinkTokens, forced_masks, forced_token

PROMPT_LOGPROBS_ROWS = 256  # prompt positions per [rows, vocab] logits slice
NONE = np.zeros(0, dtype=np.int64)  # no rows (read-only: every plan without pending tokens shares it)
NONE.flags.writeable = False


class InputBatch:
    def __init__(
        self,
        page_size: int,
        max_pages: int,
        eos_ids: list[int],
        constraints: Constraints,
        think: ThinkTokens | None = None,
        capacity: int = 64,
    ):
        self.page_size = page_size
        self.eos_ids = list(eos_ids)
        self.constraints = constraints
        self.think = think
        self.tables = np.zeros((capacity, max_pages), dtype=np.int64)
        self.temperature = np.zeros(capacity, dtype=np.float64)
        self.top_p = np.ones(capacity, dtype=np.float64)
        self.top_k = np.zeros(capacity, dtype=np.int64)
        self.min_p = np.zeros(capacity, dtype=np.float64)
        self.stream_key = np.zeros(capacity, dtype=np.uint64)
        self.free_rows = list(range(capacity - 1, -1, -1))
        # running sequences per `Request.prompt_key`: one alone with its key, while no short prompt
        # (None) runs, has no twin, and its decodes skip the history hash
        self.prompt_users: Counter[int | None] = Counter()
        self.shared_keys = 0  # keys with more than one running sequence (none: no decode looks its key up)
        # per row, the table length and last page written into `tables` (unchanged: nothing to write)
        self.synced_len = [0] * capacity
        self.synced_last = [-1] * capacity
        self.drawing_rows = 0  # rows in use with temperature > 0 (none: steps are greedy)

    def add(self, seq: Sequence) -> int:
        if not self.free_rows:
            self._grow()
        row = seq.row = self.free_rows.pop()
        key = seq.request.prompt_key
        self.prompt_users[key] += 1
        self.shared_keys += self.prompt_users[key] == 2
        self.synced_len[row], self.synced_last[row] = 0, -1
        p = seq.request.params
        if p is not None:
            self.temperature[row], self.top_p[row], self.top_k[row], self.min_p[row] = (
                p.temperature,
                p.top_p,
                p.top_k,
                p.min_p,
            )
            self.stream_key[row] = stream_key(seq.request.seed, seq.index)
            self.drawing_rows += p.temperature > 0
        return row

    def release(self, seq: Sequence) -> None:
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            p = seq.request.params
            self.drawing_rows -= p is not None and p.temperature > 0
            key = seq.request.prompt_key
            self.prompt_users[key] -= 1
            self.shared_keys -= self.prompt_users[key] == 1
            if not self.prompt_users[key]:
                del self.prompt_users[key]
            seq.row = -1

    def _grow(self) -> None:
        capacity = self.tables.shape[0]
        for name in ("tables", "temperature", "top_p", "top_k", "min_p", "stream_key"):
            old = getattr(self, name)
            new = np.zeros((2 * capacity, *old.shape[1:]), dtype=old.dtype)
            new[:capacity] = old
            setattr(self, name, new)
        self.free_rows += range(2 * capacity - 1, capacity - 1, -1)
        self.synced_len += [0] * capacity
        self.synced_last += [-1] * capacity

    def prepare(self, batch: list[ScheduledSeq], copies: list[tuple[int, int]]) -> PreparedStep:
        bs = self.page_size
        step = PreparedStep(batch)
        prompt_plans: list[PromptLogprobPlan] = []
        samples = step.samples
        tokens: list[int] = []
        pending_at: list[int] = []
        pending_from: list[int] = []
        starts, lens, rows, drafted = [], [], [], []
        sync_rows: list[int] = []
        sync_cols: list[int] = []
        sync_pages: list[int] = []
        synced_len, synced_last = self.synced_len, self.synced_last
        groups = [-1] * len(batch)  # twin candidates: per decode item, the first item with its history (dedup.py)
        first_with: dict[tuple, int] = {}
        twinned = False
        prompt_users = self.prompt_users
        short_prompts = None in prompt_users  # a sequence with a short prompt runs (sequences added here aside)
        sample_at: list[int] = []
        fork_keys: dict[int, int] = {}  # a fork's first sample row -> its stream key (not its parent's)
        special: list[int] = []
        score_rows: list[int] = []
        score_ids: list[list[int]] = []
        want_states = False
        for i, item in enumerate(batch):
            seq, start, n = item.seq, item.start, item.num_tokens
            row = seq.row
            if row < 0:
                row = self.add(seq)
            table = seq.page_table
            if len(table) != synced_len[row] or table[-1] is not synced_last[row]:
                first = start // bs if synced_len[row] else 0
                sync_rows += [row] * (len(table) - first)
                sync_cols += range(first, len(table))
                sync_pages += table[first:]
                synced_len[row], synced_last[row] = len(table), table[-1]
            starts.append(start)
            lens.append(n)
            rows.append(row)
            request = seq.request
            if not seq.quiet and request.stream:
                step.streaming.append(item)
            ids = seq.token_ids
            at = len(tokens)
            plain = n == 1 and (seq.quiet or request.plain)  # (quiet: nothing of its request is read)
            if plain and not seq.pending_forks and start + 1 == len(ids) + seq.num_pending:
                # a plain decode (most rows): one input token, the next one sampled
                if not (start + 1) % bs:
                    step.crossing.append(item)
                if start < len(ids):
                    tokens.append(ids[start])
                else:  # the token the step in flight samples for it
                    pending_at.append(at)
                    pending_from.append(seq.pending_row)
                    tokens.append(0)
                if short_prompts or (self.shared_keys and prompt_users[request.prompt_key] > 1):
                    if seq.hashed == start - 1 and start % HISTORY_ANCHOR and seq.history_hash is not None:
                        # Sequence.history_key(start), one token on, inlined
                        seq.history_hash, seq.hashed = hash((seq.history_hash, ids[start - 1])), start
                        key = ((start, seq.history_hash), ())
                    else:
                        key = (seq.history_key(start), ())
                    groups[i] = _first_twin(first_with, key, i, batch, start)
                    twinned |= groups[i] != i
                else:
                    groups[i] = i
                samples.append(seq.next_row or self._next_row(seq))
                sample_at.append(at)
                continue
            draft = item.draft
            end = start + n
            own_end = end - len(draft)
            if own_end // bs > start // bs:
                step.crossing.append(item)
            if own_end > len(ids):  # its last input is the token the step in flight samples for it
                tokens += ids[start:]
                pending_at.append(len(tokens))
                pending_from.append(seq.pending_row)
                tokens.append(0)
            else:
                tokens += ids[start:own_end]
            if draft:
                tokens += draft
                drafted.append(i)
            if request.params is not None and n == 1 + len(draft):
                groups[i] = _first_twin(first_with, (seq.history_key(start), tuple(draft)), i, batch, start)
                twinned |= groups[i] != i
            if request.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                prompt_plans += self._prompt_logprobs(step, request, item, at)
            if request.score is not None:
                step.scoring = True
                wanted = [p for p in request.score.positions if start <= p < end]
                if wanted:
                    step.score_reads.append(ScoreRead(seq, wanted, len(score_rows)))
                    score_rows += [at + p - start for p in wanted]
                    score_ids += [request.score.token_ids] * len(wanted)
                    want_states |= request.score.return_hidden_states
            elif own_end == len(ids) + seq.num_pending:  # its last token is computed: sample the next
                last = at + own_end - start - 1
                forks = seq.pending_forks
                if not request.plain:
                    special.append(len(samples))
                samples.append(SampleRow(seq, forks=forks))
                sample_at.append(last)
                if forks:
                    if not request.plain:
                        special += range(len(samples), len(samples) + forks)
                    fork_keys.update((len(samples) + f - 1, stream_key(request.seed, f)) for f in range(1, forks + 1))
                    samples += [SampleRow(seq, fork=f) for f in range(1, forks + 1)]
                    sample_at += [last] * forks
                if draft:  # the target's token after each drafted one
                    step.drafts[seq.seq_id] = draft
                    if not request.plain:
                        special += range(len(samples), len(samples) + len(draft))
                    samples += [SampleRow(seq, draft_position=j) for j in range(1, len(draft) + 1)]
                    sample_at += range(last + 1, last + 1 + len(draft))
        if sync_rows:
            self.tables[sync_rows, sync_cols] = sync_pages
        if drafted:
            drafted_ = np.zeros(len(batch), dtype=bool)
            drafted_[drafted] = True
        else:
            drafted_ = _no_drafts(len(batch))
        max_end = max(map(add, starts, lens), default=1)
        plan = step.plan = StepPlan(
            ForwardBatch(
                np.array(tokens, dtype=np.int64),
                np.array(starts, dtype=np.int64),
                np.array(lens, dtype=np.int64),
                drafted_,
                self.tables[rows, : -(-max_end // bs)],
            ),
            np.array(pending_at, dtype=np.int64) if pending_at else NONE,
            np.array(pending_from, dtype=np.int64) if pending_from else NONE,
            copies=copies,
            prompt_logprobs=prompt_plans,
        )
        if twinned:
            plan.twins = np.array(groups, dtype=np.int64)
        if sample_at:
            plan.sample = self._sampling(step, sample_at, rows, fork_keys, special)
        if score_rows:
            k = max(len(ids) for ids in score_ids)
            ids = torch.tensor([list(ids) + [0] * (k - len(ids)) for ids in score_ids], dtype=torch.long)
            plan.scores = ScorePlan(as_tensor(score_rows), ids.view(len(score_rows), k), want_states)
        return step

    @staticmethod
    def _next_row(seq: Sequence) -> SampleRow:
        """`seq`'s row for its next token, the same every step (rows are never changed)."""
        seq.next_row = SampleRow(seq)
        return seq.next_row

    @staticmethod
    def _prompt_logprobs(step: PreparedStep, request: Request, item: ScheduledSeq, at: int) -> list[PromptLogprobPlan]:
        """Rows of this chunk that predict prompt tokens (position p scores token p + 1), in slices."""
        end = min(item.end, len(request.prompt_token_ids) - 1)
        k = request.params.prompt_logprobs
        plans = []
        for start in range(item.start, end, PROMPT_LOGPROBS_ROWS):
            stop = min(start + PROMPT_LOGPROBS_ROWS, end)
            targets = request.prompt_token_ids[start + 1 : stop + 1]
            plans.append(PromptLogprobPlan(at + start - item.start, at + stop - item.start, as_tensor(targets), k))
            step.prompt_reads.append(PromptRead(request, start + 1, targets, k))
        return plans

    def _sampling(
        self, step: PreparedStep, at: list[int], rows: list[int], fork_keys: dict[int, int], special: list[int]
    ) -> SamplePlan:
        """The plan of sampled flat rows `at`; `rows`: each item's persistent row."""
        at_ = np.array(at, dtype=np.int64)
        if not self.drawing_rows:  # every row is greedy: nothing to draw, no parameter to read
            params = SamplingBatch.greedy(len(at))
        else:
            batch = step.plan.batch
            item = np.repeat(np.arange(batch.lens.shape[0]), batch.lens)[at_]
            positions = batch.starts[item] + at_ - batch.offsets[item] + 1
            rows_ = np.array(rows, dtype=np.int64)[item]
            keys = self.stream_key[rows_]
            if fork_keys:
                keys[list(fork_keys)] = list(fork_keys.values())
            uniform = seeded_uniforms(keys, positions)
            params = SamplingBatch(
                self.temperature[rows_], self.top_p[rows_], self.top_k[rows_], self.min_p[rows_], uniform
            )
        plan = SamplePlan(torch.from_numpy(at_), params)
        guides = []
        forced: dict[int, int] = {}
        budgeted = False  # a row has a thinking budget: its next step needs this step's token on the host
        for i in special:
            seq = step.samples[i].seq
            p = seq.request.params
            if seq.logprobs is not None:
                plan.logprob_rows.append(i)
                plan.logprobs_k = max(plan.logprobs_k, p.logprobs)
            if p.max_thinking_tokens is not None:  # a fork's first row shares its parent's state
                budgeted = True
                token = forced_token(seq, p.max_thinking_tokens, self.think)
                if token is not None:
                    forced[i] = token
                    plan.guided.append(i)
            if p.structured_outputs is None and not p.adjusts_logits:
                continue
            if p.structured_outputs is not None:
                if seq.guide is None:
                    seq.guide = self.constraints.guide(p.structured_outputs)
                plan.guided.append(i)
                guides.append(seq.guide)  # a fork's constraint starts where its parent's is now
            if p.adjusts_logits:
                plan.edited.append(i)
                plan.histories.append(self._history(seq))
        if guides:
            unique = list({id(g): g for g in guides}.values())
            at = {id(g): i for i, g in enumerate(unique)}
            plan.masks = self.constraints.bitmask(unique)[[at[id(g)] for g in guides]]
        if forced:  # with the forced rows' one-token masks, in plan.guided's order
            plan.masks = forced_masks(plan.guided, forced, plan.masks, self.constraints.tokenizer.vocab_size)
        step.overlappable = not (plan.guided or plan.edited or budgeted)
        return plan

    def _history(self, seq: Sequence) -> RowHistory:
        p = seq.request.params
        accepting = seq.guide is not None and seq.guide.matcher.is_accepting()
        return RowHistory(
            params=p,
            prompt_ids=seq.request.prompt_token_ids,
            output_ids=seq.token_ids[seq.num_prompt_tokens :],
            # where a constraint accepts, it decides whether the output ends: min_tokens yields
            stop_ids=[] if accepting else ([] if p.ignore_eos else self.eos_ids) + p.stop_token_ids,
        )


def _first_twin(first_with: dict[tuple, int], key: tuple, i: int, batch: list[ScheduledSeq], start: int) -> int:
    """Decode item i's twin group: the first item with its key and equal tokens before `start`, else i."""
    j = first_with.setdefault(key, i)
    return j if j != i and batch[j].seq.token_ids[:start] == batch[i].seq.token_ids[:start] else i


@functools.lru_cache(maxsize=64)
def _no_drafts(items: int) -> np.ndarray:
    mask = np.zeros(items, dtype=bool)
    mask.setflags(write=False)
    return mask


def as_tensor(values: list[int] | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, dtype=np.int64))
