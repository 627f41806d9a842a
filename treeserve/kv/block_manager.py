"""One model's view of a page pool: block tables, prefix-cache keys, per-model statistics.

A full block's key is a hash chained over (parent key, its token ids), salted with the
model id, so equal keys mean equal prefixes of the same model, and models sharing a pool
never see each other's pages as hits. The page states themselves (in use, cached, free),
the free list and the LRU of cached pages live in `page_pool.py`, possibly shared with
other models. Evicting only ever takes cached pages (count 0), so it never loses data a
running sequence needs. This module knows token ids and page numbers, nothing about
requests or tensors.
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
        """Pages of `block_size` tokens from `pool` (shared with other models), or from a
        pool of `num_blocks` pages of its own when `pool` is None."""
        self.pool = pool if pool is not None else PagePool(num_blocks)
        self.owner = self.pool.register()
        self.num_blocks = self.pool.num_pages
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = xxhash.xxh3_64_intdigest(model_id.encode())
        self.stats: CacheStats = self.pool.stats[self.owner]
        self.ref_counts = self.pool.ref_counts
        self.block_hash = self.pool.block_hash

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Pages that can be handed out now (free, or cached and evictable), to any model of the pool."""
        return self.pool.num_available

    @property
    def num_used_blocks(self) -> int:
        """Pages this model holds (reference count > 0)."""
        return self.pool.in_use[self.owner]

    @property
    def num_cached_blocks(self) -> int:
        """This model's cached pages (count 0, keyed, evictable)."""
        return self.pool.num_cached[self.owner]

    def blocks_to_grow(self, block_table: list[int], write_start: int, total_tokens: int) -> int:
        """Pages needed so tokens [write_start, total_tokens) can be written to this table."""
        new = max(0, -(-total_tokens // self.block_size) - len(block_table))
        return new + int(self._needs_copy(block_table, write_start, total_tokens))

    def _needs_copy(self, block_table: list[int], write_start: int, total_tokens: int) -> bool:
        index = write_start // self.block_size
        return bool(self.pool.shared_pages) and write_start < total_tokens and index < len(block_table) and (
            self.ref_counts[block_table[index]] > 1
        )  # (no page has two owners: none needs a copy; the scheduler's decodes inline this check)

    # ---- hashing and lookup -----------------------------------------------------------
    def find_prefix(self, token_ids: list[int], max_tokens: int) -> PrefixHit:
        """The cached pages holding the longest cached prefix of at most `max_tokens` (no side effects)."""
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
        """How many now-evictable pages acquiring `hit` takes off the free count."""
        return sum(self.ref_counts[b] == 0 for b in hit.blocks)

    def acquire_prefix(self, hit: PrefixHit) -> None:
        for block in hit.blocks:
            self._acquire(block)
        self.stats.hits += len(hit.blocks)
        self.stats.misses += len(hit.missed)
        self.stats.thrash += sum(key in self.pool.evicted_hashes for key in hit.missed)

    def chain_hashes(self, token_ids: list[int], parent: int | None = None) -> list[int]:
        """Keys of every full block of `token_ids`, chained from `parent` (None: the root): a block's
        key is xxh3 of its parent's key (8 bytes) and its tokens (8 bytes each)."""
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
        """Make room for tokens [write_start, total_tokens); returns page copies (src, dst) to do.

        The caller checks `blocks_to_grow(...) <= num_free_blocks` first (the scheduler does);
        then this never fails.
        A shared page about to be written is copied first (copy-on-write).
        """
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
        """A second owner of the same pages (copy-on-write on the next write)."""
        for block in block_table:
            self.pool.acquire(block)
        return list(block_table)

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Drop the pages past the first `num_tokens` tokens (rejected speculative tokens' pages)."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(block_table[keep:]):
            self.pool.release(block)
        del block_table[keep:]

    def release(self, block_table: list[int]) -> None:
        """Drop one owner of each page; tail pages become evictable before the prefix."""
        for block in reversed(block_table):
            self.pool.release(block)
        block_table.clear()

    def commit_full_blocks(
        self, block_table: list[int], block_hashes: list[int], token_ids: list[int], num_computed: int
    ) -> None:
        """Key every block whose tokens are all computed, so later sequences can reuse it."""
        bs = self.block_size
        done = len(block_hashes)
        if not self.enable_prefix_caching or num_computed // bs <= done:
            return
        parent = block_hashes[-1] if block_hashes else None
        keys = self.chain_hashes(token_ids[done * bs : (num_computed // bs) * bs], parent)
        for block, key in zip(block_table[done:], keys, strict=False):
            block_hashes.append(key)
            self.pool.key(block, key)

    # ---- invariants -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless every page of the pool is in exactly one consistent state."""
        self.pool.check_invariants()

    def check_idle(self) -> None:
        """After all of this model's requests ended: invariants hold and it holds no page."""
        self.check_invariants()
        held = [b for b, c in enumerate(self.ref_counts) if c and self.pool.owner[b] == self.owner]
        assert not held, f"pages still held after all requests ended: {held[:16]}"
