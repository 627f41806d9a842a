"""The one owner of a sequence's progress through steps (nano-vllm's `Scheduler.postprocess`).

`launched`: its tokens count as computed and each sampling sequence has a token in flight;
`read`: each result row goes to the sequence it names, unless that one finished since;
`roll_back`: it never ran. Nothing else writes `num_computed_tokens`, `num_pending` or
`pending_forks` once a sequence is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeserve.engine.guided import Constraints
from treeserve.engine.request import Request, SeqStatus, Sequence
from treeserve.engine.sampler import HostLogprobs
from treeserve.engine.scheduler import Scheduler
from treeserve.engine.speculative.speculator import Speculator
from treeserve.engine.step_plan import PreparedStep
from treeserve.engine.step_result import StepResult
from treeserve.kv.page_manager import PageManager
from treeserve.models.tokenizer import Tokenizer
from treeserve.outputs import Logprob

FINISHED = SeqStatus.FINISHED


@dataclass
class Verification:
    """One speculating sequence's draft, checked against the target's samples."""

    seq: Sequence
    drafted: int
    accepted: int = 0
    going: bool = True


class Postprocessor:
    def __init__(
        self,
        scheduler: Scheduler,
        pages: PageManager,
        tokenizer: Tokenizer,
        constraints: Constraints,
        speculator: Speculator | None,
        max_model_len: int,
    ):
        self.scheduler = scheduler
        self.pages = pages
        self.tokenizer = tokenizer
        self.constraints = constraints
        self.speculator = speculator
        self.max_model_len = max_model_len
        # the step being read's requests with an output (streams it touched, those that ended)
        self._outputs: dict[str, Request] = {}

    def launched(self, step: PreparedStep) -> None:
        """`step` is on its way: its tokens count as computed (drafted ones once accepted)."""
        for item in step.batch:
            item.seq.num_computed_tokens = item.start + item.num_tokens - len(item.draft)
        for r, row in enumerate(step.samples):
            if not (row.fork or row.draft_position):
                seq = row.seq
                seq.num_pending += 1
                seq.pending_row = r
                seq.pending_forks = 0  # its forks are sampled in this step (rows `fork` > 0)

    def roll_back(self, step: PreparedStep) -> None:
        for item in step.batch:
            if not item.seq.is_finished:
                item.seq.num_computed_tokens = item.start
        for row in step.samples:
            seq = row.seq
            if seq.is_finished:
                continue
            if row.fork:
                seq.pending_forks += 1
            elif row.is_next:
                seq.num_pending -= 1

    def read(self, step: PreparedStep, result: StepResult) -> tuple[list[Request], int]:
        """Apply `result` to the live sequences of `step`: the requests with an output, and the
        number of tokens it generated."""
        result.wait()  # its device-to-host copies (the step's only sync)
        outputs = self._outputs = {}
        if self.pages.enable_prefix_caching:
            page_size = self.pages.page_size
            for item in step.crossing:  # the pages before an item's start were keyed by earlier reads
                seq = item.seq
                computed = item.start + item.num_tokens - len(item.draft)
                if seq.status is not FINISHED and computed // page_size > len(seq.page_hashes):
                    self.pages.commit_full_pages(seq.page_table, seq.page_hashes, seq.token_ids, computed)
        for item in step.streaming:
            if item.seq.status is not FINISHED:
                outputs[item.seq.request.request_id] = item.seq.request
        if step.scoring:
            self._scores(step, result)
        for read, lp in zip(step.prompt_reads, result.prompt_logprobs, strict=True):
            lp = lp.host()
            for i, token in enumerate(read.targets):
                read.request.prompt_logprobs[read.index + i] = self.logprob_entry(token, lp, i, read.k)
        generated = self._samples(step, result) if step.samples else 0
        return list(outputs.values()), generated

    def _scores(self, step: PreparedStep, result: StepResult) -> None:
        for read in step.score_reads:
            seq = read.seq
            if seq.is_finished:
                continue
            score = seq.request.score
            for i, p in enumerate(read.positions):
                seq.score_rows[p] = (
                    result.scores[read.first + i, : len(score.token_ids)] if score.token_ids else None,
                    result.states[read.first + i] if score.return_hidden_states else None,
                )
        for item in step.batch:
            seq = item.seq
            if seq.request.score is not None and not seq.is_finished and item.end == len(seq.token_ids):
                seq.finish_reason = "stop"
                self._end(seq)

    def _samples(self, step: PreparedStep, result: StepResult) -> int:
        """Each sampled token to its sequence; how many it appended."""
        logprobs = result.logprobs.host() if result.logprobs is not None else None
        logprob_at = {id(step.samples[r]): i for i, r in enumerate(step.plan.sample.logprob_rows)} if logprobs else {}
        drafts = step.drafts
        forks: dict[tuple[int, int], Sequence] = {}
        verifying: dict[int, Verification] = {}
        void = 0  # rows whose token is appended to nothing
        for row, token in zip(step.samples, result.sampled(), strict=True):
            seq = row.seq
            plain = row is seq.next_row  # a plain decode: no fork, draft, logprobs or constraint
            if plain or not (row.fork or row.draft_position):  # the sequence's next token
                if seq.status is FINISHED:
                    void += 1
                    continue
                seq.num_pending -= 1
                if plain:
                    ids = seq.token_ids
                    if len(ids) + 1 < seq.check_len and token not in seq.ending_ids:
                        ids.append(token)  # no stop rule can end it: its checker counts it in `ids`
                        continue
                    draft = None
                else:
                    for fork in range(1, row.forks + 1):
                        forks[(seq.seq_id, fork)] = self._fork(seq, fork)
                    draft = drafts.get(seq.seq_id)
            elif row.fork:
                seq = forks.get((seq.seq_id, row.fork))
                if seq is None:
                    void += 1
                    continue
                draft = None
            else:
                draft = drafts[seq.seq_id]
            if draft is not None:
                check = verifying.setdefault(seq.seq_id, Verification(seq, len(draft)))
                if not check.going:
                    void += 1
                    continue  # an earlier position of this draft was rejected
            if seq.guide is not None and not seq.guide.advance(token):
                seq.finish_reason, seq.stop_reason = "abort", None  # the constraint library contradicted itself
                self._end(seq)
                void += 1
                going = False
            else:
                going = self._append(seq, token, logprobs, logprob_at.get(id(row), -1) if logprob_at else -1)
            if draft is not None:
                position = row.draft_position
                matched = position < len(draft) and token == draft[position]
                check.accepted += matched
                check.going = going and matched
        for check in verifying.values():
            seq = check.seq
            self.speculator.verified(seq, check.drafted, check.accepted)
            if not seq.is_finished:  # the accepted drafted tokens' KV is valid, the rest is dropped
                seq.num_computed_tokens += check.accepted
                self.pages.commit_full_pages(seq.page_table, seq.page_hashes, seq.token_ids, seq.num_computed_tokens)
                self.pages.truncate(seq.page_table, len(seq.token_ids))
        return len(step.samples) - void

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        pages = -(-len(parent.token_ids) // self.pages.page_size)
        sibling = parent.fork(index, self.pages.fork(parent.page_table[:pages]))
        constraint = parent.request.params.structured_outputs
        if constraint is not None:
            sibling.guide = self.constraints.guide(constraint)
        parent.request.seqs.append(sibling)
        self.scheduler.add_running(sibling)
        return sibling

    def _append(self, seq: Sequence, token: int, logprobs: HostLogprobs | None, row: int) -> bool:
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.cumulative_logprob += logprobs.logprobs[row]
            seq.logprobs.append(self.logprob_entry(token, logprobs, row, seq.request.params.logprobs))
        result = seq.detok.append(token)
        if result is None and len(seq.token_ids) >= self.max_model_len:
            result = ("length", None)
        if result is not None:
            seq.finish_reason, seq.stop_reason = result
            self._end(seq)
            return False
        return True

    def _end(self, seq: Sequence) -> None:
        """`seq` ended by what a step that ran gave it, so the KV it was read back with is written:
        its last page's tokens may be cached (the last sampled token was never an input; a token
        in flight is not counted)."""
        written = min(seq.num_computed_tokens, len(seq.token_ids) - (seq.request.score is None))
        self.pages.cache_tail(seq.page_table, seq.page_hashes, seq.token_ids, written)
        self.scheduler.finish(seq)
        self._outputs[seq.request.request_id] = seq.request

    def logprob_entry(self, token: int, lp: HostLogprobs, i: int, k: int) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entry = {token: Logprob(lp.logprobs[i], lp.ranks[i], decode([token], False))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids[i][:k], lp.top_logprobs[i][:k], strict=True), 1):
            entry.setdefault(tid, Logprob(value, rank, decode([tid], False)))
        return entry
