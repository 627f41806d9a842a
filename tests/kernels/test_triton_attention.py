"""The Triton attention kernels against SDPA over gathered pages (a GPU, or CPU tensors in Triton's interpreter).

Caches are real arena views (`KVArena.layer`: page stride of the shared arena, V at an
offset from K) with shuffled page tables. Matrix: page sizes 1, 4, 16 and 64, contexts
crossing pages, GQA ratios 1/2/4, head_dim 16/32/64/128/256, sliding windows shorter than
the context; decode over several partitions (and over one); prefill chunks of 1..N queries
after cached prefixes (prefix hits) in one flat batch with rows of other groups between
them. fp32 within 1e-4, bf16 within 2e-2 of fp32 SDPA over the same bf16 inputs. The KV
store writes its slots of a strided view of a shared arena and no other byte.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

from treeserve.kernels.triton import decode_attention, kv_store, prefill_attention  # noqa: E402
from treeserve.kv.arena import KVArena, PageArena  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
CASES = [  # (page_size, q_heads, kv_heads, head_dim, window)
    (4, 4, 4, 16, None),
    (16, 4, 2, 16, None),
    (4, 8, 2, 64, 7),
    (16, 4, 1, 64, 20),
    (1, 4, 2, 32, 9),
    (64, 2, 1, 128, None),
    (16, 2, 2, 256, 9),
]


def paged_cache(contexts: list[int], page_size: int, kv_heads: int, dim: int, dtype: torch.dtype):
    """Layer 1 of a 2-layer arena holding random K/V, and a shuffled page table per sequence."""
    g = torch.Generator().manual_seed(0)
    widths = [-(-c // page_size) for c in contexts]
    num_pages = sum(widths) + 3
    arena = KVArena(num_pages, 2, page_size, kv_heads, dim, dtype, DEVICE)
    arena.buffer.copy_(torch.randn(arena.buffer.shape, generator=g))
    order = torch.randperm(num_pages, generator=g)
    tables = torch.zeros(len(contexts), max(widths), dtype=torch.int64)
    used = 0
    for b, width in enumerate(widths):
        tables[b, :width] = order[used : used + width]
        used += width
    return *arena.layer(1), tables.to(DEVICE)


def reference(q, q_pos, k_cache, v_cache, table, context, scale, window):
    """fp32 SDPA of one sequence's queries q [Q, Hq, D] at positions q_pos [Q] over its gathered pages."""
    kv_heads, dim = k_cache.shape[2:]
    keys = k_cache[table].reshape(-1, kv_heads, dim)[:context].float().transpose(0, 1)
    values = v_cache[table].reshape(-1, kv_heads, dim)[:context].float().transpose(0, 1)
    pos = torch.arange(context, device=q.device)
    allowed = pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= pos[None, :] > q_pos[:, None] - window
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


def check_decode(contexts, case, dtype, partition_size):
    page_size, q_heads, kv_heads, dim, window = case
    k_cache, v_cache, tables = paged_cache(contexts, page_size, kv_heads, dim, dtype)
    q = torch.randn(len(contexts), q_heads, dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    lens = torch.tensor(contexts, device=DEVICE)
    scale = dim**-0.5
    got = decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, window, partition_size)
    assert got.dtype == dtype and got.shape == q.shape
    for b, context in enumerate(contexts):
        q_pos = torch.tensor([context - 1], device=DEVICE)
        want = reference(q[b : b + 1], q_pos, k_cache, v_cache, tables[b], context, scale, window)
        torch.testing.assert_close(got[b].float(), want[0], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_decode_over_partitions(case, dtype):
    """partition_size 16: a 70-token context spans 5 partitions (reduced), windows skip the early ones."""
    check_decode([1, 5, 33, 70], case, dtype, partition_size=16)


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=str)
def test_decode_in_one_partition(case):
    check_decode([3, 40, 200], case, torch.float32, partition_size=decode_attention.PARTITION_SIZE)


def check_prefill(chunks, case, dtype):
    """chunks: (cached tokens before the chunk, chunk length) per sequence. The flat batch has
    a row of another group before each chunk; the kernel must leave those rows alone."""
    page_size, q_heads, kv_heads, dim, window = case
    contexts = [cached + n for cached, n in chunks]
    k_cache, v_cache, tables = paged_cache(contexts, page_size, kv_heads, dim, dtype)
    lens = torch.tensor([n for _, n in chunks])
    starts = torch.cumsum(lens + 1, 0) - lens  # row starts[b] - 1 belongs to someone else
    rows = int(starts[-1] + lens[-1])
    q = torch.randn(rows, q_heads, dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    scale = dim**-0.5
    prefill_attention.paged_prefill(
        q,
        k_cache,
        v_cache,
        tables,
        starts.to(DEVICE),
        lens.to(DEVICE),
        torch.tensor(contexts, device=DEVICE),
        scale,
        window,
        out,
    )
    assert out[starts - 1].isnan().all()
    for b, (cached, n) in enumerate(chunks):
        mine = slice(int(starts[b]), int(starts[b]) + n)
        q_pos = torch.arange(cached, cached + n, device=DEVICE)
        want = reference(q[mine], q_pos, k_cache, v_cache, tables[b], cached + n, scale, window)
        torch.testing.assert_close(out[mine].float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_chunks_after_cached_prefixes(case, dtype):
    """A whole prompt, a one-query chunk after a hit (verification's shape), chunks over 2 and 3 query tiles."""
    check_prefill([(0, 23), (9, 1), (12, 17), (30, 40)], case, dtype)


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_every_chunk_length(window):
    """Chunk lengths 1..18 (across the 16-query tile edge) after varied cached prefixes, in one batch."""
    check_prefill([((7 * n) % 13, n) for n in range(1, 19)], (4, 4, 2, 16, window), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_only_its_slots_of_a_shared_arena(dtype):
    def arena() -> KVArena:  # 2 layers of 4 tokens x 2 heads x 16 in 4 KiB pages: each page has unused bytes
        pages = PageArena(num_pages=6, page_bytes=4096, device=DEVICE)
        pages.buffer.copy_(torch.randint(0, 256, pages.buffer.shape, generator=torch.Generator().manual_seed(1)))
        return KVArena(6, 2, 4, 2, 16, dtype, DEVICE, pages=pages)

    qkv = torch.randn(5, 8 * 16).to(DEVICE, dtype)  # a fused projection: k and v are strided views of it
    k = qkv[:, 4 * 16 : 6 * 16].view(5, 2, 16)
    v = qkv[:, 6 * 16 :].view(5, 2, 16)
    slot_pages = torch.tensor([3, 3, 0, 5, 2], device=DEVICE)
    slot_offsets = torch.tensor([0, 3, 1, 2, 3], device=DEVICE)
    got, want = arena(), arena()
    kv_store.store_kv(k, v, *got.layer(1), slot_pages, slot_offsets)
    k_ref, v_ref = want.layer(1)
    k_ref[slot_pages, slot_offsets] = k
    v_ref[slot_pages, slot_offsets] = v
    assert not torch.equal(got.pages.buffer, arena().pages.buffer)
    assert torch.equal(got.pages.buffer, want.pages.buffer)  # byte for byte: the slots, and nothing else
