"""Host memory in 2 MiB pages: the KV arena and the weights the CPU kernels lay out.

A decode step streams every weight once and reads K/V from hundreds of pages scattered over the
arena. In 4 KiB pages each one is a TLB miss, the hardware prefetcher stops at every page's end,
and the walk evicts the TLB entries of the host's own Python that runs next. Both buffers are
therefore anonymous private mappings Linux is asked to back with 2 MiB pages (`MADV_HUGEPAGE`,
what PyTorch does for tensors of 2 MiB and more under `THP_MEM_ALLOC_ENABLE=1`). Where
transparent huge pages are `never` nothing changes. A mapping's pages are committed when first
written, so an arena costs memory as it fills.

* `huge_pages(n)`: n zeroed bytes in a mapping of their own (the KV arena).
* `weights_in_huge_pages()`: while a model's layers lay their weights out (`layers.pick_kernels`),
  `weight_buffer(n)` carves each matrix from shared 64 MiB mappings, one run of memory for all of
  them, since most of a small model's matrices are smaller than one 2 MiB page. Outside it,
  `weight_buffer` is `torch.empty`. A mapping lives while a matrix carved from it does; the unused
  tail of the last one is never committed.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import torch

ALIGN = 64  # bytes: every carved matrix starts on a cache line (the kernels' aligned loads)
CHUNK = 64 << 20  # bytes a weight mapping holds (a larger matrix gets a mapping of its size)


def huge_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed host memory (uint8), in 2 MiB pages where Linux gives them."""
    # private and anonymous: Python's default mapping is shared, which is shmem and never huge
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with suppress(OSError):
            buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)


class _Heap:
    """Carves aligned slices from huge-page mappings, one after another."""

    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // ALIGN) * ALIGN
        if self.chunk is None or self.used + size > self.chunk.numel():
            self.chunk, self.used = huge_pages(max(size, CHUNK)), 0
        out = self.chunk[self.used : self.used + nbytes]
        self.used += size
        return out


_lock = threading.Lock()
_heap: _Heap | None = None
_users = 0  # loads inside `weights_in_huge_pages` (two models may load on two threads)


@contextmanager
def weights_in_huge_pages() -> Iterator[None]:
    """While inside, `weight_buffer` carves from shared huge-page mappings."""
    global _heap, _users
    with _lock:
        _users += 1
        if _heap is None:
            _heap = _Heap()
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if not _users:
                _heap = None  # its mappings live on in the matrices carved from them


def weight_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of `nbytes` for a laid-out weight matrix (uninitialised), 64-byte aligned."""
    with _lock:
        if _heap is not None:
            return _heap.take(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)
