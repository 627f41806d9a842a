"""What a step reads from the LM head: sampled tokens (greedy, temperature, top-k, top-p,
min-p, under constraint masks), their logprobs, scores and prompt logprobs.

A row's draw is one uniform hashed from (seed, completion index, position), so its token
depends only on its own logits and that key, never on the batch. Temperature divides the hidden
state before the LM head; logprobs are those of the raw distribution, as in vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from treeserve.engine.guided import unpack
from treeserve.engine.penalties import RowHistory, adjust_logits
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


def stream_key(seed: int, index: int) -> int:
    """What `seeded_uniform` hashes a position with: fixed per completion, so the engine keeps it."""
    return _mix64(_mix64(seed & _M64) ^ index)


_GOLDEN, _MUL1, _MUL2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """`_mix64` of every entry of a uint64 array (numpy wraps mod 2**64)."""
    x = x + _GOLDEN
    x = (x ^ (x >> _S30)) * _MUL1
    x = (x ^ (x >> _S27)) * _MUL2
    return x ^ (x >> _S31)


def seeded_uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`seeded_uniform` for arrays of (`stream_key` as uint64, position): the same float64 bits."""
    h = _mix64_array(keys ^ positions.astype(np.uint64))
    return (h >> _S11).astype(np.float64) * 2.0**-53


