"""The shared page arena: the page-size rule and per-model views that never overlap across pages."""

from __future__ import annotations

import sys

import pytest
import torch

from treeserve.kv.arena import PAGE_ALIGN, KVArena, KVLayout, PageArena, shared_page_sizes

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)  # 256 bytes per token
BIG = KVLayout(num_layers=3, num_kv_heads=4, head_dim=16, dtype=torch.float32)  # 1536 bytes per token


def test_equal_layouts_share_the_smaller_page():
    page, sizes = shared_page_sizes([SMALL, SMALL], [16, 4])
    assert page == 4 * SMALL.token_bytes and sizes == [4, 4]


def test_unequal_layouts_fit_as_many_tokens_as_the_page_holds():
    page, sizes = shared_page_sizes([SMALL, BIG], [16, 16])
    assert page == 16 * SMALL.token_bytes  # 4096 bytes: the smaller preferred page
    assert sizes == [16, 2]  # 2 x 1536 = 3072 of 4096 bytes used by the big model
    page, sizes = shared_page_sizes([SMALL, BIG], [1, 16])
    assert page == BIG.page_bytes(1) and sizes[1] == 1  # a page holds at least one token of every model
    assert page % PAGE_ALIGN == 0


def view(pages: PageArena, layout: KVLayout, page_size: int) -> KVArena:
    return KVArena(0, layout.num_layers, page_size, layout.num_kv_heads, layout.head_dim, layout.dtype, "cpu", pages)


def test_two_models_views_write_only_their_own_page():
    page, (bs_small, bs_big) = shared_page_sizes([SMALL, BIG], [16, 16])
    pages = PageArena(5, page, "cpu")
    small, big = view(pages, SMALL, bs_small), view(pages, BIG, bs_big)
    assert small.num_pages == big.num_pages == 5
    k, v = big.layer(2)
    k[3].fill_(1.0)
    v[3].fill_(2.0)
    touched = pages.buffer.view(5, page).ne(0).any(dim=1)
    assert touched.tolist() == [False, False, False, True, False]
    ks, _ = small.layer(0)
    assert ks[2].eq(0).all() and ks[4].eq(0).all()
    big.copy_pages(torch.tensor([3]), torch.tensor([1]))
    assert torch.equal(big.buffer[1], big.buffer[3])
    assert pages.buffer.view(5, page).ne(0).any(dim=1).tolist() == [False, True, False, True, False]


def test_a_page_too_small_for_the_block_is_refused():
    pages = PageArena(2, SMALL.page_bytes(4), "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        view(pages, SMALL, 8)
    with pytest.raises(ValueError, match="smaller than one page"):
        PageArena(0, 64, "cpu")


def _thp_mode() -> str | None:
    """The bracketed mode of transparent huge pages (always, madvise, never), None where Linux has none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def test_cpu_arena_is_zeroed_private_memory_in_huge_pages_where_linux_gives_them():
    pages = PageArena(4, 1 << 20, "cpu")  # 4 MiB: at least one aligned 2 MiB range inside
    assert pages.nbytes == 4 << 20 and pages.buffer.dtype == torch.uint8
    assert not pages.buffer.any()
    pages.buffer[:: 1 << 12] = 7  # writable, and committed page by page
    mode = _thp_mode()
    if mode is None or not sys.platform.startswith("linux"):
        pytest.skip("no transparent huge pages here")
    mapping = _mapping_of(pages.buffer.data_ptr())
    assert mapping.get("Anonymous", "0 kB") != "0 kB", "the arena is not private anonymous memory (shared: no THP)"
    if mode in ("always", "madvise"):
        assert mapping.get("THPeligible") == "1", mapping


def test_an_fp8_view_holds_twice_the_tokens_of_bf16_and_a_scale_pair_a_layer():
    fp8 = KVLayout(SMALL.num_layers, SMALL.num_kv_heads, SMALL.head_dim, torch.float8_e4m3fn)
    assert 2 * fp8.token_bytes == SMALL.token_bytes
    page, sizes = shared_page_sizes([fp8, SMALL], [8, 4])
    assert page == 4 * SMALL.token_bytes and sizes == [8, 4]  # the FP8 model gets twice the tokens a page
    pages = PageArena(3, page, "cpu")
    arena = view(pages, fp8, sizes[0])
    assert arena.fp8 and arena.scales.tolist() == [[1.0, 1.0]] * fp8.num_layers  # none shipped: 1.0
    assert arena.layer_scales(1).data_ptr() == arena.scales[1].data_ptr()  # the kernels read the arena's own
    assert view(pages, SMALL, sizes[1]).layer_scales(0) is None
    with pytest.raises(ValueError, match=r"KV scales must be fp32 \[2, 2\]"):
        KVArena(0, 2, 8, 2, 16, torch.float8_e4m3fn, "cpu", pages, scales=torch.ones(2))
