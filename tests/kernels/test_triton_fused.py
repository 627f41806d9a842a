"""The fused Triton chains (`kernels/triton/norm.py`, `rope_kv.py`, `activation.py`) against the
model's own PyTorch lines (a GPU, or CPU tensors in Triton's interpreter), and a tiny model's
forward on the fused path against its plain forward.

Tolerances, and why a result is or is not bit-exact:
* rope + KV store: exact (fp32 and bf16). The kernel rounds each product and sum to the
  dtype as PyTorch's three eager ops do, and FMA contraction is off.
* residual add: exact (one rounding of the fp32 sum, as PyTorch's add).
* RMS norm: fp32 within 4e-7 relative (measured: at most 3.4e-7, 73-89% of values exact);
  bf16 within one bf16 ulp (measured: every value exact, H = 40, 72, 640). The sum of squares
  runs in another order than PyTorch's (a tree over the lanes against its vectorised
  accumulators), so 1 / rms can differ in its last fp32 bit, which moves a bf16 rounding only
  where a value lies that close to a rounding edge.
* act(gate) * up: fp32 within 1e-6 relative, bf16 within one bf16 ulp (silu: all exact in
  bf16 here, 84% in fp32; GELU: 99.5% and 96%): exp and tanh differ from PyTorch's in the last
  fp32 bit. Where GELU's 1 + tanh cancels (very negative gates) that bit is 2^-24 of 1, so
  there the bound is 2^-24 |gate up| absolute (PyTorch's 0 against a tiny value, or back).
* a model's forward, fp32: final hidden states within 1e-5 (the norms' and activations' ulps
  carried through two or three layers).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

from tests.models.test_gemma3 import gemma3_dir  # noqa: E402, F401 - a fixture
from tests.models.test_parity import PROMPTS  # noqa: E402
from treeserve import SamplingParams, ScoreParams  # noqa: E402
from treeserve.kernels.triton import activation, norm, rope_kv  # noqa: E402
from treeserve.kv.arena import KVArena  # noqa: E402
from treeserve.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from treeserve.layers.rotary import RotaryEmbedding, rope_inv_freq  # noqa: E402
from treeserve.models.llama import ACTIVATIONS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: torch.Tensor | float = 0.0) -> None:
    """fp32: |got - want| <= rtol |want| + atol; bf16: within one bf16 ulp (of the larger
    magnitude), or atol. `atol` may be a tensor (a bound per element)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    if want.dtype == torch.bfloat16:
        exponent = torch.frexp(torch.maximum(got.float().abs(), want.float().abs()))[1]
        bound = torch.maximum(torch.ldexp(torch.ones_like(diff), exponent - 8), torch.as_tensor(atol))  # 8 bits
    else:
        bound = rtol * want.abs() + atol
    at = int((diff - bound).argmax())
    assert (diff <= bound).all(), f"{got.flatten()[at]} against {want.flatten()[at]}, bound {bound.flatten()[at]}"


def norm_module(kind: str, hidden: int, dtype: torch.dtype) -> RMSNorm | GemmaRMSNorm:
    module = (RMSNorm if kind == "llama" else GemmaRMSNorm)(hidden, 1e-6)
    module.weight.data = randn(hidden, seed=5, scale=0.5).add(1.0 if kind == "llama" else 0.0).to(DEVICE, dtype)
    return module.requires_grad_(False)


def fused_norm(module: RMSNorm | GemmaRMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(module, GemmaRMSNorm):
        return norm.rms_norm(x, module.gain(), module.eps, residual, fp32_weight=True)
    return norm.rms_norm(x, module.weight, module.eps, residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "gemma"])
