"""The C fast paths agree with the PyTorch reference paths they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from treeserve import SamplingParams
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kv.arena import KVArena

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler: kernels not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 40])  # bf16: multiples of 32 take the AVX512-BF16 path
@pytest.mark.parametrize("q_heads,kv_heads", [(6, 2), (8, 4), (8, 2), (8, 1), (2, 2)])  # groups 3, 2, 4, 8, 1
def test_paged_decode_matches_sdpa(dtype, window, head_dim, q_heads, kv_heads):
    torch.manual_seed(0)
    batch, block = 9, 4
    arena = KVArena(64, 2, block, kv_heads, head_dim, dtype, "cpu")
    arena.buffer.normal_()
    tables = torch.randperm(64)[: batch * 5].view(batch, 5)
    lens = torch.randint(1, 5 * block + 1, (batch,))
    q = torch.randn(batch, q_heads, head_dim, dtype=dtype)
    k_cache, v_cache = arena.layer(1)
    got = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window)
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2).float()
    values = v_cache[tables].flatten(1, 2).transpose(1, 2).float()
    pos = torch.arange(5 * block)
    mask = pos[None] < lens[:, None]
    if window:
        mask &= pos[None] >= lens[:, None] - window
    ref = F.scaled_dot_product_attention(
        q.float()[:, :, None], keys, values, attn_mask=mask[:, None, None], enable_gqa=True
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref[:, :, 0], atol=tol, rtol=tol)


prefill = pytest.mark.skipif(not cpu_kernels.bf16_built(), reason="no AVX512-BF16: the prefill kernel is not built")


def _prefill_reference(q, k_cache, v_cache, tables, starts, lens, ctx, window):
    out = torch.zeros(q.shape)
    for b in range(tables.shape[0]):
        keys = k_cache[tables[b]].flatten(0, 1).float().transpose(0, 1)  # [Hkv, K, D]
        values = v_cache[tables[b]].flatten(0, 1).float().transpose(0, 1)
        pos = ctx[b] - lens[b] + torch.arange(lens[b])
        key_pos = torch.arange(keys.shape[1])
        mask = key_pos[None] <= pos[:, None]
        if window:
            mask &= key_pos[None] > pos[:, None] - window
        rows = slice(starts[b], starts[b] + lens[b])
        attn = F.scaled_dot_product_attention(
            q[rows].float().transpose(0, 1), keys, values, attn_mask=mask[None], enable_gqa=True
        )
        out[rows] = attn.transpose(0, 1)
    return out


@prefill
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize(
    "head_dim,q_heads,kv_heads,block", [(32, 8, 4, 4), (32, 8, 4, 10), (64, 6, 2, 3), (32, 4, 1, 16)]
)
def test_paged_prefill_matches_sdpa(window, head_dim, q_heads, kv_heads, block):
    """Chunks of 1-40 queries (tiles of 16 rows, partly padded) over cached prefixes that cross pages."""
    torch.manual_seed(head_dim + block)
    arena = KVArena(200, 2, block, kv_heads, head_dim, torch.bfloat16, "cpu")
    arena.buffer.normal_()
    batch, pages = 7, 20
    tables = torch.randperm(200)[: batch * pages].view(batch, pages)
    lens = torch.tensor([1, 40, 3, 16, 17, 8, 2])
    ctx = lens + torch.randint(0, pages * block - 40, (batch,))
    starts = torch.cumsum(lens, 0) - lens
    q = torch.randn(int(lens.sum()), q_heads, head_dim, dtype=torch.bfloat16)
    k_cache, v_cache = arena.layer(1)
    got = torch.zeros_like(q)
    cpu_kernels.paged_prefill(q, k_cache, v_cache, tables, starts, lens, ctx, head_dim**-0.5, window, got)
    ref = _prefill_reference(q, k_cache, v_cache, tables, starts, lens, ctx, window)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@prefill
def test_paged_prefill_rows_do_not_depend_on_the_chunk_around_them():
    """A chunk prefilled whole, alone, or in two pieces over the cached first piece: identical bits."""
    torch.manual_seed(0)
    arena = KVArena(64, 1, 4, 4, 32, torch.bfloat16, "cpu")
    arena.buffer.normal_()
    tables = torch.randperm(64)[:40].view(2, 20)
    q = torch.randn(50, 8, 32, dtype=torch.bfloat16)
    k_cache, v_cache = arena.layer(0)

    def run(seqs: list[tuple[int, int, int, int]]) -> torch.Tensor:  # (table row, first row, queries, context)
        out = torch.zeros_like(q)
        tab, starts, lens, ctx = (torch.tensor(c) for c in zip(*seqs, strict=True))
        cpu_kernels.paged_prefill(q, k_cache, v_cache, tables[tab], starts, lens, ctx, 32**-0.5, None, out)
        return out[10:47]

    whole = run([(0, 0, 10, 60), (1, 10, 37, 70)])
    assert torch.equal(run([(1, 10, 37, 70)]), whole)
    assert torch.equal(run([(1, 10, 20, 53)]) + run([(1, 30, 17, 70)]), whole)


def test_sample_rows_matches_inverse_cdf():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 3
    uniforms = [(i + 0.37) / 64 for i in range(64)]
    got = cpu_kernels.sample_rows(logits, uniforms)
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    ref = torch.searchsorted(cdf, torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:], right=True)
    assert (got == ref.squeeze(1)).float().mean() > 0.98  # only float rounding at bucket edges may differ


def test_sample_rows_keeps_to_the_inverse_cdf_over_a_large_vocabulary():
    """Gemma's 262k entries: one fp32 running sum over a row drifted from the exact CDF enough to
    move 44% of the draws (to a neighbour); the chunked sums keep ~98% on the exact token."""
    torch.manual_seed(0)
    logits = (torch.randn(32, 262144) * 3).to(torch.bfloat16)
    uniforms = [(i + 0.37) / 32 for i in range(32)]
    got = cpu_kernels.sample_rows(logits, uniforms)
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    ref = torch.searchsorted(cdf, torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:], right=True)
    assert (got == ref.squeeze(1)).float().mean() >= 0.9
    assert ((got - ref.squeeze(1)).abs() <= 2).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_rows_masked_draws_as_masking_then_sampling(dtype):
    torch.manual_seed(1)
    rows, vocab = 48, 1000
    logits = (torch.randn(rows, vocab + 24) * 3).to(dtype)  # 24 padding columns past the vocabulary
    allowed = torch.rand(rows, vocab) < torch.linspace(0.001, 0.9, rows)[:, None]
    allowed[torch.arange(rows), torch.arange(rows)] = True
    allowed[-1] = False  # a dead end
    padded = torch.nn.functional.pad(allowed, (0, 24)).numpy()  # 1024 bits: 32 words a row
    words = torch.from_numpy(np.packbits(padded, axis=1, bitorder="little")).view(torch.int32)
    uniforms = [(i + 0.37) / rows if i % 5 else -1.0 for i in range(rows)]  # every 5th row greedy
    got = cpu_kernels.sample_rows_masked(logits, words, vocab, uniforms)
    masked = logits.float().masked_fill(~torch.nn.functional.pad(allowed, (0, 24)), float("-inf"))
    drawn = cpu_kernels.sample_rows(masked, [u if u >= 0 else 0.5 for u in uniforms])
    greedy = masked.argmax(-1)
    for r in range(rows - 1):
        assert allowed[r, got[r]]
        if uniforms[r] < 0:
            assert got[r] == greedy[r], r
    same = [got[r] == drawn[r] for r in range(rows - 1) if uniforms[r] >= 0]
    assert sum(same) >= len(same) - 1  # the sums run in another order: a bucket edge may differ
    assert got[-1] == -1


def test_engine_same_greedy_tokens_without_kernels(llama_dir, make_llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, n=2)
    prompts = ["The quick brown fox", "Numbers 0 1 2 3 4 5"]
    fast = [c.token_ids for o in make_llm(llama_dir).generate(prompts, params) for c in o.outputs]
    plain = make_llm(llama_dir, attention_backend="sdpa").generate(prompts, params)
    assert fast == [c.token_ids for o in plain for c in o.outputs]


def test_loading_the_kernels_leaves_subnormal_floats_alone():
    """A library linked with -ffast-math would switch the whole process to flush-to-zero."""
    import sys

    from treeserve.kernels import cpu as cpu_kernels

    assert cpu_kernels.load() is not None
    tiny = sys.float_info.min
    assert tiny / 2 > 0.0
    assert torch.tensor(torch.finfo(torch.float32).tiny) / 2 > 0


gemv = pytest.mark.skipif(not cpu_kernels.bf16_built(), reason="no AVX512-BF16: the bf16 GEMV is not built")


@gemv
@pytest.mark.parametrize("rows,n,k", [(1, 37, 100), (2, 64, 640), (3, 1000, 96), (4, 9, 32)])
def test_linear_bf16_rounds_the_exact_dot_product(rows, n, k):
    """Within one bf16 rounding of the fp32 result, with odd K (masked tail) and N (short block)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * k, dtype=torch.bfloat16)[:, :k]  # strided rows
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    exact = F.linear(x.float(), weight.float(), bias.float())
    ours = cpu_kernels.linear_bf16(x, weight, bias).float()
    assert torch.allclose(ours, exact, rtol=2**-8, atol=1e-3 * k**0.5)