@functools.lru_cache(maxsize=64)
def _greedy_arrays(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrays = np.zeros(rows), np.ones(rows), np.zeros(rows, dtype=np.int64)
    for a in arrays:
        a.setflags(write=False)
    return arrays


@dataclass
class SamplingBatch:
    """Per-row sampling parameters (float64; top_k int64): temperature (0: greedy), top_p, top_k
    (<= 0: off), min_p, the row's uniform; `all_greedy`: every row is, known without reading them."""

    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    min_p: np.ndarray
    uniform: np.ndarray
    all_greedy: bool = False

    @classmethod
    def greedy(cls, rows: int) -> SamplingBatch:
        zeros, ones, no_top_k = _greedy_arrays(rows)
        return cls(zeros, ones, no_top_k, zeros, zeros, all_greedy=True)

    @classmethod
    def of(cls, temperature: object, top_p: object, top_k: object, min_p: object, uniform: object) -> SamplingBatch:
        arrays = [
            np.atleast_1d(np.asarray(v, dtype))
            for v, dtype in zip((temperature, top_p, top_k, min_p, uniform), _DTYPES, strict=True)
        ]
        rows = max(a.shape[0] for a in arrays)
        return cls(*(np.broadcast_to(a, (rows,)).copy() for a in arrays))

    def __len__(self) -> int:
        return self.uniform.shape[0]

    def take(self, rows: np.ndarray | list[int]) -> SamplingBatch:
        return SamplingBatch(*(getattr(self, name)[rows] for name in _ARRAYS), all_greedy=self.all_greedy)

    def divisors(self) -> np.ndarray:
        """What each row's hidden state is divided by before the LM head (greedy rows: 1)."""
        return np.where(self.temperature == 0.0, 1.0, self.temperature)

    def filtered(self, vocab: int) -> np.ndarray:
        """Rows that ask for top-k, top-p or min-p (the fused draws take none of them)."""
        return ((self.top_k > 0) & (self.top_k < vocab)) | (self.top_p < 1.0) | (self.min_p > 0)


_DTYPES = (np.float64, np.float64, np.int64, np.float64, np.float64)
_ARRAYS = ("temperature", "top_p", "top_k", "min_p", "uniform")

Draw = Callable[[torch.Tensor, SamplingBatch], torch.Tensor]


def _draw_c(scaled: torch.Tensor, rows: SamplingBatch) -> torch.Tensor:
    return cpu_kernels.sample_rows(scaled, rows.uniform)


def _draw_triton(scaled: torch.Tensor, rows: SamplingBatch) -> torch.Tensor:
    from treeserve.kernels.triton.sampling import sample_rows

    uniforms = torch.from_numpy(rows.uniform).to(scaled.device, non_blocking=True)
    return sample_rows(scaled, uniforms)


LMHead = Callable[[torch.Tensor, bool], torch.Tensor]  # (hidden rows, float32) -> logits
ToDevice = Callable[..., list[torch.Tensor]]


@dataclass
class SamplePlan:
    """What a step samples: rows of its (full) hidden states and each row's parameters."""

    rows: torch.Tensor  # [S] flat row indices
    params: SamplingBatch
    edited: list[int] = field(default_factory=list)  # rows whose raw logits get `penalties.adjust_logits`
    histories: list[RowHistory] = field(default_factory=list)  # of the edited rows, in their order
    guided: list[int] = field(default_factory=list)  # rows drawn under masks[i]: [len(guided), words] int32
    masks: torch.Tensor | None = None
    logprob_rows: list[int] = field(default_factory=list)  # rows whose token's logprobs (top logprobs_k) return
    logprobs_k: int = 0


def sample_plan(
    plan: SamplePlan, hidden: torch.Tensor, lm_head: LMHead, to_device: ToDevice, draw: Draw | None, vocab: int
) -> tuple[torch.Tensor, TokenLogprobs | None]:
    """The tokens of `plan`'s rows of `hidden` ([S], on the device) and its logprob rows' logprobs."""
    params = plan.params
    (index,) = to_device(plan.rows)
    states = hidden.index_select(0, index)
    scaled = states
    if not params.all_greedy:
        divisors = params.divisors()
        if plan.edited:
            divisors[plan.edited] = 1.0  # edited rows are divided after their edits
        if (divisors != 1.0).any():
            (scale,) = to_device(torch.from_numpy(divisors).to(states.dtype)[:, None])
            scaled = states / scale
    logits = lm_head(scaled, False)
    if plan.edited:
        raw = adjust_logits(logits[plan.edited].float(), plan.histories)
        (temps,) = to_device(torch.from_numpy(params.take(plan.edited).divisors()).float()[:, None])
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        plain = sorted(set(range(len(params))) - set(plan.edited))
        if plain:
            tokens[plain] = draw_rows(plan, plain, logits[plain], draw, vocab)
        tokens[plan.edited] = draw_rows(plan, plan.edited, raw / temps, draw, vocab)
    else:
        tokens = draw_rows(plan, None, logits, draw, vocab)
    if not plan.logprob_rows:
        return tokens, None
    wanted = torch.tensor(plan.logprob_rows, device=tokens.device)
    return tokens, token_logprobs(lm_head(states[wanted], True), tokens[wanted], plan.logprobs_k)


def draw_rows(
    plan: SamplePlan, rows: list[int] | None, scaled: torch.Tensor, draw: Draw | None, vocab: int
) -> torch.Tensor:
    """Tokens of sample rows `rows` (None: all); constrained rows under their masks."""
    if not plan.guided:
        return sample(scaled, plan.params if rows is None else plan.params.take(rows), draw)
    rows = list(range(len(plan.params))) if rows is None else rows
    params = plan.params.take(rows)
    mask_of = {row: i for i, row in enumerate(plan.guided)}
    guided = [i for i, row in enumerate(rows) if row in mask_of]
    if not guided:
        return sample(scaled, params, draw)
    masks = plan.masks[[mask_of[rows[i]] for i in guided]]
    if len(guided) == len(rows):
        return sample_masked(scaled, params, masks, vocab, draw)
    tokens = torch.empty(len(rows), dtype=torch.long, device=scaled.device)
    free = sorted(set(range(len(rows))) - set(guided))
    tokens[free] = sample(scaled[free], params.take(free), draw)
    tokens[guided] = sample_masked(scaled[guided], params.take(guided), masks, vocab, draw)
    return tokens


def fused_draw(attention_backend: str) -> Draw | None:
    """The batch-invariant fused plain draw for `attention_backend` (None: PyTorch's `_draw`)."""
    return {"cpu": _draw_c, "triton": _draw_triton}.get(attention_backend)


def sample(scaled_logits: torch.Tensor, rows: SamplingBatch, draw: Draw | None = _draw_c) -> torch.Tensor:
    """Token ids [B] of scaled_logits [B, V] (logits / temperature); each row goes to a picker by
    its own parameters (greedy, `draw`'s fused kernel, filtered draws), never by the batch."""
    if rows.all_greedy:
        return _argmax(scaled_logits)
    vocab = scaled_logits.shape[-1]
    fused = draw is _draw_triton or (draw is _draw_c and cpu_kernels.supports(scaled_logits))
    greedy = rows.temperature == 0.0
    filtered = rows.filtered(vocab) & ~greedy
    plain = ~greedy & ~filtered if fused else np.zeros_like(greedy)
    slow = ~greedy & ~plain
    tokens = None
    for pick, members in ((_argmax, greedy), (draw, plain), (_draw, slow)):
        if members.all():
            return pick(scaled_logits, rows)
        if members.any():
            if tokens is None:
                tokens = torch.empty(len(rows), dtype=torch.long, device=scaled_logits.device)
            index = np.flatnonzero(members)
            at = torch.from_numpy(index).to(scaled_logits.device)
            tokens[at] = pick(scaled_logits[at], rows.take(index))
    return tokens


def sample_masked(
    scaled_logits: torch.Tensor, rows: SamplingBatch, masks: torch.Tensor, vocab: int, draw: Draw | None = _draw_c
) -> torch.Tensor:
    """`sample` over what each row's bitmask allows (`masks` [B, ceil(vocab / 32)] int32, bit i =
    token i); -1 where a row allows nothing."""
    width = scaled_logits.shape[-1]
    direct = draw is _draw_c and cpu_kernels.supports(scaled_logits)
    fast = ~rows.filtered(width) if direct else np.zeros(len(rows), dtype=bool)
    tokens = torch.empty(len(rows), dtype=torch.long, device=scaled_logits.device)
    if fast.any():
        uniforms = np.where(rows.temperature == 0.0, -1.0, rows.uniform)[fast]
        if fast.all():
            return cpu_kernels.sample_rows_masked(scaled_logits, masks, vocab, uniforms)
        index = torch.from_numpy(np.flatnonzero(fast))
        tokens[index] = cpu_kernels.sample_rows_masked(scaled_logits[index], masks[index], vocab, uniforms)
    rest = np.flatnonzero(~fast)
    if rest.size:
        at = torch.from_numpy(rest)
        allowed = torch.zeros(rest.size, width, dtype=torch.bool)
        allowed[:, :vocab] = unpack(masks[at], vocab)[:, :width]
        logits = scaled_logits[at.to(scaled_logits.device)].float()
        logits = logits.masked_fill(~allowed.to(scaled_logits.device), float("-inf"))
        picked = sample(logits, rows.take(rest), draw)
        picked[~allowed.any(dim=-1).to(picked.device)] = -1
        tokens[at.to(tokens.device)] = picked
    return tokens


ARGMAX_CHUNK = 1024


def _argmax(logits: torch.Tensor, rows: SamplingBatch | None = None) -> torch.Tensor:
    """torch's argmax (the first maximum; the first NaN if any): one C call on a CPU, else a wide
    row in two passes (chunk maxima in the logits' dtype, then the first chunk holding the maximum)."""
    if cpu_kernels.supports(logits):
        return cpu_kernels.argmax_rows(logits)
    vocab = logits.shape[-1]
    if vocab < 16 * ARGMAX_CHUNK:
        return logits.float().argmax(dim=-1)
    pad = -vocab % ARGMAX_CHUNK
    if pad:
        logits = F.pad(logits, (0, pad), value=float("-inf"))
    chunks = logits.reshape(logits.shape[0], -1, ARGMAX_CHUNK)
    first = chunks.amax(dim=-1).float().argmax(dim=-1)  # argmax ranks NaN highest, as amax propagates it
    within = chunks[torch.arange(logits.shape[0], device=logits.device), first].float().argmax(dim=-1)
    return first * ARGMAX_CHUNK + within


def _draw(scaled: torch.Tensor, rows: SamplingBatch) -> torch.Tensor:
    """Inverse-CDF draw per row over the top-k / top-p / min-p filtered distribution."""
    device = scaled.device
    vocab = scaled.shape[-1]
    filtered = np.flatnonzero(((rows.top_k > 0) & (rows.top_k < vocab)) | (rows.top_p < 1.0))
    if filtered.size:
        scaled = scaled.float()
        index = torch.from_numpy(filtered).to(device)
        top_k = np.where(rows.top_k[filtered] > 0, rows.top_k[filtered], vocab)
        top_k = torch.from_numpy(top_k).to(device)
        top_p = torch.from_numpy(rows.top_p[filtered]).to(device)
        scaled[index] = _top_k_top_p(scaled[index], top_k, top_p)
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    if rows.min_p.any():
        limit = torch.from_numpy(rows.min_p).to(device, probs.dtype)[:, None] * probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < limit, 0.0)
    cdf = probs.cumsum_(dim=-1)
    uniform = torch.from_numpy(rows.uniform).to(device, cdf.dtype)
    picked = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    return picked.clamp_(max=vocab - 1)


