"""Value-head PRMs (Skywork-o1-Open-PRM style): a scalar head on the hidden state at each step end.
Skywork's `prepare_input`: `<|endoftext|>Q\\nstep 1\\nstep 2\\n`, read at each step token."""

from __future__ import annotations

import torch

from treeserve.outputs import ScoreOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import ScoreParams
from treeserve.search.prm.base import PRM


class ValueHeadPRM(PRM):
    style = "value_head"

    def __init__(self, runtime: Runtime, model: str, config: dict | None = None):
        super().__init__(runtime, model)
        config = config or {}
        self.step_token: str = config.get("step_token", "\n")
        step_ids = self.tokenizer.encode(self.step_token, add_special_tokens=False)
        if not step_ids:
            raise ValueError(f"step token {self.step_token!r} encodes to no tokens")
        self.step_token_id = step_ids[-1]
        extra = runtime.engine(model).extra_tensors
        if "v_head.summary.weight" not in extra:
            raise ValueError(f"model {model!r} lacks the value head tensor v_head.summary.weight")
        self.weight = extra["v_head.summary.weight"].float()
        bias = extra.get("v_head.summary.bias")
        self.bias = torch.zeros(1) if bias is None else bias.float()

    def prompt_ids(self, question: str) -> list[int]:
        bos = self.tokenizer.special_tokens.get("bos_token", "")
        return list(self.encode(bos + question + "\n", add_special_tokens=True))

    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        ids, positions = self.prompt_ids(question), []
        for step in steps:
            ids += self.encode(step)
            positions.append(len(ids))
            ids.append(self.step_token_id)
        return ids, positions

    def score_params(self, positions: list[int]) -> ScoreParams:
        return ScoreParams(positions=positions, return_hidden_states=True)

    def read(self, out: ScoreOutput) -> list[float]:
        return torch.sigmoid(out.hidden_states @ self.weight.T + self.bias)[:, 0].tolist()
