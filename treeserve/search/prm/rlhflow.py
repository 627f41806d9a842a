"""Chat-format PRMs (RLHFlow/Llama3.1-8B-PRM-Deepseek-Data style): each step a user turn, '+' answers.
Step i's score is softmax([logit('+'), logit('-')])[0] just before the assistant's answer to it."""

from __future__ import annotations

from treeserve.outputs import ScoreOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import ScoreParams
from treeserve.search.prm.base import PRM
from treeserve.search.prm.step_tag import pair_probability


class RLHFlowPRM(PRM):
    style = "rlhflow"

    def __init__(self, runtime: Runtime, model: str, config: dict | None = None):
        super().__init__(runtime, model)
        config = config or {}
        if self.tokenizer.chat_template is None and "chat_template" not in config:
            raise ValueError(f"the rlhflow PRM style needs a chat template; model {model!r} has none")
        self.chat_template: str | None = config.get("chat_template")
        self.good_token = config.get("good_token", "+")
        self.good_id = config.get("good_token_id", self._last_id(self.good_token))
        self.bad_id = config.get("bad_token_id", self._last_id(config.get("bad_token", "-")))

    def _last_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"{text!r} encodes to no tokens")
        return ids[-1]

    def _render(self, conversation: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, chat_template=self.chat_template
        )

    def _extend(self, ids: list[int], before: str, after: str) -> None:
        if not after.startswith(before):
            raise ValueError(
                "the chat template re-renders earlier turns differently; it cannot be scored incrementally"
            )
        ids += self.encode(after[len(before) :])

    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        conversation: list[dict] = []
        ids: list[int] = []
        positions: list[int] = []
        rendered = ""
        for i, step in enumerate(steps):
            conversation.append({"role": "user", "content": f"{question} {step}" if i == 0 else step})
            asking = self._render(conversation, add_generation_prompt=True)
            self._extend(ids, rendered, asking)
            positions.append(len(ids) - 1)
            conversation.append({"role": "assistant", "content": self.good_token})
            rendered_answer = self._render(conversation, add_generation_prompt=False)
            self._extend(ids, asking, rendered_answer)
            rendered = rendered_answer
        return ids, positions

    def score_params(self, positions: list[int]) -> ScoreParams:
        return ScoreParams(positions=positions, token_ids=[self.good_id, self.bad_id])

    def read(self, out: ScoreOutput) -> list[float]:
        return pair_probability(out.logprobs)
