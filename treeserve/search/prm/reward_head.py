"""Reward-head PRMs (Qwen2.5-Math-PRM style): `<extra_0>` after each step, a 2-class head on hidden states.
The assistant turn, left open: `<|im_start|>assistant\\nstep 1<extra_0>step 2<extra_0>`."""

from __future__ import annotations

import torch

from treeserve.outputs import ScoreOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import ScoreParams
from treeserve.search.prm.base import PRM

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
HEAD_TENSORS = ("score.0.weight", "score.0.bias", "score.2.weight", "score.2.bias")


class RewardHeadPRM(PRM):
    style = "reward_head"

    def __init__(self, runtime: Runtime, model: str, config: dict | None = None):
        super().__init__(runtime, model)
        config = config or {}
        self.system_prompt: str = config.get("system_prompt", SYSTEM_PROMPT)
        self.separator: str = config.get("step_separator_token", "<extra_0>")
        self.separator_id = self.tokenizer.hf.token_to_id(self.separator)
        if self.separator_id is None:
            raise ValueError(f"the tokenizer of {model!r} has no {self.separator!r} token to end steps with")
        extra = runtime.engine(model).extra_tensors
        missing = [name for name in HEAD_TENSORS if name not in extra]
        if missing:
            raise ValueError(f"model {model!r} lacks the reward head tensors {missing}")
        self.w0, self.b0, self.w2, self.b2 = (extra[name].float() for name in HEAD_TENSORS)
        if self.w2.shape[0] != 2:
            raise ValueError(f"score.2.weight must have 2 output classes, got shape {tuple(self.w2.shape)}")

    def prompt_ids(self, question: str) -> list[int]:
        """Tokens up to the assistant's first step (the template rendered with an open assistant turn)."""
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": question},
            {"role": "assistant", "content": self.separator},
        ]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
        return list(self.encode(text.removesuffix(self.separator)))

    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        ids, positions = self.prompt_ids(question), []
        for step in steps:
            ids += self.encode(step)
            positions.append(len(ids))
            ids.append(self.separator_id)
        return ids, positions

    def score_params(self, positions: list[int]) -> ScoreParams:
        return ScoreParams(positions=positions, return_hidden_states=True)

    def read(self, out: ScoreOutput) -> list[float]:
        logits = two_layer_head(out.hidden_states, self.w0, self.b0, self.w2, self.b2)
        return torch.softmax(logits, dim=-1)[:, 1].tolist()


def two_layer_head(
    h: torch.Tensor, w0: torch.Tensor, b0: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """`score.2(relu(score.0(h)))`: the Qwen2.5-Math PRM's and RM's head on hidden states [P, hidden]."""
    return torch.relu(h @ w0.T + b0) @ w2.T + b2
