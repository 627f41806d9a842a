"""Request and Sequence: the only mutable records the engine keeps per request.

A `Request` is what a caller submitted; a `Sequence` is one token stream the scheduler runs. A
request with `n > 1` runs one sequence through the prompt, then forks `n - 1` siblings sharing its pages.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum
from operator import attrgetter
from typing import TYPE_CHECKING

import torch

from treeserve.engine.detokenizer import StopChecker
from treeserve.engine.speculative.prompt_lookup import DraftState
from treeserve.outputs import CompletionOutput, Logprob, RequestOutput, ScoreOutput
from treeserve.sampling_params import SamplingParams, ScoreParams

if TYPE_CHECKING:
    from treeserve.engine.guided import Guide
    from treeserve.engine.thinking import ThinkState

_seq_ids = itertools.count()
_INDEX = attrgetter("index")
TWIN_KEY_TOKENS = 16
HISTORY_ANCHOR = 64  # `Sequence.history_key` hashes the history whole at multiples of this


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    # Fields by writer; those a decode step reads first, in the object's first two cache lines.
    # -- read every step. Made with the sequence (the postprocessor appends to `token_ids`)
    request: Request
    token_ids: list[int]
    detok: StopChecker | None
    # a token not in `ending_ids` keeping `token_ids` under `check_len` cannot end it (`quiet_stops`)
    ending_ids: frozenset[int] = frozenset()
    check_len: int = 0
    quiet: bool = False  # its request is `plain` and does not stream: a decode reads nothing of it
    # the scheduler's
    status: SeqStatus = SeqStatus.WAITING
    page_table: list[int] = field(default_factory=list)
    # the postprocessor's: its progress (the scheduler sets where it starts)
    num_computed_tokens: int = 0
    # tokens sampled, not yet read back; the newest is row `pending_row` of the step in flight's samples
    num_pending: int = 0
    pending_row: int = -1
    pending_forks: int = 0  # siblings to fork when the prompt is computed
    # the input batch's
    row: int = -1
    next_row: object = None  # the `step_plan.SampleRow` of its next token, made once
    guide: Guide | None = None  # where it is in its constraint (a fork's: made by the postprocessor)
    # the speculator's: this step's drafted tokens
    draft: list[int] | tuple[()] = ()
    # -- read by what a plain decode does not do. Made with the sequence
    index: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    order: tuple[int, int] = field(init=False)  # the scheduler's order: (its request's arrival, index)
    # the scheduler's: prefix-cache keys of its full pages, and of the prompt pages it computes
    # itself from page `promised_from` on (others needing them wait for the cache)
    page_hashes: list[int] = field(default_factory=list)
    promised_pages: list[int] = field(default_factory=list)
    promised_from: int = 0
    # the postprocessor's: its output
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # forward-only requests: what was read at each requested position (a recompute overwrites)
    score_rows: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = field(default_factory=dict)
    # the input batch's: a hash of token_ids[:hashed] (`history_key`; twin rows: dedup.py)
    history_hash: int | None = None
    hashed: int = 0
    drafting: DraftState | None = None  # the speculator's
    thinking: ThinkState | None = None
    # its DELTA outputs' (`delta`): tokens and characters given so far, and whether its end was
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_end: bool = False

    def __post_init__(self) -> None:
        self.order = (self.request.arrival, self.index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def history_key(self, n: int) -> tuple[int, int]:
        """(n, a hash of the first n ids): equal for equal ids, wherever hashing began."""
        base = n - n % HISTORY_ANCHOR
        if self.history_hash is None or not base <= self.hashed <= n:
            self.history_hash, self.hashed = hash(tuple(self.token_ids[:base])), base
        for token in self.token_ids[self.hashed : n]:
            self.history_hash = hash((self.history_hash, token))
        self.hashed = n
        return n, self.history_hash

    def fork(self, index: int, page_table: list[int]) -> Sequence:
        """A sibling at this sequence's state before its first sampled token, on `page_table`."""
        tokens = list(self.token_ids)
        return Sequence(
            request=self.request,
            index=index,
            token_ids=tokens,
            detok=self.detok.clone(self.token_ids[self.num_prompt_tokens :], tokens) if self.detok else None,
            ending_ids=self.ending_ids,
            check_len=self.check_len,
            quiet=self.quiet,
            status=self.status,
            num_computed_tokens=len(self.token_ids),
            page_table=page_table,
            page_hashes=list(self.page_hashes),
            logprobs=[] if self.logprobs is not None else None,
            history_hash=self.history_hash,
            hashed=self.hashed,
        )

    def completion(self) -> CompletionOutput:
        return self._output(
            self.detok.text if self.detok else "", self.token_ids[self.num_prompt_tokens :], self.logprobs
        )

    def delta(self) -> CompletionOutput | None:
        """What this completion added since its last delta (None: nothing); text is never taken back."""
        if self.sent_end:
            return None
        ended = self.finish_reason is not None
        first = self.sent_tokens
        tokens = self.token_ids[self.num_prompt_tokens + first :]
        text = ""
        if self.detok is not None:
            whole = self.detok.text
            end = len(whole) if ended else max(len(whole) - self.detok.hold, self.sent_chars)
            text, self.sent_chars = whole[self.sent_chars : end], end
        if not tokens and not text and not ended:
            return None
        self.sent_tokens += len(tokens)
        self.sent_end = ended
        return self._output(text, tokens, None if self.logprobs is None else self.logprobs[first:])

    def _output(self, text: str, token_ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            stop_offsets=list(self.detok.stop_offsets) if self.detok else [],
        )


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | None  # generation
    score: ScoreParams | None  # forward-only
    seed: int
    arrival: int
    stream: bool = False
    delta: bool = False
    began: bool = False  # it had an output (DELTA outputs give the prompt's logprobs in the first only)
    draft_group: str | None = None
    # a generation whose rows need nothing but their next token (no logprobs, prompt logprobs,
    # constraint, logit edits or thinking budget): its decodes take the short paths
    plain: bool = False
    # a hash of the prompt's first TWIN_KEY_TOKENS ids (None: shorter): twins have equal keys or a None
    prompt_key: int | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) != self.width:
            return False
        if len(seqs) == 1:
            return seqs[0].status is SeqStatus.FINISHED
        return all(seq.status is SeqStatus.FINISHED for seq in seqs)

    @property
    def width(self) -> int:
        return self.params.n if self.params else 1

    def output(self, finished: bool) -> RequestOutput | ScoreOutput | None:
        """Its output now; None for a stream of DELTA outputs with nothing new."""
        if self.score is not None:
            rows = [self.seqs[0].score_rows[p] for p in self.score.positions]
            return ScoreOutput(
                request_id=self.request_id,
                prompt_token_ids=self.prompt_token_ids,
                positions=self.score.positions,
                logprobs=torch.stack([r[0] for r in rows]) if self.score.token_ids else None,
                hidden_states=torch.stack([r[1] for r in rows]) if self.score.return_hidden_states else None,
                num_cached_tokens=self.num_cached_tokens,
                finished=finished,
            )
        seqs = self.seqs if len(self.seqs) == 1 else sorted(self.seqs, key=_INDEX)
        prompt_logprobs = self.prompt_logprobs
        if self.delta:
            completions = [c for s in seqs if (c := s.delta()) is not None]
            if not completions and not finished:
                return None
            prompt_logprobs, self.began = None if self.began else prompt_logprobs, True
        else:
            completions = [s.completion() for s in seqs]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
