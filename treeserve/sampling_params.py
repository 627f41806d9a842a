"""Sampling and scoring parameters of one request (the vLLM-shaped public vocabulary).

This module owns validation of per-request parameters: every bad value raises a
`ValueError` naming the field before any engine state changes. It never touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS). The engine divides the hidden
# state by the temperature in the model's dtype, where 1e-75 is 0 in bf16.
GREEDY_BELOW = 1e-5


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
    skip_special_tokens: bool = True
    # Stop at the k-th occurrence of a stop string instead of the first (used by
    # speculative tree expansion to decode several reasoning steps ahead).
    n_stop_occurrences: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
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
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.n_stop_occurrences, int) or self.n_stop_occurrences < 1:
            raise ValueError(f"n_stop_occurrences must be >= 1, got {self.n_stop_occurrences!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class ScoreParams:
    """A forward-only request: read the model at chosen positions, generate nothing.

    `positions` index the request's tokens; the model's prediction *after* token `p` is
    returned. `token_ids` lists the candidate ids whose log-probabilities are wanted at
    every position (empty: none). `return_hidden_states` also returns the final (normed)
    hidden state at each position, for reward or value heads.
    """

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
