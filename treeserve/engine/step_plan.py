"""The step's contract, host to device: what one step runs, and what each of its rows means.

Data only. `input_batch.py` writes a `PreparedStep`, `model_runner.py` runs its `StepPlan`, and
`postprocess.py` reads the results back through it; sampled row r is `samples[r]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from treeserve.engine.forward_batch import ForwardBatch
from treeserve.engine.sampler import PromptLogprobPlan, SamplePlan, ScorePlan

if TYPE_CHECKING:
    from treeserve.engine.request import Request, Sequence
    from treeserve.engine.scheduler import ScheduledSeq


@dataclass
class StepPlan:
    """Everything the device needs for one step; nothing in it changes once it is built."""

    batch: ForwardBatch
    pending_at: np.ndarray  # [P] flat rows whose token is the previous step's sample ...
    pending_from: np.ndarray  # [P] ... at these sample rows of it
    twins: np.ndarray | None = None  # [B] per item: first item of its twin group (`dedup.py`), -1: none
    copies: list[tuple[int, int]] = field(default_factory=list)  # pages to copy before the forward
    sample: SamplePlan | None = None
    scores: ScorePlan | None = None
    prompt_logprobs: list[PromptLogprobPlan] = field(default_factory=list)
    fail: Exception | None = None  # test hook (`LLMEngine.inject_failure`): raised after the forward


@dataclass(slots=True)
class SampleRow:
    """One sampled row: `seq`'s next token; with `fork` > 0 the first token of that fork (made
    when the parent's row, which counts its `forks`, arrives); with `draft_position` > 0 the
    target's token after drafted token `draft_position - 1` (it verifies drafted token `draft_position`)."""

    seq: Sequence
    fork: int = 0
    forks: int = 0
    draft_position: int = 0

    @property
    def is_next(self) -> bool:
        return not self.fork and not self.draft_position


@dataclass
class ScoreRead:
    """A forward-only sequence's requested positions in this step, from flat score row `first`."""

    seq: Sequence
    positions: list[int]
    first: int


@dataclass
class PromptRead:
    """Prompt tokens `targets` (from prompt position `index`) whose logprobs this step returns."""

    request: Request
    index: int
    targets: list[int]
    k: int


@dataclass
class PreparedStep:
    """A step's plan and the host's key to its results (the rows, in the plan's order)."""

    batch: list[ScheduledSeq]
    plan: StepPlan | None = None  # set once the batch is read
    samples: list[SampleRow] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> the draft it runs this step
    score_reads: list[ScoreRead] = field(default_factory=list)
    prompt_reads: list[PromptRead] = field(default_factory=list)
    scoring: bool = False  # it holds forward-only requests
    crossing: list[ScheduledSeq] = field(default_factory=list)  # items that complete a page (cache keys)
    streaming: list[ScheduledSeq] = field(default_factory=list)
    overlappable: bool = True  # no row needs its token on the host before it samples again
