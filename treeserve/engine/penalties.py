"""Edits to a row's raw logits before temperature: logit bias, min_tokens, penalties.

vLLM's order: logit bias and the min_tokens block, then the repetition penalty (a logit of a
prompt or output token divided by it when positive, multiplied when negative), then OpenAI's
frequency and presence penalties. Each edit reads only its own row, so outputs stay batch-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeserve.sampling_params import SamplingParams


@dataclass
class RowHistory:
    """What the edits of one row read: its parameters and its tokens so far."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: list[int]  # EOS and stop_token_ids: blocked while the output is shorter than min_tokens


def adjust_logits(logits: torch.Tensor, rows: list[RowHistory]) -> torch.Tensor:
    """logits: [B, V] float32, edited in place (and returned)."""
    device = logits.device
    for row, history in zip(logits, rows, strict=True):
        p = history.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=device))
        if len(history.output_ids) < p.min_tokens and history.stop_ids:
            row[torch.tensor(history.stop_ids, device=device)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(history.prompt_ids) | set(history.output_ids)), device=device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and history.output_ids:
            ids, counts = torch.tensor(history.output_ids, device=device).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    return logits
