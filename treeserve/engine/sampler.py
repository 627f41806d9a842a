"""Token sampling: greedy, temperature, top-k, top-p, min-p, logprobs; seeded per row.

Reproducibility: each row's random draw is one uniform number derived by hashing
(seed, completion index, position). A row's token therefore depends only on its own
logits and that key, never on which other rows share the batch; this is what makes a
seeded request give the same tokens alone or in a full batch, and what lets search
strategies give each beam a reproducible stream. The draw is an inverse-CDF lookup over
the filtered distribution in vocabulary order.

Temperature is applied before the LM head (hidden / T, then the matmul), which yields
logits / T without extra passes over a [batch, vocab] tensor; on a memory-bound CPU
those passes cost more than the matmul. Log-probabilities are always those of the raw
(unscaled) distribution, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treeserve.engine.guided import unpack
from treeserve.kernels import cpu as cpu_kernels

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


def temperatures(rows: list[SamplingRow]) -> list[float]:
    """What each row's hidden state is divided by before the LM head (greedy rows: 1)."""
    return [r.temperature or 1.0 for r in rows]


Draw = Callable[[torch.Tensor, list[SamplingRow]], torch.Tensor]


def _draw_c(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return cpu_kernels.sample_rows(scaled, [r.uniform for r in rows])


def _draw_triton(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    from treeserve.kernels.triton.sampling import sample_rows

    uniforms = torch.tensor([r.uniform for r in rows], dtype=torch.float64).to(scaled.device, non_blocking=True)
    return sample_rows(scaled, uniforms)


def fused_draw(attention_backend: str) -> Draw | None:
    """The kernel family's fused plain draw for an engine on `attention_backend` (one program
    or thread per row, so it is batch-invariant): C on a CPU, Triton with Triton attention,
    none (PyTorch's `_draw`) with SDPA."""
    return {"cpu": _draw_c, "triton": _draw_triton}.get(attention_backend)


def sample(scaled_logits: torch.Tensor, rows: list[SamplingRow], draw: Draw | None = _draw_c) -> torch.Tensor:
    """scaled_logits: [B, V] = logits / temperature, any float dtype. Returns token ids [B].

    Rows go to one of three pickers by their own parameters only (never by the batch):
    greedy, plain draws (`draw`, the backend's fused kernel, where it runs on these logits),
    filtered draws (PyTorch). Every picker runs on the logits' device.
    """
    vocab = scaled_logits.shape[-1]
    fused = draw is _draw_triton or (draw is _draw_c and cpu_kernels.supports(scaled_logits))
    pickers = {_argmax: [], draw: [], _draw: []}
    for i, r in enumerate(rows):
        if r.temperature == 0.0:
            pickers[_argmax].append(i)
        elif fused and not (0 < r.top_k < vocab or r.top_p < 1.0 or r.min_p > 0):
            pickers[draw].append(i)
        else:
            pickers[_draw].append(i)
    tokens = torch.empty(len(rows), dtype=torch.long, device=scaled_logits.device)
    for pick, members in pickers.items():
        if len(members) == len(rows):
            return pick(scaled_logits, rows)
        if members:
            index = torch.tensor(members, device=scaled_logits.device)
            tokens[index] = pick(scaled_logits[index], [rows[i] for i in members])
    return tokens


def sample_masked(
    scaled_logits: torch.Tensor, rows: list[SamplingRow], masks: torch.Tensor, vocab: int, draw: Draw | None = _draw_c
) -> torch.Tensor:
    """`sample` over the tokens each row's bitmask allows (`masks` [B, ceil(vocab / 32)] int32,
    bit i = token i; columns from `vocab` on never). Greedy and plain rows on the C kernels take
    one pass (`sample_rows_masked`); the others get -inf logits, then `sample`. -1 where a row
    allows nothing."""
    width = scaled_logits.shape[-1]
    direct = draw is _draw_c and cpu_kernels.supports(scaled_logits)
    fast = [i for i, r in enumerate(rows) if direct and not (0 < r.top_k < width or r.top_p < 1.0 or r.min_p > 0)]
    tokens = torch.empty(len(rows), dtype=torch.long, device=scaled_logits.device)
    if fast:
        uniforms = [-1.0 if rows[i].temperature == 0.0 else rows[i].uniform for i in fast]
        if len(fast) == len(rows):  # no copy of a [rows, vocab] slice
            return cpu_kernels.sample_rows_masked(scaled_logits, masks, vocab, uniforms)
        tokens[fast] = cpu_kernels.sample_rows_masked(scaled_logits[fast], masks[fast], vocab, uniforms)
    rest = sorted(set(range(len(rows))) - set(fast))
    if rest:
        allowed = torch.zeros(len(rest), width, dtype=torch.bool)
        allowed[:, :vocab] = unpack(masks[rest], vocab)[:, :width]
        logits = scaled_logits[rest].float().masked_fill(~allowed.to(scaled_logits.device), float("-inf"))
        picked = sample(logits, [rows[i] for i in rest], draw)
        picked[~allowed.any(dim=-1).to(picked.device)] = -1
        tokens[rest] = picked
    return tokens


ARGMAX_CHUNK = 1024


def _argmax(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """torch's argmax (the first maximum; the first NaN if any). A wide row goes in two passes:
    chunk maxima (vectorised, in the logits' dtype: no fp32 copy of the row), then the first
    chunk holding the row's maximum. On a CPU argmax over one 262k-token row runs one scalar
    loop (~0.35 ms); this takes ~0.05 ms."""
    vocab = logits.shape[-1]
    if vocab < 16 * ARGMAX_CHUNK:
        return logits.float().argmax(dim=-1)  # exact; bf16 argmax is ~5x slower on CPU
    pad = -vocab % ARGMAX_CHUNK
    if pad:
        logits = F.pad(logits, (0, pad), value=float("-inf"))
    chunks = logits.reshape(logits.shape[0], -1, ARGMAX_CHUNK)
    first = chunks.amax(dim=-1).float().argmax(dim=-1)  # argmax ranks NaN highest, as amax propagates it
    within = chunks[torch.arange(logits.shape[0], device=logits.device), first].float().argmax(dim=-1)
    return first * ARGMAX_CHUNK + within


def _draw(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Inverse-CDF draw per row over the top-k / top-p / min-p filtered distribution."""
    device = scaled.device
    vocab = scaled.shape[-1]
    filtered = [i for i, r in enumerate(rows) if 0 < r.top_k < vocab or r.top_p < 1.0]
    if filtered:  # sorting is costly on a CPU: only rows that ask for top-k/top-p pay for it
        scaled = scaled.float()
        index = torch.tensor(filtered, device=device)
        top_k = torch.tensor([rows[i].top_k if rows[i].top_k > 0 else vocab for i in filtered], device=device)
        top_p = torch.tensor([rows[i].top_p for i in filtered], device=device)
        scaled[index] = _top_k_top_p(scaled[index], top_k, top_p)
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    min_p = [r.min_p for r in rows]
    if any(min_p):
        limit = torch.tensor(min_p, device=device)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < limit, 0.0)
    cdf = probs.cumsum_(dim=-1)
    uniform = torch.tensor([r.uniform for r in rows], dtype=cdf.dtype, device=device)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    return picked.clamp_(max=vocab - 1)


@dataclass
class TokenLogprobs:
    logprobs: list[float]  # the chosen tokens' log-probabilities
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def token_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, k: int) -> TokenLogprobs:
    """Log-probabilities of `tokens` and the top-k alternatives under the raw distribution."""
    raw = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen = raw.gather(1, tokens[:, None])
    ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
    values, ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
    return TokenLogprobs(chosen.squeeze(1).tolist(), ranks, ids.tolist(), values.tolist())


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
