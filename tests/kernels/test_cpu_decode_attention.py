"""The C paged decode attention (`cpu_kernels.paged_decode`, bf16 pages) on the path this CPU takes:
AMX tiles for head_dim >= 64 where tiles run (real or emulated: TREESERVE_AMX_EMULATED=1), else
AVX512-BF16 dot products, else the generic loop. Against SDPA, contexts across page and tile
edges; a sequence's bits whatever batch or threads it runs in; and the vector path from a child
process without tiles, so an AMX machine tests both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.tiles_off import products_without_tiles
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kv.arena import KVArena

# D, q heads, KV heads: groups 4, 8, 3, 2, 2
SHAPES = {
    "gemma3": (256, 4, 1),
    "d128_g8": (128, 32, 4),
    "d64_g3": (64, 6, 2),
    "d128_g2": (128, 16, 8),
    "arith": (32, 8, 4),
}
CONTEXTS = [1, 15, 16, 17, 33, 100, 250]

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")


def _case(shape: str, page_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    head_dim, q_heads, kv_heads = SHAPES[shape]
    torch.manual_seed(seed)
    pages = -(-max(CONTEXTS) // page_size)
    arena = KVArena(len(CONTEXTS) * pages + 3, 2, page_size, kv_heads, head_dim, torch.bfloat16, "cpu")
    arena.buffer.view(torch.bfloat16).normal_()
    k_cache, v_cache = arena.layer(1)
    tables = torch.randperm(len(CONTEXTS) * pages + 3)[: len(CONTEXTS) * pages].view(len(CONTEXTS), pages)
    lens = torch.tensor(CONTEXTS)
    q = torch.randn(len(CONTEXTS), q_heads, head_dim, dtype=torch.bfloat16)
    return q, k_cache, v_cache, tables, lens


def _reference(q, k_cache, v_cache, tables, lens, window):
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2).float()
    values = v_cache[tables].flatten(1, 2).transpose(1, 2).float()
    pos = torch.arange(keys.shape[2])
    mask = pos[None] < lens[:, None]
    if window:
        mask &= pos[None] >= lens[:, None] - window
    ref = F.scaled_dot_product_attention(
        q.float()[:, :, None], keys, values, attn_mask=mask[:, None, None], enable_gqa=True
    )
    return ref[:, :, 0]


def _decode(q, k_cache, v_cache, tables, lens, window):
    return cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, q.shape[-1] ** -0.5, window)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("window", [None, 45])
def test_decode_matches_sdpa(shape, page_size, window):
    """16 keys of a page read in place (page 16) or copied (page 5, and a context's last keys)."""
    q, k_cache, v_cache, tables, lens = _case(shape, page_size)
    got = _decode(q, k_cache, v_cache, tables, lens, window)
    ref = _reference(q, k_cache, v_cache, tables, lens, window)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)  # p rounded to bf16 on the tiles


@pytest.mark.parametrize("shape", SHAPES)
def test_a_sequences_bits_do_not_depend_on_its_batch_or_threads(shape):
    q, k_cache, v_cache, tables, lens = _case(shape, 16, seed=1)
    batched = _decode(q, k_cache, v_cache, tables, lens, None)
    for b in range(len(CONTEXTS)):
        alone = _decode(q[b : b + 1], k_cache, v_cache, tables[b : b + 1], lens[b : b + 1], None)
        assert torch.equal(alone[0].view(torch.int16), batched[b].view(torch.int16))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        other = _decode(q, k_cache, v_cache, tables, lens, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(other.view(torch.int16), batched.view(torch.int16))


def decode_products(seed: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every shape's decode of `_case(shape, 16)` (run in the child without tiles)."""
    return {shape: _decode(*_case(shape, 16, int(seed)), None) for shape in SHAPES}


@pytest.mark.skipif(not cpu_kernels.prefill_tiles_available(), reason="no AMX tiles: the vector path is the one tested")
def test_tiles_off_the_vector_path_matches_sdpa_and_the_tiles(tmp_path):
    vector = products_without_tiles(
        "tests.kernels.test_cpu_decode_attention:decode_products", torch.tensor(2), tmp_path
    )
    tiles = decode_products(torch.tensor(2))
    for shape in SHAPES:
        q, k_cache, v_cache, tables, lens = _case(shape, 16, 2)
        ref = _reference(q, k_cache, v_cache, tables, lens, None)
        torch.testing.assert_close(vector[shape].float(), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(tiles[shape].float(), vector[shape].float(), atol=2e-2, rtol=2e-2)
