"""Fused MoE: routed experts' gated MLPs as two grouped GEMMs over expert-sorted rows (vLLM's and
SGLang's `fused_moe`, shorter). Slots sorted by expert (the sum runs in `SparseMoE`'s order);
`align_to_blocks` pads each expert's run to BLOCK_M without a host sync; `_grouped_gemm` does
gate_up, then act * up, then down with the routing weight; `_sum_slots` adds a row's k results.
Rounded where PyTorch rounds (fp32 within ~1e-6, bf16 an ulp or two); not batch-invariant (a
row's bits depend on its block). Tile sizes follow vLLM's default config, untuned on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve.kernels.triton.activation import gated_activation
from treeserve.kernels.triton.rounding import round_to

BLOCK_N, BLOCK_K = 64, 32
SUM_BLOCK = 1024


def block_rows(pairs: int, num_experts: int) -> int:
    """Rows per block: 16 while experts see a row or so each (decode), 64 once they see many."""
    return 16 if pairs <= 16 * num_experts else 64


def align_to_blocks(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(sorted_ids, block_experts, total) for `experts` [T, k]: flat (row * k + slot) ids grouped
    by expert, each run padded with T * k to a multiple of block_m; shapes depend on T, k, E only."""
    flat = experts.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    firsts = counts.cumsum(0) - counts
    dest = (ends - padded)[by_expert] + torch.arange(pairs, device=flat.device) - firsts[by_expert]
    blocks = triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)
    sorted_ids = torch.full((blocks * block_m,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_experts, ends[-1:]


@triton.jit
def _grouped_gemm(
    a_ptr,
    w_ptr,
    c_ptr,
    weights_ptr,
    sorted_ptr,
    block_expert_ptr,
    total_ptr,
    pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,
    WEIGHTED: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[id] = A[id // A_ROW_DIV] @ W[expert].T (times weights[id] where WEIGHTED); padding ids skip."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    ids = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = ids < pairs
    rows = ids // A_ROW_DIV
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dtype: tl.constexpr = c_ptr.dtype.element_ty
    w_base = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w, input_precision="ieee")
    out = round_to(acc, dtype)
    if WEIGHTED:
        scale = tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)
        out = round_to(out * scale[:, None], dtype)
    tl.store(c_ptr + ids[:, None] * stride_cm + cols[None, :], out.to(dtype), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _sum_slots(y_ptr, out_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    acc = tl.load(y_ptr + t * TOP_K * H + cols, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOP_K):
        acc = round_to(acc + tl.load(y_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32), dtype)
    tl.store(out_ptr + t * H + cols, acc.to(dtype), mask=mask)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    aligned: tuple[torch.Tensor, ...],
    block_m: int,
    a_row_div: int,
    weights: torch.Tensor | None = None,
) -> None:
    """out[id] = a[id // a_row_div] @ w[expert of id].T for every flat id, times weights[id] if given."""
    sorted_ids, block_experts, total = aligned
    n, k = w.shape[1:]
    assert w.stride(2) == 1 and a.stride(1) == 1 and out.is_contiguous(), "rows must be contiguous"
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm[grid](
        a,
        w,
        out,
        out if weights is None else weights,
        sorted_ids,
        block_experts,
        total,
        out.shape[0],
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        A_ROW_DIV=a_row_div,
        WEIGHTED=weights is not None,
        UPCAST=a.device.type == "cpu",
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=4,
    )


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """sum over each row's k experts of weights * down_e(act(gate_e(x)) * up_e(x)) -> [T, H];
    w_gate_up [E, 2I, H], w_down [E, H, I], experts [T, k] distinct per row."""
    tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts, width, _ = w_gate_up.shape
    assert w_down.shape == (num_experts, hidden, width // 2) and weights.dtype == x.dtype
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    experts, perm = experts.sort(dim=1)  # the sum's order
    weights = weights.gather(1, perm).contiguous()
    block_m = block_rows(experts.numel(), num_experts)
    aligned = align_to_blocks(experts, num_experts, block_m)
    gate_up = torch.empty(tokens * top_k, width, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w_gate_up, gate_up, aligned, block_m, top_k)
    hidden_rows = gated_activation(gate_up, act)
    down = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    grouped_gemm(hidden_rows, w_down, down, aligned, block_m, 1, weights.view(-1))
    block = min(triton.next_power_of_2(hidden), SUM_BLOCK)
    _sum_slots[(tokens, triton.cdiv(hidden, block))](down, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out
