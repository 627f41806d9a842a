"""The C paged prefill attention (`cpu_kernels.paged_prefill`) on each of its paths, AVX2 (fp32),
AVX512-BF16 and AMX tiles (real or emulated: TREESERVE_AMX_EMULATED=1): against SDPA at the PRM's
shapes, and a row's bits whatever chunk, tile or batch it is computed in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kv.arena import KVArena

SHAPES = {"arith": (32, 8, 4), "gemma3": (256, 4, 1), "d64": (64, 6, 2), "d40": (40, 4, 2)}  # D, q, KV heads
PATHS = [
    pytest.param("avx2", marks=pytest.mark.skipif(cpu_kernels.load_prefill_avx2() is None, reason="no AVX2 + FMA")),
    pytest.param("avx512", marks=pytest.mark.skipif(not cpu_kernels.bf16_built(), reason="no AVX512-BF16")),
    pytest.param(
        "amx",
        marks=pytest.mark.skipif(not cpu_kernels.prefill_tiles_available(), reason="no AMX tiles (real or emulated)"),
    ),
]


def _skip_unfit(path: str, head_dim: int) -> None:
    if path != "avx2" and head_dim % 32:
        pytest.skip("the bf16 dot-product paths take head_dim % 32 == 0")


def _cache(head_dim: int, kv_heads: int, block: int, pages: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    arena = KVArena(pages, 1, block, kv_heads, head_dim, torch.bfloat16, "cpu")
    arena.buffer.normal_()
    return arena.layer(0)


def _run(q, k_cache, v_cache, tables, seqs, window, path):
    """seqs: (table row, first q row, queries, context); the rows the batch wrote, others zero."""
    out = torch.zeros_like(q)
    tab, starts, lens, ctx = (torch.tensor(c) for c in zip(*seqs, strict=True))
    scale = q.shape[-1] ** -0.5
    cpu_kernels.paged_prefill(q, k_cache, v_cache, tables[tab], starts, lens, ctx, scale, window, out, path=path)
    return out


def _reference(q, k_cache, v_cache, table, first, queries, context, window):
    keys = k_cache[table].flatten(0, 1)[:context].float().transpose(0, 1)
    values = v_cache[table].flatten(0, 1)[:context].float().transpose(0, 1)
    pos = context - queries + torch.arange(queries)
    key_pos = torch.arange(context)
    mask = key_pos[None] <= pos[:, None]
    if window:
        mask &= key_pos[None] > pos[:, None] - window
    rows = q[first : first + queries].float().transpose(0, 1)
    attn = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask[None], enable_gqa=True)
    return attn.transpose(0, 1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 45])
def test_prm_shaped_chunks_match_sdpa(shape, window, path):
    """Sequences adding 10-100 tokens over 100-500 cached (key blocks cut by chunk starts anywhere)."""
    head_dim, q_heads, kv_heads = SHAPES[shape]
    _skip_unfit(path, head_dim)
    torch.manual_seed(head_dim)
    k_cache, v_cache = _cache(head_dim, kv_heads, 16, 200)
    tables = torch.randperm(200)[:160].view(4, 40)
    seqs, first = [], 0
    for b, (queries, cached) in enumerate([(10, 100), (100, 500), (37, 231), (64, 413)]):
        seqs.append((b, first, queries, cached + queries))
        first += queries
    q = torch.randn(first, q_heads, head_dim, dtype=torch.bfloat16)
    got = _run(q, k_cache, v_cache, tables, seqs, window, path)
    for b, first, queries, context in seqs:
        ref = _reference(q, k_cache, v_cache, tables[b], first, queries, context, window)
        tol = 4e-3 if path == "avx2" else 2e-2  # fp32 exps against bf16-rounded ones
        torch.testing.assert_close(got[first : first + queries].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, 45])
def test_a_rows_bits_do_not_depend_on_its_chunk_or_batch(shape, window, path):
    """Queries 70..139 of a 140-token context computed as one chunk, in chunks cut at positions that
    are not multiples of the key block (or of the tile), alone or among other sequences, on 1 or 2
    threads (with tiles, how many tiles an item takes follows the call's items a thread): identical
    bits."""
    head_dim, q_heads, kv_heads = SHAPES[shape]
    _skip_unfit(path, head_dim)
    torch.manual_seed(1)
    k_cache, v_cache = _cache(head_dim, kv_heads, 10)
    tables = torch.randperm(96)[:45].view(3, 15)
    q = torch.randn(200, q_heads, head_dim, dtype=torch.bfloat16)
    whole = _run(q, k_cache, v_cache, tables, [(0, 0, 70, 140)], window, path)[:70]
    pieces = []
    for cuts in ([0, 33, 70], [0, 1, 2, 50, 69, 70], [0, 17, 18, 51, 70]):
        rows = torch.zeros(70, q_heads, head_dim, dtype=torch.bfloat16)
        for a, b in zip(cuts, cuts[1:], strict=False):
            rows[a:b] = _run(q, k_cache, v_cache, tables, [(0, a, b - a, 70 + b)], window, path)[a:b]
        pieces.append(rows)
    others = [(1, 80, 5, 120), (0, 0, 70, 140), (2, 100, 64, 77), (1, 170, 30, 30)]
    batched = _run(q, k_cache, v_cache, tables, others, window, path)[:70]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other_threads = _run(q, k_cache, v_cache, tables, others, window, path)[:70]
    finally:
        torch.set_num_threads(threads)
    for got in (*pieces, batched, other_threads):
        assert torch.equal(got.view(torch.int16), whole.view(torch.int16))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", ["arith", "gemma3"])
def test_scores_that_grow_along_the_context_rescale_exactly(shape, path):
    """Keys scaled up along the context, so later blocks' scores pass the running reference by far
    more than its slack and the online softmax rescales many times: still SDPA's result, and a
    row's bits still the same in any chunking."""
    head_dim, q_heads, kv_heads = SHAPES[shape]
    _skip_unfit(path, head_dim)
    torch.manual_seed(2)
    k_cache, v_cache = _cache(head_dim, kv_heads, 16, 40)
    tables = torch.randperm(40).view(1, 40)
    context, queries = 400, 60
    for pos in range(context):
        page, slot = tables[0, pos // 16], pos % 16
        k_cache[page, slot] *= 0.2 + pos / 25
    q = torch.randn(queries, q_heads, head_dim, dtype=torch.bfloat16)
    got = _run(q, k_cache, v_cache, tables, [(0, 0, queries, context)], None, path)
    ref = _reference(q, k_cache, v_cache, tables[0], 0, queries, context, None)
    tol = 4e-3 if path == "avx2" else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    pieces = torch.zeros_like(got)
    for a, b in ((0, 7), (7, 40), (40, 60)):
        pieces[a:b] = _run(q, k_cache, v_cache, tables, [(0, a, b - a, context - queries + b)], None, path)[a:b]
    assert torch.equal(pieces.view(torch.int16), got.view(torch.int16))
