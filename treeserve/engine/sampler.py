"""Token sampling: greedy, temperature, top-k, top-p, min-p, logprobs; seeded per row.

Reproducibility: each row's random draw is one uniform number derived by hashing
(seed, completion index, position). A row's token therefore depends only on its own
logits and that key, never on which other rows share the batch; this is what makes a
seeded request give the same tokens alone or in a full batch, and what lets search
strategies give each beam a reproducible stream. The draw is an inverse-CDF lookup over
the filtered distribution in vocabulary order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int, position: int) -> float:
    """The uniform in [0, 1) used to sample the token at `position` of completion `index`."""
    h = _mix64(_mix64(_mix64(seed & _M64) ^ index) ^ position)
    return (h >> 11) * 2.0**-53


@dataclass
class SamplingRow:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    uniform: float
    num_logprobs: int | None


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: list[float] | None  # the sampled tokens' log-probabilities (raw distribution)
    ranks: list[int] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """logits: [B, V] float32, one row per entry of `rows`."""
    device = logits.device
    greedy = torch.tensor([r.temperature == 0.0 for r in rows], device=device)
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        tokens = torch.where(greedy, tokens, _sample_random(logits, rows))
    out = SamplerOutput(tokens.tolist(), None, None, None, None)
    wanted = [r.num_logprobs for r in rows if r.num_logprobs is not None]
    if wanted:
        raw = torch.log_softmax(logits, dim=-1)
        chosen = raw.gather(1, tokens[:, None])
        out.logprobs = chosen.squeeze(1).tolist()
        out.ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
        k = max(wanted)
        if k:
            values, ids = raw.topk(k, dim=-1)
            out.top_ids, out.top_logprobs = ids.tolist(), values.tolist()
    return out


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device = logits.device
    vocab = logits.shape[-1]
    temperature = torch.tensor([r.temperature or 1.0 for r in rows], device=device)
    scaled = logits / temperature[:, None]
    top_k = [r.top_k if r.top_k > 0 else vocab for r in rows]
    top_p = [r.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _top_k_top_p(scaled, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
    min_p = [r.min_p for r in rows]
    if any(min_p):
        probs = torch.softmax(scaled, dim=-1)
        limit = torch.tensor(min_p, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(probs < limit, float("-inf"))
    cdf = torch.softmax(scaled, dim=-1).double().cumsum(dim=-1)
    uniform = torch.tensor([r.uniform for r in rows], dtype=torch.float64, device=device)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    return picked.clamp_(max=vocab - 1)


def _top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask everything outside each row's top-k, then outside its top-p nucleus (vLLM's order)."""
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = ranks[None, :] >= top_k[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]  # always keeps the first token
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return scaled.masked_fill(mask, float("-inf"))
