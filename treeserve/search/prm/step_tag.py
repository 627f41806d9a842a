"""Step-tag PRMs (Math-Shepherd style): a tag token after each step, P(good) vs P(bad) at the tag.
The shipped arithmetic PRM reads `<|bos|><|user|>Q<|end|><|assistant|>step 1<|step|>\\n\\nstep 2<|step|>`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from treeserve.outputs import ScoreOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import ScoreParams
from treeserve.search.prm.base import PRM

# peiyi9979/math-shepherd-mistral-7b-prm: f"{question} {step 1} ки\n{step 2} ки..."
MATH_SHEPHERD = {
    "step_tag": "ки",
    "good_token": "+",
    "bad_token": "-",
    "prompt_format": "{question}",
    "first_step_prefix": " ",
    "step_format": "{step} ки",
    "step_separator": "\n",
}


@dataclass
class StepTagFormat:
    step_tag: str
    good_token: str = "+"
    bad_token: str = "-"
    prompt_format: str = "{question}"  # "{question}" or "{problem}" is replaced by the question
    step_format: str = ""  # must contain "{step}" and end with step_tag; "" means "{step}" + step_tag
    step_separator: str = "\n\n"
    first_step_prefix: str = ""
    use_chat_template: bool = False  # prompt = chat template of one user turn instead of prompt_format
    step_tag_id: int | None = None  # ids override the tokenizer's encoding of the strings above
    good_token_id: int | None = None
    bad_token_id: int | None = None

    @classmethod
    def from_config(cls, config: dict | None) -> StepTagFormat:
        """Settings from a prm_config.json dict; Math-Shepherd's where it names no step tag."""
        config = config or {}
        known = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in config.items() if k in known}
        return cls(**given) if "step_tag" in given else cls(**{**MATH_SHEPHERD, **given})

    def __post_init__(self) -> None:
        self.step_format = self.step_format or "{step}" + self.step_tag
        if not self.step_tag or "{step}" not in self.step_format or not self.step_format.endswith(self.step_tag):
            raise ValueError(f"step_format {self.step_format!r} must contain '{{step}}' and end with the step tag")


class StepTagPRM(PRM):
    style = "step_tag"

    def __init__(self, runtime: Runtime, model: str, config: dict | None = None):
        super().__init__(runtime, model)
        self.format = fmt = StepTagFormat.from_config(config)
        self.tag_id = fmt.step_tag_id if fmt.step_tag_id is not None else self._last_id(fmt.step_tag)
        self.good_id = fmt.good_token_id if fmt.good_token_id is not None else self._single_id(fmt.good_token)
        self.bad_id = fmt.bad_token_id if fmt.bad_token_id is not None else self._single_id(fmt.bad_token)

    def _last_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"{text!r} encodes to no tokens")
        return ids[-1]

    def _single_id(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"label token {text!r} must encode to one token, got {ids}; set its id in prm_config.json")
        return ids[0]

    def prompt_ids(self, question: str) -> list[int]:
        fmt = self.format
        if fmt.use_chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": question}])
            return list(self.encode(text))
        text = fmt.prompt_format.replace("{question}", question).replace("{problem}", question)
        return list(self.encode(text, add_special_tokens=True))

    def build(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        fmt = self.format
        ids, tags = self.prompt_ids(question), []
        for i, step in enumerate(steps):
            lead = fmt.step_separator if i else fmt.first_step_prefix
            ids += self.encode(lead + fmt.step_format.replace("{step}", step.strip()))
            if ids[-1] != self.tag_id:
                raise ValueError(f"step {i} does not end with the step tag token {self.tag_id} once tokenized")
            tags.append(len(ids) - 1)
        return ids, tags

    def score_params(self, positions: list[int]) -> ScoreParams:
        return ScoreParams(positions=positions, token_ids=[self.good_id, self.bad_id])

    def read(self, out: ScoreOutput) -> list[float]:
        return pair_probability(out.logprobs)


def pair_probability(logprobs: torch.Tensor) -> list[float]:
    """P(first) under a softmax over two candidates, from their [P, 2] full-vocabulary log-probs."""
    return torch.sigmoid(logprobs[:, 0] - logprobs[:, 1]).tolist()
