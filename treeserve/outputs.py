"""Result objects returned by the engine and the offline API (vLLM's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # (output tokens, text end) where each stop-string occurrence completed (n_stop_occurrences)
    stop_offsets: list[tuple[int, int]] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # per prompt token: None for the first, else the actual token's entry and the top k (vLLM's shape)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def merged(*outputs: RequestOutput) -> RequestOutput:
    """One `DELTA` output saying what consecutive ones say: per completion their text, tokens and
    logprobs joined, the prompt's logprobs from whichever has them, the rest as the newest says."""
    parts: dict[int, list[CompletionOutput]] = {}
    for out in outputs:
        for c in out.outputs:
            parts.setdefault(c.index, []).append(c)
    completions = []
    for index in sorted(parts):
        cs = parts[index]
        c = cs[-1]
        if len(cs) > 1:
            logprobs = None if c.logprobs is None else [e for part in cs for e in part.logprobs or []]
            c = replace(
                c,
                text="".join(part.text for part in cs),
                token_ids=[t for part in cs for t in part.token_ids],
                logprobs=logprobs,
            )
        completions.append(c)
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return replace(outputs[-1], outputs=completions, prompt_logprobs=prompt_logprobs)


@dataclass
class ScoreOutput:
    """What a forward-only request read: one row per requested position."""

    request_id: str
    prompt_token_ids: list[int]
    positions: list[int]
    logprobs: torch.Tensor | None  # [num_positions, num_candidate_ids], float32
    hidden_states: torch.Tensor | None  # [num_positions, hidden_size], float32
    num_cached_tokens: int = 0
    finished: bool = True
