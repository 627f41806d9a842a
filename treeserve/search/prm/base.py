"""What every PRM adapter is: (question, steps) -> model input -> one score per step.

An adapter only builds token ids and reads outputs; the runtime does the forward pass
(`Runtime.score`, forward-only, prefix-cached). Inputs are built so that the input for the
first k steps is a token-for-token prefix of the input for more steps; then scoring a new
step re-reads only the new tokens (the earlier ones are cached pages), and asking only
for the new steps' positions (`start=`) lets the engine skip the cached prefix.

Builders tokenize the prompt and each step's piece on its own (`encode`), and a beam is
scored once an iteration with all its steps: `encode` remembers each piece's ids, so a
beam's earlier steps, and the prompt every beam of a problem shares, are tokenized once.

An input whose read positions run past the PRM's context is refused (`PRMInputTooLong`,
naming both lengths), never truncated or scored 0: the search drops that beam and counts it
(`SearchContext.prm_too_long`), and a request with nothing left to answer is a 400.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from treeserve.outputs import ScoreOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import ScoreParams

ENCODED_PIECES = 1 << 16  # pieces `encode` remembers before it starts afresh


class PRMInputTooLong(ValueError):
    """A PRM input that the PRM's context cannot hold: `needed` positions (up to the last one
    read, inclusive) against the model's `limit` (its max_model_len)."""

    def __init__(self, model: str, needed: int, limit: int):
        self.model, self.needed, self.limit = model, needed, limit
        super().__init__(
            f"the PRM input needs {needed} tokens but PRM {model!r} reads at most {limit} "
            f"(its max_model_len): the solution has outgrown the verifier's context"
        )


class PRM(ABC):
    style: str = ""
    outcome: bool = False  # one reward a whole solution (an outcome RM, the verifiers' kind), not one a step

    def __init__(self, runtime: Runtime, model: str):
        self.runtime = runtime
        self.model = model
        self.tokenizer = runtime.tokenizer(model)
        self.on_input: Callable[[list[int]], None] | None = None  # sees every input built (for stats)
        self._encoded: dict[tuple[str, bool], tuple[int, ...]] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> tuple[int, ...]:
        """The tokenizer's ids of `text` (a prompt, or one step's piece of the input), remembered."""
        key = (text, add_special_tokens)
        ids = self._encoded.get(key)
        if ids is None:
            if len(self._encoded) >= ENCODED_PIECES:
                self._encoded.clear()
            ids = self._encoded[key] = tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return ids

    @abstractmethod
    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """Token ids of the whole input, and the position read for each step (len(steps) of them)."""

    @abstractmethod
    def score_params(self, positions: list[int]) -> ScoreParams:
        """What to read at those positions (candidate token log-probs and/or hidden states)."""

    @abstractmethod
    def read(self, out: ScoreOutput) -> list[float]:
        """One score in [0, 1] per read position (higher: the step is more likely correct)."""

    def saw_input(self, ids: list[int], on_input: Callable[[list[int]], None] | None) -> None:
        for hook in (self.on_input, on_input):
            if hook is not None:
                hook(ids)

    async def score(
        self, question: str, steps: list[str], start: int = 0, on_input: Callable[[list[int]], None] | None = None
    ) -> list[float]:
        """Scores of steps[start:] (steps before `start` are not re-read); `on_input` sees each input built."""
        if not steps or not 0 <= start < len(steps):
            raise ValueError(f"need at least one step to score after start={start}, got {len(steps)} steps")
        ids, positions = self.build(question, steps)
        limit = self.runtime.engine(self.model).max_model_len
        if positions[-1] >= limit:
            raise PRMInputTooLong(self.model, positions[-1] + 1, limit)
        ids = ids[: positions[-1] + 1]
        self.saw_input(ids, on_input)
        out = await self.runtime.score(self.model, ids, self.score_params(positions[start:]))
        return self.read(out)