@gemv
def test_linear_bf16_row_does_not_depend_on_the_batch():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    weight = torch.randn(300, 256, dtype=torch.bfloat16)
    batch = cpu_kernels.linear_bf16(x, weight)
    for i in range(4):
        assert torch.equal(cpu_kernels.linear_bf16(x[i : i + 1], weight), batch[i : i + 1])


@gemv
def test_fast_linear_model_matches_plain_linear(llama_dir, make_llm, monkeypatch):
    """bf16 decode through the GEMV gives the tokens the oneDNN path gives (greedy, short)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    monkeypatch.setattr(cpu_kernels, "amx_supports", lambda weight: False)  # tiles: test_amx_linear.py
    fast = make_llm(llama_dir, dtype="bfloat16").generate(["The quick brown fox"], params)
    monkeypatch.setattr(cpu_kernels, "gemv_supports", lambda *args: False)
    plain = make_llm(llama_dir, dtype="bfloat16").generate(["The quick brown fox"], params)
    assert fast[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


@pytest.mark.parametrize("gemma", [True, False])
def test_rms_norm_bf16_matches_the_pytorch_norms(gemma):
    """The fused kernel computes what GemmaRMSNorm / RMSNorm compute in PyTorch, bit for bit here."""
    from treeserve.layers.norm import GemmaRMSNorm, RMSNorm

    torch.manual_seed(0)
    norm = (GemmaRMSNorm if gemma else RMSNorm)(96, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(torch.bfloat16)
    x = torch.randn(5, 3, 96, dtype=torch.bfloat16) * 4
    expected = norm(x)
    norm.pick_kernel()
    assert norm.use_c
    assert torch.equal(norm(x), expected)


def test_layers_pick_their_kernels_at_load(llama_dir, monkeypatch):
    """bf16 on a CPU: the C kernels (dense bf16 panels where AVX512-BF16 is built, avx2_linear.c on AVX2);
    fp32: PyTorch's with rows padded;
    bf16 with TREESERVE_CPU_KERNELS=0: PyTorch, widened to fp32 where the CPU has no bf16 products."""
    import torch.nn.functional as F

    from treeserve.kernels.cpu import avx2
    from treeserve.kernels.cpu import quant as quant_kernels
    from treeserve.layers.linear import Linear, row_invariant_linear, widened_linear
    from treeserve.layers.quant import quant_linear
    from treeserve.models.loader import load_model

    def picked(dtype: torch.dtype) -> tuple[set, bool, bool]:
        model = load_model(llama_dir, dtype, torch.device("cpu")).model
        linears = {getattr(m.kernel, "func", m.kernel) for m in model.modules() if isinstance(m, Linear)}
        return linears, model.layers[0].input_layernorm.use_c, model.rope.use_c

    assert picked(torch.float32) == ({row_invariant_linear}, False, False)
    if cpu_kernels.bf16_built():  # dense panels (on AMX tiles where the CPU has them: test_amx_linear.py)
        dense = quant_linear if quant_kernels.bf16_panels_available() else cpu_kernels.linear
        assert picked(torch.bfloat16) == ({dense}, True, True)
    elif avx2.load() is not None:  # AVX2 without bf16 products: bf16 weights on avx2_linear.c
        assert picked(torch.bfloat16)[0] == {avx2.linear}
    monkeypatch.setenv("TREESERVE_CPU_KERNELS", "0")
    caches = (
        cpu_kernels.load,
        cpu_kernels.bf16_built,
        cpu_kernels.load_amx,
        quant_kernels.load,
        quant_kernels.load_bf16,
        avx2.load,
    )
    for cached in caches:
        cached.cache_clear()
    try:
        plain = F.linear if cpu_kernels.native_bf16() else widened_linear
        assert picked(torch.bfloat16) == ({plain}, False, False)
    finally:  # the next caller builds (finds) the libraries again, with the variable unset
        for cached in caches:
            cached.cache_clear()


@gemv
def test_bf16_layers_through_their_c_kernels_give_the_pytorch_bits(monkeypatch):
    """Linear (rows padded for oneDNN), RMSNorm and rope before and after `pick_kernel`."""
    import treeserve.layers.linear as linear_module
    from treeserve.layers.linear import Linear
    from treeserve.layers.norm import RMSNorm
    from treeserve.layers.rotary import RotaryEmbedding, _rotate_half, rope_inv_freq

    monkeypatch.setattr(linear_module, "dense_panels_supported", lambda weight: False)  # test_bf16_panels.py
    torch.manual_seed(0)
    linear, norm = Linear(256, 704).bfloat16(), RMSNorm(256, 1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.normal_()
    rope = RotaryEmbedding(rope_inv_freq(32, 10000.0, None), 64, "cpu")
    x, positions = torch.randn(17, 256).bfloat16(), torch.arange(17)
    q, k = x.view(17, 8, 32), x[:, :128].view(17, 4, 32)  # k's rows are strided, as split from qkv
    expected = linear(x), norm(x), rope(q, k, positions)
    linear.pick_kernel(), norm.pick_kernel(), rope.pick_kernel(torch.bfloat16)
    assert (linear.kernel, norm.use_c, rope.use_c) == (cpu_kernels.linear, True, True)
    assert torch.equal(linear(x), expected[0]) and torch.equal(norm(x), expected[1])
    assert all(torch.equal(a, b) for a, b in zip(rope(q, k, positions), expected[2], strict=True))
    q_t = x.view(8, 17, 32).transpose(0, 1)  # heads not contiguous within a token: the PyTorch lines
    cos, sin = rope.lookup(positions, q_t.dtype)
    assert torch.equal(rope(q_t, k, positions)[0], q_t * cos + _rotate_half(q_t) * sin)


def test_rope_matches_pytorch_bit_for_bit_on_strided_heads():
    from treeserve.layers.rotary import RotaryEmbedding, _rotate_half, rope_inv_freq

    torch.manual_seed(0)
    qkv = torch.randn(29, 512).bfloat16()
    q = qkv[:, :256].view(-1, 8, 32)  # rows 512 apart, as split from the fused projection
    rope = RotaryEmbedding(rope_inv_freq(32, 10000.0, None), 512, "cpu")
    cos, sin = rope.lookup(torch.randint(0, 500, (29,)), torch.bfloat16)
    got = cpu_kernels.rope_bf16(q, cos, sin)
    assert got.is_contiguous()
    assert torch.equal(got, q * cos + _rotate_half(q) * sin)


@pytest.mark.parametrize("rows", [5, 17, 100, 240, 256])
def test_bf16_linear_with_padded_rows_gives_the_unpadded_bits(rows):
    """Rows are padded to a multiple of ROW_BUCKET so oneDNN reuses its kernels; results must not move."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 256).bfloat16()
    weight, bias = (torch.randn(704, 256) * 0.05).bfloat16(), torch.randn(704).bfloat16()
    got = cpu_kernels.linear(x, weight, bias)
    assert got.shape == (rows, 704)
    assert torch.equal(got, F.linear(x, weight, bias))


