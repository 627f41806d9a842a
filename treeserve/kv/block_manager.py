"""One model's view of a page pool: block tables, prefix-cache keys, statistics.

A full block's key chains xxh3 over (parent key, token ids) from a root salted with the model
id, so models sharing a pool never hit each other's pages. Page states live in `page_pool.py`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import xxhash

from treeserve.kv.page_pool import CacheStats, NoFreePages, PagePool

__all__ = ["BlockManager", "CacheStats", "NoFreePages", "PrefixHit"]


@dataclass
class PrefixHit:
    blocks: list[int] = field(default_factory=list)  # cached pages, in prefix order
    hashes: list[int] = field(default_factory=list)  # their keys
    missed: list[int] = field(default_factory=list)  # keys of the full blocks after the hit


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model_id: str = "",
        enable_prefix_caching: bool = True,
        pool: PagePool | None = None,
    ):
        """Pages from `pool`, or from a pool of `num_blocks` pages of its own when None."""
        self.pool = pool if pool is not None else PagePool(num_blocks)
        self.owner = self.pool.register()
        self.num_blocks = self.pool.num_pages
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = xxhash.xxh3_64_intdigest(model_id.encode())
        self.stats: CacheStats = self.pool.stats[self.owner]
        self.ref_counts = self.pool.ref_counts
        self.block_hash = self.pool.block_hash

    @property
    def num_free_blocks(self) -> int:
        """Free or evictable pages, for any model of the pool."""
        return self.pool.num_available

    @property
    def num_used_blocks(self) -> int:
        return self.pool.in_use[self.owner]

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached[self.owner]

    def blocks_to_grow(self, block_table: list[int], write_start: int, total_tokens: int) -> int:
        new = max(0, -(-total_tokens // self.block_size) - len(block_table))
        return new + int(self._needs_copy(block_table, write_start, total_tokens))

    def _needs_copy(self, block_table: list[int], write_start: int, total_tokens: int) -> bool:
        index = write_start // self.block_size
        return (
            bool(self.pool.shared_pages)
            and write_start < total_tokens
            and index < len(block_table)
            and (self.ref_counts[block_table[index]] > 1)
        )  # the scheduler's decodes inline this check

    def find_prefix(self, token_ids: list[int], max_tokens: int) -> PrefixHit:
        """The longest cached prefix of at most `max_tokens` (no side effects)."""
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        keys = self.chain_hashes(token_ids[: max_tokens - max_tokens % self.block_size])
        for key in keys:
            block = self.pool.hash_to_block.get(key)
            if block is None:
                break
            hit.blocks.append(block)
            hit.hashes.append(key)
        hit.missed = keys[len(hit.blocks) :]
        return hit

    def pages_to_acquire(self, hit: PrefixHit) -> int:
        return sum(self.ref_counts[b] == 0 for b in hit.blocks)

    def acquire_prefix(self, hit: PrefixHit) -> None:
        for block in hit.blocks:
            self._acquire(block)
        self.stats.hits += len(hit.blocks)
        self.stats.misses += len(hit.missed)
        self.stats.thrash += sum(key in self.pool.evicted_hashes for key in hit.missed)

    def chain_hashes(self, token_ids: list[int], parent: int | None = None) -> list[int]:
        """Keys of the full blocks, chained from `parent` (None: the root): xxh3 of the parent key and
        the tokens, 8 bytes each."""
        keys = []
        width = 8 * self.block_size
        data = array("q", token_ids[: len(token_ids) - len(token_ids) % self.block_size]).tobytes()
        parent = self.root_hash if parent is None else parent
        for start in range(0, len(data), width):
            parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + data[start : start + width])
            keys.append(parent)
        return keys

    def _acquire(self, block: int) -> None:
        self.pool.acquire(block)

    def _take_page(self) -> int:
        return self.pool.take(self.owner)

    def grow(self, block_table: list[int], write_start: int, total_tokens: int) -> list[tuple[int, int]]:
        """Make room for tokens [write_start, total_tokens); returns copy-on-write copies (src, dst).
        Never fails once the caller checked `blocks_to_grow(...) <= num_free_blocks`."""
        copies = []
        if self._needs_copy(block_table, write_start, total_tokens):
            index = write_start // self.block_size
            old = block_table[index]
            new = self._take_page()
            self.pool.release(old)  # still held by its other owners
            block_table[index] = new
            copies.append((old, new))
        while len(block_table) * self.block_size < total_tokens:
            block_table.append(self._take_page())
        return copies

    def fork(self, block_table: list[int]) -> list[int]:
        for block in block_table:
            self.pool.acquire(block)
        return list(block_table)

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        keep = -(-num_tokens // self.block_size)
        for block in reversed(block_table[keep:]):
            self.pool.release(block)
        del block_table[keep:]

    def release(self, block_table: list[int]) -> None:
        """Tail pages become evictable before the prefix."""
        for block in reversed(block_table):
            self.pool.release(block)
        block_table.clear()

    def commit_full_blocks(
        self, block_table: list[int], block_hashes: list[int], token_ids: list[int], num_computed: int
    ) -> None:
        bs = self.block_size
        done = len(block_hashes)
        if not self.enable_prefix_caching or num_computed // bs <= done:
            return
        parent = block_hashes[-1] if block_hashes else None
        keys = self.chain_hashes(token_ids[done * bs : (num_computed // bs) * bs], parent)
        for block, key in zip(block_table[done:], keys, strict=False):
            block_hashes.append(key)
            self.pool.key(block, key)

    def check_invariants(self) -> None:
        self.pool.check_invariants()

    def check_idle(self) -> None:
        self.check_invariants()
        held = [b for b, c in enumerate(self.ref_counts) if c and self.pool.owner[b] == self.owner]
        assert not held, f"pages still held after all requests ended: {held[:16]}"
