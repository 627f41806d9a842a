"""Host memory in 2 MiB pages (`MADV_HUGEPAGE`) for the KV arena and laid-out weights: a decode
step streams every weight and scattered K/V pages, which in 4 KiB pages miss the TLB at every
page. `huge_pages(n)`: the arena, committed as written. Inside `weights_in_huge_pages()`,
`weight_buffer(n)` carves matrices from shared 64 MiB mappings (most are under 2 MiB).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import torch

ALIGN = 64  # bytes: a cache line
CHUNK = 64 << 20  # a larger matrix gets a mapping of its size


def huge_pages(nbytes: int) -> torch.Tensor:
    # private: Python's default shared mapping is shmem, never huge
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with suppress(OSError):
            buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)


class _Heap:
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
_users = 0  # two models may load on two threads


@contextmanager
def weights_in_huge_pages() -> Iterator[None]:
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
    """Uninitialised uint8, 64-byte aligned."""
    with _lock:
        if _heap is not None:
            return _heap.take(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8)
