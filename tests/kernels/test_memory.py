"""Host memory in 2 MiB pages: zeroed mappings of their own, and laid-out weights carved from shared ones."""

from __future__ import annotations

import threading

import torch

from treeserve.kernels.cpu.memory import ALIGN, CHUNK, huge_pages, weight_buffer, weights_in_huge_pages


def test_huge_pages_are_zeroed_and_writable():
    buffer = huge_pages(3 << 20)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 << 20 and not buffer.any()
    buffer[::4096] = 5
    assert int(buffer.sum()) == 5 * (3 << 20) // 4096


def test_weights_laid_out_during_a_load_share_aligned_mappings():
    with weights_in_huge_pages():
        first, second = weight_buffer(1000), weight_buffer(3000)
        big = weight_buffer(CHUNK + 1)  # larger than a mapping: one of its own size
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()  # one mapping
    assert first.data_ptr() % ALIGN == 0 and second.data_ptr() % ALIGN == 0
    assert second.data_ptr() >= first.data_ptr() + 1000  # no overlap
    assert (first.numel(), second.numel(), big.numel()) == (1000, 3000, CHUNK + 1)
    assert big.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    first.fill_(1)
    second.fill_(2)
    assert int(first.sum()) == 1000 and int(second.sum()) == 6000  # each its own bytes
    alone = weight_buffer(1000)  # outside a load: PyTorch's allocator, a storage of its own
    assert alone.untyped_storage().nbytes() == 1000


def test_loads_on_two_threads_keep_the_heap_until_both_end():
    inside, leave = threading.Event(), threading.Event()

    def load() -> None:
        with weights_in_huge_pages():
            inside.set()
            leave.wait()

    other = threading.Thread(target=load)
    other.start()
    inside.wait()
    with weights_in_huge_pages():
        pass  # this load ends first
    shared = weight_buffer(64)  # the other load still runs: carved from its mappings
    leave.set()
    other.join()
    assert shared.untyped_storage().nbytes() >= CHUNK
    assert weight_buffer(64).untyped_storage().nbytes() == 64


def test_layouts_carved_during_a_load_hold_the_same_values():
    """bf16_panels writes into a carved buffer what PyTorch's layout gives (any CPU); the same bytes
    are AMX's B tiles (amx_linear.c multiplies a dense matrix's panels as they lie)."""
    from treeserve.kernels.cpu import quant

    torch.manual_seed(0)
    weight = torch.randn(40, 64).bfloat16()
    tiles = torch.nn.functional.pad(weight, (0, 0, 0, 8)).view(3, 16, 2, 16, 2).permute(0, 2, 3, 1, 4)
    panels = torch.nn.functional.pad(weight, (0, 0, 0, 8)).view(3, 16, 32, 2).transpose(1, 2)
    with weights_in_huge_pages():
        laid = quant.bf16_panels(weight)
    assert laid.untyped_storage().nbytes() >= CHUNK  # carved from the load's mapping
    assert torch.equal(laid.view(torch.bfloat16).view(panels.shape), panels)
    assert torch.equal(laid.view(torch.bfloat16).view(tiles.shape), tiles)
