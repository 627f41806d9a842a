"""Which page belongs to whom: block tables, reference counts, the prefix cache, eviction.

Every page is in exactly one state:
- in use: reference count > 0 (held by one or more block tables; shared pages are
  copy-on-write);
- cached: count 0 but its content is keyed in the prefix cache; reusable by a later
  sequence with the same prefix until evicted (least recently released first);
- free: count 0, content meaningless.

A full block's key is a hash chained over (parent key, its token ids), salted with the
model id, so equal keys mean equal prefixes of the same model. Evicting only ever takes
cached pages (count 0), so it never loses data a running sequence needs. This module
knows token ids and page numbers, nothing about requests or tensors.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import xxhash


@dataclass
class CacheStats:
    hits: int = 0  # full blocks found in the prefix cache
    misses: int = 0  # full blocks looked up and not found
    evictions: int = 0  # cached pages reclaimed for new content
    thrash: int = 0  # misses on a key that was cached before and evicted

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class NoFreePages(RuntimeError):
    pass


@dataclass
class PrefixHit:
    blocks: list[int] = field(default_factory=list)  # cached pages, in prefix order
    hashes: list[int] = field(default_factory=list)  # their keys
    missed: list[int] = field(default_factory=list)  # keys of the full blocks after the hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, model_id: str = "", enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = xxhash.xxh3_64_intdigest(model_id.encode())
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # count-0 keyed pages, LRU first
        self.hash_to_block: dict[int, int] = {}
        self.evicted_hashes: set[int] = set()
        self.stats = CacheStats()

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Pages that can be handed out now (free, or cached and evictable)."""
        return len(self.free) + len(self.cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_to_grow(self, block_table: list[int], write_start: int, total_tokens: int) -> int:
        """Pages needed so tokens [write_start, total_tokens) can be written to this table."""
        new = max(0, -(-total_tokens // self.block_size) - len(block_table))
        return new + int(self._needs_copy(block_table, write_start, total_tokens))

    def _needs_copy(self, block_table: list[int], write_start: int, total_tokens: int) -> bool:
        index = write_start // self.block_size
        return write_start < total_tokens and index < len(block_table) and self.ref_counts[block_table[index]] > 1

    # ---- hashing and lookup -----------------------------------------------------------
    def hash_block(self, parent: int | None, tokens: list[int]) -> int:
        h = xxhash.xxh3_64()
        h.update((self.root_hash if parent is None else parent).to_bytes(8, "little"))
        h.update(array("q", tokens).tobytes())
        return h.intdigest()

    def find_prefix(self, token_ids: list[int], max_tokens: int) -> PrefixHit:
        """The cached pages holding the longest cached prefix of at most `max_tokens` (no side effects)."""
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        keys = self.chain_hashes(token_ids[: max_tokens - max_tokens % self.block_size])
        for key in keys:
            block = self.hash_to_block.get(key)
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
        self.stats.thrash += sum(key in self.evicted_hashes for key in hit.missed)

    def chain_hashes(self, token_ids: list[int], parent: int | None = None) -> list[int]:
        """Keys of every full block of `token_ids`, chained from `parent` (None: the root)."""
        keys = []
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = self.hash_block(parent, token_ids[start : start + bs])
            keys.append(parent)
        return keys

    def _acquire(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.cached.pop(block)
        self.ref_counts[block] += 1

    # ---- allocation -------------------------------------------------------------------
    def _take_page(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            key = self.block_hash[block]
            del self.hash_to_block[key]
            self.block_hash[block] = None
            self.evicted_hashes.add(key)
            self.stats.evictions += 1
        else:
            raise NoFreePages("no free KV pages")
        self.ref_counts[block] = 1
        return block

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
            self.ref_counts[old] -= 1
            block_table[index] = new
            copies.append((old, new))
        while len(block_table) * self.block_size < total_tokens:
            block_table.append(self._take_page())
        return copies

    def fork(self, block_table: list[int]) -> list[int]:
        """A second owner of the same pages (copy-on-write on the next write)."""
        for block in block_table:
            self.ref_counts[block] += 1
        return list(block_table)

    def release(self, block_table: list[int]) -> None:
        """Drop one owner of each page; tail pages become evictable before the prefix."""
        for block in reversed(block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise AssertionError(f"page {block} released more often than acquired")
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.cached[block] = None
                else:
                    self.free.append(block)
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
            if key not in self.hash_to_block and self.block_hash[block] is None:
                self.hash_to_block[key] = block
                self.block_hash[block] = key
                self.evicted_hashes.discard(key)

    # ---- invariants -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is in exactly one consistent state."""
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free), "a page is twice on the free list"
        assert not free & cached, "a page is both free and cached"
        for block, count in enumerate(self.ref_counts):
            assert count >= 0, f"page {block} has a negative reference count"
            in_use = count > 0
            assert in_use + (block in free) + (block in cached) == 1, f"page {block} has no single state"
            if block in free:
                assert self.block_hash[block] is None, f"free page {block} still has a key"
            if block in cached:
                assert self.block_hash[block] is not None, f"cached page {block} has no key"
        for key, block in self.hash_to_block.items():
            assert self.block_hash[block] == key, f"prefix cache maps a key to page {block} which holds another"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)

    def check_idle(self) -> None:
        """After all requests ended: invariants hold and no page is held by anyone."""
        self.check_invariants()
        held = [b for b, c in enumerate(self.ref_counts) if c]
        assert not held, f"pages still held after all requests ended: {held[:16]}"