@pytest.mark.parametrize("hidden", [40, 72])
def test_norm_matches_the_model_lines(hidden, kind, dtype):
    """Rows of a wider tensor (strided), 1, 3 and 17 tokens; each row's result is the same alone."""
    module = norm_module(kind, hidden, dtype)
    for tokens in (1, 3, 17):
        wide = randn(tokens, hidden + 8, seed=tokens, scale=3.0).to(DEVICE, dtype)
        x = wide[:, 1 : hidden + 1]
        got = fused_norm(module, x)
        want = module(x)
        close(got, want, rtol=4e-7)
        assert torch.equal(fused_norm(module, x[-1:]), got[-1:])  # batch invariance


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_add_norm_updates_the_residual_in_place(kind, dtype):
    """residual = x + residual exactly as the model's `x + ...` (in place), then the norm of it."""
    module = norm_module(kind, 72, dtype)
    x = randn(17, 72, seed=1).to(DEVICE, dtype)
    residual = randn(17, 72, seed=2, scale=4.0).to(DEVICE, dtype)
    want_sum = residual + x
    got = fused_norm(module, x, residual)
    assert torch.equal(residual, want_sum)
    close(got, module(want_sum), rtol=4e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_norm_with_x_aliasing_the_residual(dtype):
    module = norm_module("llama", 40, dtype)
    x = randn(3, 40, seed=3).to(DEVICE, dtype)
    want_sum = x + x
    got = fused_norm(module, x, x)
    assert torch.equal(x, want_sum)
    close(got, module(want_sum), rtol=4e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_of_heads_in_a_fused_projection(dtype):
    """Gemma 3's q/k norms: [T, heads, D] views of the q/k/v projection, normed per head."""
    module = norm_module("gemma", 80, dtype)
    qkv = randn(3, 8 * 80, seed=4, scale=2.0).to(DEVICE, dtype)
    q = qkv[:, : 6 * 80].view(3, 6, 80)
    close(fused_norm(module, q), module(q), rtol=4e-7)


def paged_arena(dtype: torch.dtype, kv_heads: int, dim: int) -> KVArena:
    """Layer 1 of a 2-layer arena of 9 pages of 4 tokens, filled with random bits (NaNs included)."""
    arena = KVArena(9, 2, 4, kv_heads, dim, dtype, DEVICE)
    noise = torch.randint(0, 256, arena.pages.buffer.shape, generator=torch.Generator().manual_seed(9))
    arena.pages.buffer.copy_(noise.to(torch.uint8))
    return arena


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 2, 64), (6, 3, 80)], ids=str)  # (q heads, kv heads, head_dim)
def test_rope_and_store_give_pytorchs_bits(heads, dtype):
    """q, k, v strided views of one q/k/v projection; tokens at scattered positions, their slots in
    scattered pages (several tokens per page, pages in no order); only the slots change."""
    q_heads, kv_heads, dim = heads
    rope = RotaryEmbedding(rope_inv_freq(dim, 10000.0, None), 600, DEVICE)
    for tokens in (1, 3, 17):
        qkv = randn(tokens, (q_heads + 2 * kv_heads) * dim, seed=tokens).to(DEVICE, dtype)
        q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1))
        positions = torch.randint(0, 600, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
        slots = torch.randperm(9 * 4, generator=torch.Generator().manual_seed(tokens))[:tokens].to(DEVICE)
        pages, offsets = slots // 4, slots % 4
        got, want = paged_arena(dtype, kv_heads, dim), paged_arena(dtype, kv_heads, dim)
        before = qkv.clone()

        q_got = rope_kv.rope_store_kv(q, k, v, rope.cos, rope.sin, positions, *got.layer(1), pages, offsets)
        q_want, k_want = rope(q, k, positions)
        k_cache, v_cache = want.layer(1)
        k_cache[pages, offsets] = k_want
        v_cache[pages, offsets] = v
        assert q_got.is_contiguous() and torch.equal(q_got, q_want)
        assert torch.equal(got.pages.buffer, want.pages.buffer)  # byte for byte: the slots, and nothing else
        assert torch.equal(qkv, before)


def test_rope_store_skips_padding_rows():
    """A slot page of -1 (a CUDA graph's padding row) is stored nowhere; its q is still rotated."""
    rope = RotaryEmbedding(rope_inv_freq(16, 10000.0, None), 64, DEVICE)
    q, k, v = (randn(3, 2, 16, seed=s).to(DEVICE) for s in (1, 2, 3))
    positions = torch.tensor([5, 0, 9], device=DEVICE)
    pages, offsets = torch.tensor([2, -1, 7], device=DEVICE), torch.tensor([1, 0, 3], device=DEVICE)
    got, want = paged_arena(torch.float32, 2, 16), paged_arena(torch.float32, 2, 16)
    q_got = rope_kv.rope_store_kv(q, k, v, rope.cos, rope.sin, positions, *got.layer(1), pages, offsets)
    q_want, k_want = rope(q, k, positions)
    k_cache, v_cache = want.layer(1)
    k_cache[pages[[0, 2]], offsets[[0, 2]]] = k_want[[0, 2]]
    v_cache[pages[[0, 2]], offsets[[0, 2]]] = v[[0, 2]]
    assert torch.equal(q_got, q_want) and torch.equal(got.pages.buffer, want.pages.buffer)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(activation.ACTIVATIONS))
