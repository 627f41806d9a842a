"""Per-request sampling and scoring parameters (vLLM's vocabulary); a bad value raises a `ValueError`
naming the field before any engine state changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

# temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing by 1e-75 in bf16 divides by 0
GREEDY_BELOW = 1e-5


class RequestOutputKind(Enum):
    """What a streamed request's outputs hold (vLLM's names): everything so far (`CUMULATIVE`), what
    is new (`DELTA`; text a stop string may still cut is held back), or one output at the end
    (`FINAL_ONLY`). A request that does not stream has one output, the whole."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): exactly one of a JSON schema (a dict
    or its JSON text), any JSON object, a regex the whole output must match, a list of choices
    (the output is one of them), or a grammar (Lark, or GBNF/EBNF with `::=` rules)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            what = f"{len(given)} ({', '.join(given)})" if given else "none"
            raise ValueError(
                f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got {what}"
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object or its text), got {self.json!r:.80}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {value!r:.80}")
        choice = self.choice
        if choice is not None and (not isinstance(choice, list) or not all(isinstance(c, str) and c for c in choice)):
            raise ValueError(f"structured_outputs.choice must be a list of non-empty strings, got {choice!r:.80}")

    @property
    def key(self) -> str:
        """The constraint as one string (what compiled constraints are cached by)."""
        import json

        return json.dumps([self.json, self.regex, self.choice, self.grammar, self.json_object], sort_keys=True)


@dataclass
class SamplingParams:
    """How to sample one request's completions (same names and meanings as vLLM)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (vLLM)
    skip_special_tokens: bool = True
    # penalties and biases, applied to the raw logits before temperature (vLLM's order)
    presence_penalty: float = 0.0  # OpenAI: minus this for every token generated at least once
    frequency_penalty: float = 0.0  # OpenAI: minus this times each token's count in the output
    repetition_penalty: float = 1.0  # transformers/vLLM: tokens in the prompt or the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are blocked until this many tokens exist
    n_stop_occurrences: int = 1  # stop at the k-th stop-string occurrence (search decodes steps ahead)
    structured_outputs: StructuredOutputsParams | None = None  # masks applied before the seeded draw
    # at most this many tokens in a `<think>` block before `</think>` is written (None: none; max_tokens bounds all)
    max_thinking_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:  # JSON object keys arrive as strings
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        self._validate()
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # greedy, as in vLLM; dividing by it would overflow (or underflow in bf16)

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be an integer >= 0, got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        # bounded below so that dividing an fp32 logit by it cannot overflow to inf
        if not isinstance(self.repetition_penalty, int | float) or not 0.01 <= self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in [0.01, 2], got {self.repetition_penalty!r}")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token}")
            if not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.n_stop_occurrences, int) or self.n_stop_occurrences < 1:
            raise ValueError(f"n_stop_occurrences must be >= 1, got {self.n_stop_occurrences!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        budget = self.max_thinking_tokens
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise ValueError(f"max_thinking_tokens must be an integer >= 0 or None, got {budget!r}")
        if self.structured_outputs is not None:
            if budget is not None:
                raise ValueError(
                    "max_thinking_tokens cannot be combined with structured_outputs: the constraint would "
                    "have to allow the think block the budget closes"
                )
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            if self.ignore_eos:
                raise ValueError(
                    "ignore_eos cannot be combined with structured_outputs: the constraint decides where output ends"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler edits this request's raw logits (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


@dataclass
class ScoreParams:
    """A forward-only request, generating nothing: at each of `positions` (token indices) the model's
    prediction *after* that token, as log-probabilities of the candidate `token_ids` and/or, with
    `return_hidden_states`, the final normed hidden state (for reward or value heads)."""

    positions: list[int]
    token_ids: list[int] = field(default_factory=list)
    return_hidden_states: bool = False

    def __post_init__(self) -> None:
        self.positions = list(self.positions)
        self.token_ids = list(self.token_ids)
        if not self.positions:
            raise ValueError("ScoreParams.positions must name at least one position")
        if any(not isinstance(p, int) or p < 0 for p in self.positions):
            raise ValueError(f"positions must be non-negative integers, got {self.positions!r}")
        if self.positions != sorted(set(self.positions)):
            raise ValueError("positions must be strictly increasing")
        if any(not isinstance(t, int) or t < 0 for t in self.token_ids):
            raise ValueError(f"token_ids must be non-negative integers, got {self.token_ids!r}")
        if not self.token_ids and not self.return_hidden_states:
            raise ValueError("ask for token_ids log-probabilities, hidden states, or both")