@pytest.mark.parametrize("k, n", [(64, 192), (128, 64), (896, 1152)])
def test_fp32_linear_rows_do_not_depend_on_the_batch(k, n):
    """A row's bits are the same whether it is multiplied alone, beside a few rows or among many
    (MKL runs fewer than 16 rows through other kernels: a decode step of 3 rows and a speculating
    one of 4 gave the same token other logits). Checked through `linear_kernel`, as layers pick it."""
    from treeserve.layers.linear import linear_kernel

    torch.manual_seed(k)
    weight, bias, x = torch.randn(n, k), torch.randn(n), torch.randn(40, k)
    matmul = linear_kernel(weight)
    full = matmul(x, weight, bias)
    assert torch.equal(full, F.linear(x, weight, bias))  # from MIN_GEMM_ROWS rows on: PyTorch's bits
    for rows in range(1, 40):
        for first in (0, 40 - rows):
            assert torch.equal(matmul(x[first : first + rows], weight, bias), full[first : first + rows]), rows
    assert torch.equal(matmul(x.view(4, 10, k)[:1], weight, bias), full[:10].view(1, 10, n))  # leading dims kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_the_slots_indexing_writes(dtype):
    arena = KVArena(12, 2, 4, 2, 16, dtype, "cpu")
    k_cache, v_cache = arena.layer(1)
    other = arena.buffer[:, 0].clone()
    torch.manual_seed(0)
    qkv = torch.randn(9, 3 * 32).to(dtype)
    k, v = qkv[:, 32:64].view(9, 2, 16), qkv[:, 64:].view(9, 2, 16)  # rows 96 apart, as split from qkv
    pages, offsets = torch.tensor([3, 3, 7, 0, 11, 11, 11, 11, 5]), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[pages, offsets], want_v[pages, offsets] = k, v
    assert cpu_kernels.store_kv(k, v, k_cache, v_cache, pages, offsets)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(arena.buffer[:, 0], other)  # the other layer untouched
    strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # heads not contiguous: indexing stores it
    assert not cpu_kernels.store_kv(strided, v, k_cache, v_cache, pages, offsets)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_slots_copies_what_indexing_copies(dtype):
    """Twins' K/V copies (every layer of single token slots) in one C call: the bytes the indexing
    reference writes, nothing else touched; the indexing path where the layout does not fit."""
    arena = KVArena(12, 3, 4, 2, 16, dtype, "cpu")
    torch.manual_seed(0)
    arena.buffer.copy_(torch.randn(arena.buffer.shape).to(dtype))
    src = torch.tensor([3, 3, 7, 0]), torch.tensor([0, 1, 2, 3])
    dst = torch.tensor([5, 11, 11, 9]), torch.tensor([3, 0, 2, 1])
    want = arena.buffer.clone()
    want[dst[0], :, :, dst[1]] = want[src[0], :, :, src[1]]
    assert cpu_kernels.copy_slots(arena.buffer, *src, *dst)
    assert torch.equal(arena.buffer, want)
    arena.copy_slots(*dst, *src)  # back, through the arena
    want[src[0], :, :, src[1]] = want[dst[0], :, :, dst[1]]
    assert torch.equal(arena.buffer, want)
    assert not cpu_kernels.copy_slots(arena.buffer, src[0].int(), *src[1:], *dst)  # int32 slots: indexing's


