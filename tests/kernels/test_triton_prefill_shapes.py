"""The paged prefill kernel against a plain PyTorch reference, over the shapes its tiles meet.

The reference gathers each sequence's pages by its page table, masks causally (and by the
window) and takes the softmax in fp32. Caches are real arena views (`KVArena.layer`) with
shuffled pages; each flat batch has a row of another group before every chunk, which must
stay untouched. Matrix: fp32 and bf16; head_dim 64 and 128; GQA groups 1, 4 and 8 (and 3,
7, which do not divide the tile); chunks after cached prefixes, contexts 1 to ~4100, chunk
lengths on and off the tile edges; sliding windows; block_m/block_n 16/16, 128/64 and the
defaults. fp32 within 1e-4, bf16 within 2e-2 (as test_triton_attention.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

from treeserve.kernels.triton import prefill_attention  # noqa: E402
from treeserve.kv.arena import KVArena  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
BLOCKS = [{}, {"block_m": 16, "block_n": 16}, {"block_m": 128, "block_n": 64}]  # {}: the module's defaults
CHUNKS = [(0, 1), (0, 45), (5, 70), (300, 33), (1200, 100)]  # (cached tokens, chunk length) per sequence


def reference(q, k_cache, v_cache, table, cached, scale, window):
    """Sequence's queries q [n, Hq, D] at positions cached .. cached + n - 1 over its pages, in fp32."""
    kv_heads, dim = k_cache.shape[2:]
    context = cached + q.shape[0]
    group = q.shape[1] // kv_heads
    keys = k_cache[table].reshape(-1, kv_heads, dim)[:context].float().repeat_interleave(group, 1)
    values = v_cache[table].reshape(-1, kv_heads, dim)[:context].float().repeat_interleave(group, 1)
    q_pos = torch.arange(cached, context, device=q.device)
    pos = torch.arange(context, device=q.device)
    allowed = pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= pos[None, :] > q_pos[:, None] - window
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def check(chunks, q_heads, kv_heads, dim, dtype, window=None, page_size=16, **blocks):
    """chunks: (cached tokens, chunk length) per sequence, in one flat batch."""
    g = torch.Generator().manual_seed(len(chunks) * 1000 + q_heads * 10 + dim)
    contexts = [cached + n for cached, n in chunks]
    widths = [-(-c // page_size) for c in contexts]
    arena = KVArena(sum(widths) + 2, 2, page_size, kv_heads, dim, dtype, DEVICE)
    arena.buffer.copy_(torch.randn(arena.buffer.shape, generator=g))
    k_cache, v_cache = arena.layer(1)
    order = torch.randperm(sum(widths) + 2, generator=g)  # scattered pages
    tables = torch.zeros(len(chunks), max(widths), dtype=torch.int64)
    for b, width in enumerate(widths):
        tables[b, :width] = order[sum(widths[:b]) : sum(widths[: b + 1])]
    lens = torch.tensor([n for _, n in chunks])
    starts = torch.cumsum(lens + 1, 0) - lens  # row starts[b] - 1 belongs to someone else
    q = torch.randn(int(starts[-1] + lens[-1]), q_heads, dim, generator=g).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    scale = dim**-0.5
    prefill_attention.paged_prefill(
        q,
        k_cache,
        v_cache,
        tables.to(DEVICE),
        starts.to(DEVICE),
        lens.to(DEVICE),
        torch.tensor(contexts, device=DEVICE),
        scale,
        window,
        out,
        int(lens.max()),
        **blocks,
    )
    assert out[starts - 1].isnan().all()
    for b, (cached, n) in enumerate(chunks):
        mine = slice(int(starts[b]), int(starts[b]) + n)
        want = reference(q[mine], k_cache, v_cache, tables[b].to(DEVICE), cached, scale, window)
        torch.testing.assert_close(out[mine].float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("q_heads, kv_heads", [(2, 2), (4, 1), (8, 1)], ids=["group1", "group4", "group8"])
def test_chunks_after_cached_prefixes(q_heads, kv_heads, dim, dtype):
    """A one-token prompt, whole prompts, chunks over 1..4 tiles after prefixes of 5..1200 tokens."""
    check(CHUNKS, q_heads, kv_heads, dim, dtype)


@pytest.mark.parametrize("blocks", BLOCKS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_page_sizes(dtype, blocks):
    check(CHUNKS[:4], 8, 2, 64, dtype, **blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_long_context(dtype):
    """A PRM step's shape over a ~4K-token prefix: 100 new tokens after 3996, beside a short prompt."""
    check([(3996, 100), (0, 7)], 4, 1, 128, dtype, page_size=64)


@pytest.mark.parametrize("blocks", BLOCKS[:2], ids=str)
@pytest.mark.parametrize("window", [1, 20, 100])
def test_window(window, blocks):
    """Windows shorter than a chunk, than a key tile, and spanning several: the masked and whole tiles."""
    check(CHUNKS[:4], 8, 2, 64, torch.float32, window=window, **blocks)


@pytest.mark.parametrize("q_heads, kv_heads", [(6, 2), (7, 1)], ids=["group3", "group7"])
def test_groups_that_do_not_divide_the_tile(q_heads, kv_heads):
    """BLOCK_Q = block_m // group query positions a tile; the spare rows idle."""
    check(CHUNKS[:4], q_heads, kv_heads, 64, torch.float32)
    check(CHUNKS[:4], q_heads, kv_heads, 64, torch.float32, window=20, block_m=16, block_n=16)


def test_chunk_lengths_across_tile_edges():
    """Lengths around multiples of 16 and 32 query positions: the default tile's (group 4) and block_m 64's."""
    check([(n % 13, n) for n in (15, 16, 17, 31, 32, 33, 63, 64, 65)], 4, 1, 64, torch.float32)
    check([(n % 13, n) for n in (15, 16, 17, 31, 32, 33)], 4, 1, 64, torch.float32, block_m=128, block_n=16)
