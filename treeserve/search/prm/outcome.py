"""Outcome reward models (ORMs): one reward for a whole solution, read at its last token.

Step i's score is sigmoid(reward) of the solution that ends with step i (the prefix rule)::

    <|im_start|>user\\nQ<|im_end|>\\n<|im_start|>assistant\\nstep 1\\n\\nstep 2<|im_end|>\\n"""

from __future__ import annotations

from collections.abc import Callable

import torch

from treeserve.outputs import ScoreOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import ScoreParams
from treeserve.search.prm.base import PRM, PRMInputTooLong
from treeserve.search.prm.reward_head import HEAD_TENSORS, two_layer_head
from treeserve.search.types import STEP_STOP


class OutcomeRM(PRM):
    style = "orm"
    outcome = True

    def __init__(self, runtime: Runtime, model: str, config: dict | None = None):
        super().__init__(runtime, model)
        config = config or {}
        if self.tokenizer.chat_template is None and "chat_template" not in config:
            raise ValueError(f"the orm style renders (question, solution) with a chat template; {model!r} has none")
        self.chat_template: str | None = config.get("chat_template")
        self.system_prompt: str | None = config.get("system_prompt")
        extra = runtime.engine(model).extra_tensors
        if all(name in extra for name in HEAD_TENSORS):  # Qwen2ForRewardModel's two layers
            self.head = [extra[name].float() for name in HEAD_TENSORS]
        elif "score.weight" in extra:
            self.head = [extra["score.weight"].float(), extra.get("score.bias", torch.zeros(1)).float()]
        else:
            raise ValueError(
                f"model {model!r} lacks an outcome reward head: score.weight [1, hidden] "
                f"or score.0/score.2 (Qwen2ForRewardModel)"
            )
        if self.head[-2].shape[0] != 1:
            raise ValueError(f"an outcome reward head has one output, got shape {tuple(self.head[-2].shape)}")

    def solution_ids(self, question: str, steps: list[str]) -> list[int]:
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": STEP_STOP.join(steps)}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, chat_template=self.chat_template
        )
        return list(self.encode(text))

    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """The whole solution's input; step i is read at the last token of steps[: i + 1]'s input."""
        positions = [len(self.solution_ids(question, steps[: i + 1])) - 1 for i in range(len(steps))]
        return self.solution_ids(question, steps), positions

    def score_params(self, positions: list[int]) -> ScoreParams:
        return ScoreParams(positions=positions, return_hidden_states=True)

    def _rewards(self, out: ScoreOutput) -> torch.Tensor:
        """The head's raw outputs at the read positions, [P]."""
        h = out.hidden_states
        if len(self.head) == 4:
            return two_layer_head(h, *self.head)[:, 0]
        w, b = self.head
        return (h @ w.T + b)[:, 0]

    def read(self, out: ScoreOutput) -> list[float]:
        return torch.sigmoid(self._rewards(out)).tolist()

    async def reward(self, question: str, steps: list[str]) -> float:
        """The ORM's raw reward of the whole solution `steps` (what its model card prints)."""
        out = await self._read_solution(question, steps)
        return self._rewards(out)[0].item()

    async def score(
        self, question: str, steps: list[str], start: int = 0, on_input: Callable[[list[int]], None] | None = None
    ) -> list[float]:
        if not steps or not 0 <= start < len(steps):
            raise ValueError(f"need at least one step to score after start={start}, got {len(steps)} steps")
        return [
            self.read(await self._read_solution(question, steps[: i + 1], on_input))[0]
            for i in range(start, len(steps))
        ]

    async def _read_solution(
        self, question: str, steps: list[str], on_input: Callable[[list[int]], None] | None = None
    ) -> ScoreOutput:
        ids = self.solution_ids(question, steps)
        limit = self.runtime.engine(self.model).max_model_len
        if len(ids) > limit:
            raise PRMInputTooLong(self.model, len(ids), limit)
        self.saw_input(ids, on_input)
        return await self.runtime.score(self.model, ids, self.score_params([len(ids) - 1]))