def test_decode_rows_in_the_steps_lead_are_attended_in_place_with_the_gathered_bits():
    from treeserve.engine.attention import CpuBackend, SeqGroup

    arena = KVArena(16, 1, 4, 2, 32, torch.bfloat16, "cpu")
    k_cache, v_cache = arena.layer(0)
    torch.manual_seed(0)
    k_cache.copy_(torch.randn_like(k_cache, dtype=torch.float32).bfloat16())
    v_cache.copy_(torch.randn_like(v_cache, dtype=torch.float32).bfloat16())
    q = torch.randn(5, 4, 32).bfloat16()
    tables, lens = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]]), torch.tensor([9, 5, 12])

    def group(rows: list[int]) -> SeqGroup:
        index = torch.tensor(rows)[:, None]
        return SeqGroup(tables, lens, index, lens[:, None] - 1, index[:, 0], torch.ones(3, dtype=torch.int64))

    leading, shuffled = group([0, 1, 2]), group([3, 0, 4])
    assert leading.leads and not shuffled.leads
    outs = []
    for g in (leading, shuffled):
        out = torch.zeros_like(q)
        CpuBackend().attend(g, q, k_cache, v_cache, None, None, out)
        outs.append(out)
    want = cpu_kernels.paged_decode(q[:3], k_cache, v_cache, tables, lens, 32**-0.5, None)
    assert torch.equal(outs[0][:3], want) and not outs[0][3:].any()
    assert torch.equal(
        outs[1][[3, 0, 4]], cpu_kernels.paged_decode(q[[3, 0, 4]], k_cache, v_cache, tables, lens, 32**-0.5, None)
    )


