"""The fused MoE (`kernels/triton/moe.py`) against the grouped loop in PyTorch (a GPU, or CPU
tensors in Triton's interpreter), and the tiny Qwen3-MoE's forward on it against its plain forward.

Tolerances: fp32 within 1e-5 relative (plus 1e-5 of the output's largest magnitude, where sums
cancel); the GEMMs sum in another order than PyTorch's (measured: ~4e-7 of the magnitude). bf16
within 2% (every value exact in the interpreter, measured; a GPU's tensor cores sum in yet another
order, which may move a rounding by an ulp that the activation and down projection carry on).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

from tests.models.test_parity import PROMPTS, our_logits  # noqa: E402
from tests.tiny_models import build_checkpoint  # noqa: E402
from treeserve import SamplingParams  # noqa: E402
from treeserve.kernels.triton import moe as moe_kernels  # noqa: E402
from treeserve.kernels.triton.moe import align_to_blocks, fused_moe  # noqa: E402
from treeserve.models.llama import ACTIVATIONS  # noqa: E402
from treeserve.models.qwen3_moe import SparseMoE  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts and softmax weights of random router logits; experts 0 and 2 are never chosen
    while enough others remain, so some experts get no rows."""
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    if num_experts - 2 >= top_k:
        logits[:, [0, 2]] -= 100.0
    weights, experts = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return experts.to(DEVICE), weights.to(DEVICE)


def grouped_loop(x, w_gate_up, w_down, experts, weights, act: str) -> torch.Tensor:  # noqa: ANN001 - tensors
    """`SparseMoE.forward`'s loop on stacked weights: each chosen expert once on its rows, the
    weighted results added in ascending expert order."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()):
        picks = order[start : start + count]
        start += count
        rows = picks // experts.shape[1]
        gate, up = F.linear(x[rows], w_gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(ACTIVATIONS[act](gate) * up, w_down[expert]) * weights.flatten()[picks, None]
        out.index_add_(0, rows, y)
    return out


@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (6, 2), (8, 3), (5, 4)])
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_rows_are_grouped_by_expert_in_blocks(tokens, num_experts, top_k):
    experts, _ = routed(tokens, num_experts, top_k, seed=tokens)
    block_m = 16
    sorted_ids, block_experts, total = align_to_blocks(experts, num_experts, block_m)
    pairs = experts.numel()
    counts = torch.bincount(experts.flatten(), minlength=num_experts)
    assert int(total) == int(((counts + block_m - 1) // block_m * block_m).sum()) <= sorted_ids.numel()
    assert sorted_ids.numel() == block_experts.numel() * block_m
    real = sorted_ids[sorted_ids < pairs].long()
    assert sorted(real.tolist()) == list(range(pairs))  # every (row, slot) once
    assert (sorted_ids[int(total) :] == pairs).all()  # past the total: padding only
    flat = experts.flatten()
    for b in range(int(total) // block_m):
        ids = sorted_ids[b * block_m : (b + 1) * block_m].long()
        ids = ids[ids < pairs]
        assert len(ids) > 0 and (flat[ids] == block_experts[b]).all()
        assert torch.equal(ids, ids.sort().values)  # rows ascending within an expert
    assert sorted(block_experts[: int(total) // block_m].tolist()) == block_experts[: int(total) // block_m].tolist()


SHAPES = [  # (tokens, experts, top_k, hidden, intermediate): K and N off the 32/64 blocks
    (1, 4, 1, 40, 24),
    (3, 6, 2, 72, 40),
    (17, 8, 3, 40, 24),
    (64, 5, 2, 72, 40),
    (17, 7, 2, 100, 72),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fused_moe_matches_the_grouped_loop(shape, dtype):
    tokens, num_experts, top_k, hidden, inter = shape
    gen = torch.Generator().manual_seed(tokens * num_experts)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(DEVICE, dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(DEVICE, dtype)
    experts, weights = routed(tokens, num_experts, top_k, seed=tokens + num_experts)
    weights = weights.to(dtype)
    assert (torch.bincount(experts.flatten(), minlength=num_experts) == 0).any()  # an expert with no rows
    got = fused_moe(x, w_gate_up, w_down, experts, weights, "silu")
    want = grouped_loop(x, w_gate_up, w_down, experts, weights, "silu")
    scale = want.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)


def test_fused_moe_with_gelu_and_no_rows():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 40, generator=gen, device="cpu").to(DEVICE)
    w_gate_up, w_down = (
        torch.randn(4, 48, 40, generator=gen).to(DEVICE),
        torch.randn(4, 40, 24, generator=gen).to(DEVICE),
    )
    experts, weights = routed(5, 4, 2, seed=1)
    got = fused_moe(x, w_gate_up, w_down, experts, weights, "gelu_pytorch_tanh")
    want = grouped_loop(x, w_gate_up, w_down, experts, weights, "gelu_pytorch_tanh")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert fused_moe(x[:0], w_gate_up, w_down, experts[:0], weights[:0], "silu").shape == (0, 40)


def moe_layers(llm) -> list[SparseMoE]:  # noqa: ANN001 - treeserve.LLM
    return [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen3_moe")), "qwen3_moe")


def test_stacked_experts_share_the_weights(qwen3_moe_dir, make_llm):
    """Stacking keeps one copy (the experts' weights become views) and leaves the plain path's bits."""
    llm = make_llm(qwen3_moe_dir, device=DEVICE, enable_prefix_caching=False)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    plain = our_logits(llm, ids)
    for moe in moe_layers(llm):
        assert moe.use_triton == (DEVICE == "cuda") and (moe.stacked is not None) == (DEVICE == "cuda")
        if moe.stacked is None:
            assert moe.stack_experts()
        gate_up, down = moe.stacked
        for e, expert in enumerate(moe.experts):
            assert expert.gate_up_proj.weight.data_ptr() == gate_up[e].data_ptr()
            assert expert.down_proj.weight.data_ptr() == down[e].data_ptr()
    if DEVICE == "cpu":
        assert torch.equal(our_logits(llm, ids), plain)
    mixed = SparseMoE(llm.engine.model.config)  # a down_proj of another dtype: refused, nothing changed
    mixed.experts[3].down_proj.weight = torch.nn.Parameter(mixed.experts[3].down_proj.weight.half())
    before = [p.data_ptr() for p in mixed.parameters()]
    assert not mixed.stack_experts() and mixed.stacked is None
    assert [p.data_ptr() for p in mixed.parameters()] == before


def test_moe_forward_on_the_triton_path_equals_the_plain_path(qwen3_moe_dir, make_llm, monkeypatch):
    """The tiny Qwen3-MoE (2 sparse layers of 8 experts, top 2), fp32: the logits at every position
    of a prompt within 1e-5 of the plain path's, and the same greedy tokens."""
    calls = []
    monkeypatch.setattr(moe_kernels, "fused_moe", lambda *args: calls.append(1) or fused_moe(*args))
    llm = make_llm(qwen3_moe_dir, device=DEVICE, enable_prefix_caching=False)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    layers = moe_layers(llm)
    for moe in layers:
        moe.use_triton = False
    plain, plain_tokens = our_logits(llm, ids), llm.generate(ids, params)[0].outputs[0].token_ids
    for moe in layers:
        if moe.stacked is None:
            assert moe.stack_experts()
        moe.use_triton = True  # what `pick_kernel` chooses on CUDA
    fused, fused_tokens = our_logits(llm, ids), llm.generate(ids, params)[0].outputs[0].token_ids
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-5)
    assert fused_tokens == plain_tokens
    assert len(calls) >= 2 * len(layers) == 4  # every sparse layer took the kernel, prefill and decode
