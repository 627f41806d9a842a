"""What every PRM adapter is: (question, steps) -> model input -> one score per step.
The input for k steps is a token prefix of the input for more, so a new step re-reads only its
own tokens (`start=`). An input past the PRM's context raises `PRMInputTooLong`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from treeserve.outputs import ScoreOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import ScoreParams

ENCODED_PIECES = 1 << 16  # pieces `encode` remembers before it starts afresh


class PRMInputTooLong(ValueError):
    """A PRM input of `needed` positions (to the last one read) past the model's max_model_len."""

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