def test_fp32_prefill_rows_do_not_depend_on_the_chunk_around_them():
    """The `cpu` backend's fp32 prefill chunks (no C prefill kernel takes them): a chunk whole,
    beside another sequence's, or in two pieces over its cached first piece gives the same bits,
    each row a decode's."""
    from treeserve.engine.attention import CpuBackend, SeqGroup

    torch.manual_seed(0)
    arena = KVArena(64, 1, 4, 4, 32, torch.float32, "cpu")
    arena.buffer.normal_()
    k_cache, v_cache = arena.layer(0)
    tables = torch.randperm(64)[:40].view(2, 20)
    q = torch.randn(50, 8, 32)

    def run(seqs: list[tuple[int, int, int, int]]) -> torch.Tensor:  # (table row, first row, queries, context)
        tab, starts, lens, ctx = (torch.tensor(c) for c in zip(*seqs, strict=True))
        width = int(lens.max())
        index = torch.minimum(starts[:, None] + torch.arange(width), (starts + lens - 1)[:, None])
        pos = ctx[:, None] - lens[:, None] + torch.minimum(torch.arange(width), (lens - 1)[:, None])
        out = torch.zeros_like(q)
        CpuBackend().attend(SeqGroup(tables[tab], ctx, index, pos, starts, lens), q, k_cache, v_cache, None, None, out)
        return out[10:47]

    whole = run([(0, 0, 10, 60), (1, 10, 37, 70)])
    assert torch.equal(run([(1, 10, 37, 70)]), whole)
    assert torch.equal(run([(1, 10, 20, 53)]) + run([(1, 30, 17, 70)]), whole)
    last = cpu_kernels.paged_decode(q[46:47], k_cache, v_cache, tables[1:], torch.tensor([70]), 32**-0.5, None)
    assert torch.equal(whole[-1:], last)