@pytest.mark.parametrize("inter", [40, 72, 1100])  # under one block, and over two (ragged)
def test_gated_activation_matches_the_mlp_lines(inter, act, dtype):
    """gate_up rows strided (a wider tensor's), gates from about -16 to 16: both tails of each
    activation. GELU's 1 + tanh(y) cancels for very negative gates: there the two tanh's last
    bit (2^-24 near -1) moves the result by up to 2^-24 |gate up|, absolute."""
    for tokens in (1, 3) if inter > 1000 else (1, 3, 17):
        wide = randn(tokens, 2 * inter + 8, seed=tokens, scale=4.0).to(DEVICE, dtype)
        gate_up = wide[:, : 2 * inter]
        got = activation.gated_activation(gate_up, act)
        gate, up = gate_up.chunk(2, dim=-1)
        want = ACTIVATIONS[act](gate) * up
        cancels = (gate.float() * up.float()).abs() * 2**-24 if act == "gelu_pytorch_tanh" else 0.0
        close(got, want, rtol=1e-6, atol=cancels)


def force_fused(model: torch.nn.Module) -> None:
    """The choices `pick_kernel` makes on CUDA, made by hand on the CPU (the interpreter runs them)."""
    for module in model.modules():
        if hasattr(module, "use_triton"):
            module.use_triton = True
    for rope in model.rope_tables():
        rope.use_triton = True


def hidden_states(llm, ids: list[int]) -> torch.Tensor:  # noqa: ANN001 - treeserve.LLM
    return llm.score([ids], ScoreParams(positions=list(range(len(ids))), return_hidden_states=True))[0].hidden_states


@pytest.mark.parametrize("model", ["llama_dir", "gemma3_dir"])
def test_fused_forward_equals_the_plain_forward(model, request, make_llm):
    """A tiny model's forward on the Triton backend, plain then with every fused chain forced on
    (fused residual adds, q/k norms, rope in the store, gated activation): fp32 hidden states
    at every position of a 9-token prompt over 3 pages within 1e-5 (measured: 2e-6 of values up
    to 3), and the same greedy tokens over two decode steps. Short: the interpreter runs each
    program of each launch in Python (~4 s for the Llama, ~6 s for the 3-layer Gemma)."""
    llm = make_llm(
        request.getfixturevalue(model),
        attention_backend="triton",
        device=DEVICE,
        page_size=4,
        kv_cache_memory=1 << 16,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    ids = llm.get_tokenizer().encode(PROMPTS[1])[:9]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    plain_hidden, plain_tokens = hidden_states(llm, ids), llm.generate(ids, params)[0].outputs[0].token_ids
    force_fused(llm.engine.model)
    assert llm.engine.model.fused_residual
    fused_hidden, fused_tokens = hidden_states(llm, ids), llm.generate(ids, params)[0].outputs[0].token_ids
    torch.testing.assert_close(fused_hidden, plain_hidden, rtol=0, atol=1e-5)
    assert fused_tokens == plain_tokens


def test_rope_handed_to_another_backend_is_applied_by_the_engine(llama_dir, make_llm):
    """On CUDA with the sdpa backend the layers still hand q, k and the rope table to the engine
    (`rope.use_triton`), which rotates them with the PyTorch lines before its store: same bits."""
    llm = make_llm(llama_dir, attention_backend="sdpa", kv_cache_memory=1 << 16, max_model_len=64)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    plain = hidden_states(llm, ids)
    for rope in llm.engine.model.rope_tables():
        rope.use_triton = True
    assert torch.equal(hidden_states(llm, ids), plain)
