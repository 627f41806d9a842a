"""One model's view of a page pool: page tables, prefix-cache keys, statistics.

A full page's key chains xxh3 over (parent key, token ids) from a root salted with the model
id, so models sharing a pool never hit each other's pages. A finished sequence's last page, part
written, is keyed the same way over the tokens it holds (`cache_tail`): a request continuing
those tokens reads them instead of recomputing them. A keyed page never changes: a write into one
copies it first. Page states live in `page_pool.py`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import xxhash

from treeserve.kv.page_pool import CacheStats, NoFreePages, PagePool

__all__ = ["PageManager", "CacheStats", "NoFreePages", "PrefixHit"]


def _key(parent: int, data: bytes) -> int:
    """The key of a page holding the tokens `data` (int64s) after the page keyed `parent`."""
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + data)


@dataclass
class PrefixHit:
    pages: list[int] = field(default_factory=list)  # cached pages, in prefix order
    hashes: list[int] = field(default_factory=list)  # their keys
    missed: list[int] = field(default_factory=list)  # keys of the full pages after the hit
    tail: int = 0  # tokens of the last page, part written, after the full ones (0: none)

    def num_tokens(self, page_size: int) -> int:
        return len(self.hashes) * page_size + self.tail


class PageManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        model_id: str = "",
        enable_prefix_caching: bool = True,
        pool: PagePool | None = None,
    ):
        """Pages from `pool`, or from a pool of `num_pages` pages of its own when None."""
        self.pool = pool if pool is not None else PagePool(num_pages)
        self.owner = self.pool.register()
        self.num_pages = self.pool.num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = xxhash.xxh3_64_intdigest(model_id.encode())
        self.stats: CacheStats = self.pool.stats[self.owner]
        self.ref_counts = self.pool.ref_counts
        self.page_hash = self.pool.page_hash

    @property
    def num_free_pages(self) -> int:
        """Free or evictable pages, for any model of the pool."""
        return self.pool.num_available

    @property
    def num_used_pages(self) -> int:
        return self.pool.in_use[self.owner]

    @property
    def num_cached_pages(self) -> int:
        return self.pool.num_cached[self.owner]

    def pages_to_grow(self, page_table: list[int], write_start: int, total_tokens: int) -> int:
        new = max(0, -(-total_tokens // self.page_size) - len(page_table))
        return new + int(self._needs_copy(page_table, write_start, total_tokens))

    def _needs_copy(self, page_table: list[int], write_start: int, total_tokens: int) -> bool:
        """The first page written is held by other tables too, or keyed (a cached tail). The
        scheduler's decodes inline the first test: a decode never writes a keyed page, as a tail
        hit is copied when its sequence is admitted."""
        index = write_start // self.page_size
        if write_start >= total_tokens or index >= len(page_table):
            return False
        page = page_table[index]
        return self.ref_counts[page] > 1 or self.page_hash[page] is not None

    def find_prefix(self, token_ids: list[int], max_tokens: int) -> PrefixHit:
        """The longest cached prefix of at most `max_tokens` (no side effects)."""
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        keys = self.chain_hashes(token_ids[: max_tokens - max_tokens % self.page_size])
        for key in keys:
            page = self.pool.hash_to_page.get(key)
            if page is None:
                break
            hit.pages.append(page)
            hit.hashes.append(key)
        hit.missed = keys[len(hit.pages) :]
        start = len(hit.pages) * self.page_size
        most = min(self.page_size - 1, max_tokens - start)
        if most > 0:  # the longest cached tail of the page after the full hits
            parent = hit.hashes[-1] if hit.hashes else self.root_hash
            data = array("q", token_ids[start : start + most]).tobytes()
            for filled in range(most, 0, -1):
                page = self.pool.hash_to_page.get(_key(parent, data[: 8 * filled]))
                if page is not None:
                    hit.pages.append(page)
                    hit.tail = filled
                    break
        return hit

    def pages_to_acquire(self, hit: PrefixHit) -> int:
        return sum(self.ref_counts[b] == 0 for b in hit.pages)

    def acquire_prefix(self, hit: PrefixHit) -> None:
        for page in hit.pages:
            self._acquire(page)
        self.stats.hits += len(hit.hashes)
        self.stats.tail_hits += hit.tail > 0
        self.stats.misses += len(hit.missed)
        self.stats.thrash += sum(key in self.pool.evicted_hashes for key in hit.missed)

    def chain_hashes(self, token_ids: list[int], parent: int | None = None) -> list[int]:
        """Keys of the full pages, chained from `parent` (None: the root): xxh3 of the parent key and
        the tokens, 8 bytes each."""
        keys = []
        width = 8 * self.page_size
        data = array("q", token_ids[: len(token_ids) - len(token_ids) % self.page_size]).tobytes()
        parent = self.root_hash if parent is None else parent
        for start in range(0, len(data), width):
            parent = _key(parent, data[start : start + width])
            keys.append(parent)
        return keys

    def _acquire(self, page: int) -> None:
        self.pool.acquire(page)

    def _take_page(self) -> int:
        return self.pool.take(self.owner)

    def grow(self, page_table: list[int], write_start: int, total_tokens: int) -> list[tuple[int, int]]:
        """Make room for tokens [write_start, total_tokens); returns copy-on-write copies (src, dst).
        Never fails once the caller checked `pages_to_grow(...) <= num_free_pages`."""
        copies = []
        if self._needs_copy(page_table, write_start, total_tokens):
            index = write_start // self.page_size
            old = page_table[index]
            new = self._take_page()
            self.pool.release(old)  # still held by its other owners, or cached (copies run first in a step)
            page_table[index] = new
            copies.append((old, new))
        while len(page_table) * self.page_size < total_tokens:
            page_table.append(self._take_page())
        return copies

    def fork(self, page_table: list[int]) -> list[int]:
        for page in page_table:
            self.pool.acquire(page)
        return list(page_table)

    def truncate(self, page_table: list[int], num_tokens: int) -> None:
        keep = -(-num_tokens // self.page_size)
        for page in reversed(page_table[keep:]):
            self.pool.release(page)
        del page_table[keep:]

    def release(self, page_table: list[int]) -> None:
        """Tail pages become evictable before the prefix."""
        for page in reversed(page_table):
            self.pool.release(page)
        page_table.clear()

    def commit_full_pages(
        self, page_table: list[int], page_hashes: list[int], token_ids: list[int], num_computed: int
    ) -> None:
        bs = self.page_size
        done = len(page_hashes)
        if not self.enable_prefix_caching or num_computed // bs <= done:
            return
        parent = page_hashes[-1] if page_hashes else None
        keys = self.chain_hashes(token_ids[done * bs : (num_computed // bs) * bs], parent)
        for page, key in zip(page_table[done:], keys, strict=False):
            page_hashes.append(key)
            self.pool.key(page, key)

    def cache_tail(
        self, page_table: list[int], page_hashes: list[int], token_ids: list[int], num_computed: int
    ) -> None:
        """Key the last page of a sequence that ends with `num_computed` tokens' KV written, where
        that page is part written and this table alone holds it (another could still write it)."""
        index, filled = divmod(num_computed, self.page_size)
        if not self.enable_prefix_caching or not filled or index >= len(page_table):
            return
        self.commit_full_pages(page_table, page_hashes, token_ids, num_computed)
        page = page_table[index]
        if len(page_hashes) == index and self.ref_counts[page] == 1:
            parent = page_hashes[-1] if page_hashes else self.root_hash
            self.pool.key(page, _key(parent, array("q", token_ids[index * self.page_size : num_computed]).tobytes()))

    def check_invariants(self) -> None:
        self.pool.check_invariants()

    def check_idle(self) -> None:
        self.check_invariants()
        held = [b for b, c in enumerate(self.ref_counts) if c and self.pool.owner[b] == self.owner]
        assert not held, f"pages still held after all requests ended: {held[:16]}"
