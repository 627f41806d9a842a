"""What an API process needs of a model it does not hold: its tokenizer and request checks.

The core process describes each model (`ModelInfo`); a `Frontend` checks requests with the
engine's own functions (engine/validation.py), so bad input is answered without the core.
"""

from __future__ import annotations

from dataclasses import dataclass

from treeserve.engine.guided import Constraints
from treeserve.engine.llm_engine import LLMEngine
from treeserve.engine.thinking import ThinkTokens
from treeserve.engine.validation import check_request, check_text_length, tokenize_prompt
from treeserve.models.tokenizer import Tokenizer
from treeserve.sampling_params import SamplingParams, ScoreParams


@dataclass
class ModelInfo:
    path: str
    max_model_len: int
    vocab_size: int
    has_lm_head: bool
    eos_token_ids: list[int]

    @classmethod
    def of(cls, engine: LLMEngine) -> ModelInfo:
        cfg = engine.model_config
        return cls(engine.config.model, engine.max_model_len, cfg.vocab_size, cfg.has_lm_head, cfg.eos_token_ids)


class Frontend:
    """The model-free half of an `LLMEngine`: `tokenizer`, `max_model_len`, `tokenize_prompt`,
    `check_text_length`, `check_request` (the API process's stand-in for `runtime.engine(name)`)."""

    def __init__(self, info: ModelInfo):
        self.info = info
        self.max_model_len = info.max_model_len
        self.tokenizer = Tokenizer(info.path, model_eos_ids=info.eos_token_ids)
        self.constraints = Constraints(self.tokenizer)
        self.think = ThinkTokens.of(self.tokenizer)

    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def check_text_length(self, text: str) -> None:
        check_text_length(self.tokenizer, text, self.max_model_len)

    def check_request(self, request_id: str, token_ids: list[int], params: SamplingParams | ScoreParams) -> None:
        info = self.info
        check_request(
            token_ids, params, info.vocab_size, info.has_lm_head, info.max_model_len, self.constraints, self.think
        )