@dataclass
class TokenLogprobs:
    """Log-probabilities of sampled tokens, as tensors on the logits' device until `host()`."""

    logprobs: torch.Tensor  # [R]; ranks [R], top_ids and top_logprobs [R, k]
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def host(self) -> HostLogprobs:
        return HostLogprobs(
            self.logprobs.tolist(), self.ranks.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        )


@dataclass
class HostLogprobs:
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def token_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, k: int) -> TokenLogprobs:
    """Log-probabilities of `tokens` and the top-k alternatives under the raw distribution."""
    raw = torch.log_softmax(raw_logits.float(), dim=-1)
    chosen = raw.gather(1, tokens[:, None])
    ranks = (raw > chosen).sum(dim=-1) + 1
    values, ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
    return TokenLogprobs(chosen.squeeze(1), ranks, ids, values)


@dataclass
class ScorePlan:
    """Forward-only read-outs at rows: log-probabilities of candidate ids, and (`states`) hidden states."""

    rows: torch.Tensor  # [R] flat row indices; token_ids [R, K] (padded; K may be 0)
    token_ids: torch.Tensor
    states: bool


@dataclass
class PromptLogprobPlan:
    """Log-probabilities of prompt tokens predicted by rows [start, stop) of the flat batch."""

    start: int
    stop: int
    targets: torch.Tensor  # [stop - start]
    k: int


def read_out(
    plan: ScorePlan | None, prompt: list[PromptLogprobPlan], hidden: torch.Tensor, lm_head: LMHead, to_device: ToDevice
) -> tuple[torch.Tensor | None, torch.Tensor | None, list[TokenLogprobs]]:
    """(scores, states, prompt logprobs) of `hidden`, on the device."""
    staged = to_device(*([plan.rows, plan.token_ids] if plan else []), *(read.targets for read in prompt))
    scores = states = None
    if plan is not None:
        index, ids, *staged = staged
        rows = hidden[index]
        if plan.token_ids.shape[1]:
            scores = torch.log_softmax(lm_head(rows, True), dim=-1).gather(1, ids)
        if plan.states:
            states = rows.float()
    reads = [
        token_logprobs(lm_head(hidden[read.start : read.stop], True), targets, read.k)
        for read, targets in zip(prompt, staged, strict=True)
    ]
    return scores, states, reads


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
