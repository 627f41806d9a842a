"""Token-classification PRMs (TRL's `PRMTrainer`): a `score` Linear on every token, P(label 1) at each step's end.
TRL's format, no chat template: `<bos>Q step 1\\nstep 2\\n`, read at each separator's last token."""

from __future__ import annotations

import torch

from treeserve.outputs import ScoreOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import ScoreParams
from treeserve.search.prm.base import PRM

TRL_STEP_SEPARATOR = "\n"  # trl.PRMConfig.step_separator's default


class TokenClassificationPRM(PRM):
    style = "token_classification"

    def __init__(self, runtime: Runtime, model: str, config: dict | None = None):
        super().__init__(runtime, model)
        config = config or {}
        self.separator: str = config.get("step_separator", TRL_STEP_SEPARATOR)
        self.separator_ids = tuple(self.tokenizer.encode(self.separator, add_special_tokens=False))
        if not self.separator_ids:
            raise ValueError(f"step separator {self.separator!r} encodes to no tokens")
        bos = self.tokenizer.special_tokens.get("bos_token")
        self.bos_id = None if bos is None else self.tokenizer.hf.token_to_id(bos)
        extra = runtime.engine(model).extra_tensors
        if "score.weight" not in extra:
            raise ValueError(f"model {model!r} lacks the token-classification head tensor score.weight")
        self.weight = extra["score.weight"].float()
        if self.weight.ndim != 2 or self.weight.shape[0] != 2:
            raise ValueError(
                f"score.weight must have 2 labels (TRL's PRM: 0 bad, 1 good), got shape {tuple(self.weight.shape)}"
            )
        bias = extra.get("score.bias")
        self.bias = torch.zeros(2) if bias is None else bias.float()

    def prompt_ids(self, question: str) -> list[int]:
        return ([] if self.bos_id is None else [self.bos_id]) + list(self.encode(question))

    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        ids, positions = self.prompt_ids(question), []
        for step in steps:
            ids += self.encode(step)
            ids += self.separator_ids
            positions.append(len(ids) - 1)
        return ids, positions

    def score_params(self, positions: list[int]) -> ScoreParams:
        return ScoreParams(positions=positions, return_hidden_states=True)

    def read(self, out: ScoreOutput) -> list[float]:
        return torch.softmax(out.hidden_states @ self.weight.T + self.bias, dim=-1)[:, 1].tolist()
