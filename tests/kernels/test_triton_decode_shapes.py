"""The Triton decode kernel (`decode_attention.paged_decode`) over the shapes it serves, against
a plain PyTorch reference (each sequence's pages gathered in order, softmax in fp32).

One batch mixes contexts of 1, 17, 700 and 4096 keys (a lone key, less than a tile, a few
tiles, many) on shuffled pages of a one-layer arena, with page tables wider than the
longest sequence needs (as CUDA graphs pad them). Matrix: bf16 and fp32; head_dim 64 and
128; GQA groups 1, 4 and 8; sliding windows; forced split counts of 1 (pass 1 writes the
output), a few, and more than a short context has tiles (empty partitions); tiles of 16 and
64 keys; the shape-only split rule; a row's bits alone and in a batch. fp32 within 1e-5, bf16 within 2e-2 (its output is
rounded to bf16, and so are the probabilities of the second product).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

from treeserve.kernels.triton import decode_attention  # noqa: E402
from treeserve.kv.arena import KVArena  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CONTEXTS = [1, 17, 700, 4096]
PAGE = 16
KV_HEADS = 2


def paged(contexts: list[int], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V views of a one-layer arena of random rows, and page tables of shuffled pages
    with two padding columns (page 0) past the widest sequence."""
    g = torch.Generator().manual_seed(0)
    widths = [-(-c // PAGE) for c in contexts]
    num_pages = sum(widths) + 1
    arena = KVArena(num_pages, 1, PAGE, KV_HEADS, dim, dtype, DEVICE)
    arena.buffer.copy_(torch.randn(arena.buffer.shape, generator=g))
    order = torch.randperm(num_pages - 1, generator=g) + 1
    tables = torch.zeros(len(contexts), max(widths) + 2, dtype=torch.int64)
    used = 0
    for b, width in enumerate(widths):
        tables[b, :width] = order[used : used + width]
        used += width
    return *arena.layer(0), tables.to(DEVICE)


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    contexts: list[int],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """[B, Hq, D] in fp32: each query over its sequence's keys in view, gathered page by page."""
    group = q.shape[1] // k_cache.shape[2]
    out = []
    for b, context in enumerate(contexts):
        first = max(context - window, 0) if window else 0
        keys = k_cache[tables[b]].flatten(0, 1)[first:context].float().repeat_interleave(group, 1)  # [T, Hq, D]
        values = v_cache[tables[b]].flatten(0, 1)[first:context].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), keys) * scale
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values))
    return torch.stack(out)


def check(
    dtype: torch.dtype, dim: int, group: int, window: int | None = None, contexts: list[int] = CONTEXTS, **tunables: int
) -> None:
    k_cache, v_cache, tables = paged(contexts, dim, dtype)
    q = torch.randn(len(contexts), KV_HEADS * group, dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    lens = torch.tensor(contexts, device=DEVICE)
    scale = dim**-0.5
    got = decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, window, **tunables)
    assert got.dtype == dtype and got.shape == q.shape
    want = reference(q, k_cache, v_cache, tables, contexts, scale, window)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_reference(dtype, dim, group):
    """The defaults: tiles of BLOCK_N keys, the split count of the shape rule."""
    check(dtype, dim, group)


@pytest.mark.parametrize("window", [1, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sliding_window(dtype, window):
    """Windows of one key, of fewer keys than a long context, and of more than a short one has."""
    check(dtype, 64, 4, window)


@pytest.mark.parametrize("block_n", [16, 64])
@pytest.mark.parametrize("num_splits", [1, 3, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forced_splits_and_tiles(dtype, num_splits, block_n):
    """One split (no reduce), a few, and 32: most of a short context's partitions are empty and weigh 0."""
    check(dtype, 64, 4, num_splits=num_splits, block_n=block_n)


def test_windowed_splits_share_the_keys_in_view():
    """With a window, the partitions cut the keys in view, not the whole context."""
    check(torch.float32, 64, 2, 300, num_splits=5, block_n=16)


def test_strided_q():
    """q a view of a wider tensor (its rows' stride is not Hq * D)."""
    wide = torch.randn(3, 2 * KV_HEADS * 4, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    q = wide[:, : KV_HEADS * 4]
    contexts = [5, 40, 130]
    k_cache, v_cache, tables = paged(contexts, 64, torch.float32)
    got = decode_attention.paged_decode(
        q, k_cache, v_cache, tables, torch.tensor(contexts, device=DEVICE), 0.125, None, num_splits=2
    )
    want = reference(q, k_cache, v_cache, tables, contexts, 0.125, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_split_count_depends_on_shapes_only():
    """The grid: partitions of MIN_PARTITION keys or more for the widest view the table allows,
    at most MAX_SPLITS."""
    least, most = decode_attention.MIN_PARTITION, decode_attention.MAX_SPLITS
    assert decode_attention.split_count(700, None) == 1
    assert decode_attention.split_count(least + 1, None) == 2
    assert decode_attention.split_count(1 << 20, None) == most
    assert decode_attention.split_count(1 << 20, 100) == 1  # a window bounds the view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_bits_do_not_depend_on_its_batch(dtype):
    """A sequence alone and beside a much longer one (a wider table: more splits in the grid,
    and for a short row the reduce pass instead of pass 1's direct write): the same bits."""
    contexts = [300, 2500, 5000]  # one partition; 3 of at least MIN_PARTITION keys; 5
    k_cache, v_cache, tables = paged(contexts, 64, dtype)
    q = torch.randn(3, KV_HEADS * 4, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    lens = torch.tensor(contexts, device=DEVICE)
    together = decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, None)
    for b, context in enumerate(contexts):
        width = -(-context // PAGE)
        alone = decode_attention.paged_decode(
            q[b : b + 1], k_cache, v_cache, tables[b : b + 1, :width], lens[b : b + 1], 0.125, None
        )
        assert torch.equal(alone, together[b : b + 1]), context


def test_empty_batch():
    k_cache, v_cache, tables = paged([3], 64, torch.float32)
    q = torch.empty(0, KV_HEADS, 64, device=DEVICE)
    got = decode_attention.paged_decode(q, k_cache, v_cache, tables[:0], torch.empty(0, dtype=torch.int64), 0.125, None)
    assert got.shape == q.shape
