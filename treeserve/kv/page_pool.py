"""The state of every page of one arena, shared by all the models that use it.

Every page is in exactly one state:
- in use: reference count > 0 (held by one or more block tables of one model; shared pages
  are copy-on-write);
- cached: count 0 but its content is keyed in the prefix cache; reusable by a later
  sequence with the same prefix until evicted (least recently released first);
- free: count 0, content meaningless: never handed out yet, or on the free list of the model
  that released it last.

The free pages and one LRU of cached pages serve every model of the arena, so pages flow to
whichever model needs them: a page one model cached can be evicted for another. A model takes
back the free page it released last first (its own, still in the CPU's caches, no hand-over),
then a page never handed out, then another model's free page, then evicts: on a CPU the arena
is an untouched mapping whose every first write to a 2 MiB page makes the kernel zero it (~2.5
ms each on the 2-core VM), and a first-in first-out free list walked the whole arena, so a
fresh server paid for zeroing all of it in its first minutes of steps. Keys are
salted per model (see `block_manager.py`), so one key map serves all models. Each page in
use or cached has an owner (the model index from `register`); the pool keeps per-owner
counts so per-model statistics cost O(1). A page that changes owner is a hand-over: the new
owner's next step must not start before the old owner's steps that may still use the page
(on a GPU, steps of two models can run on two streams); the pool records which owners handed
pages to whom (`take_handovers`) and the engine fences its device queue on them. This module
knows page numbers and keys, nothing about tokens or tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class CacheStats:
    """One model's prefix-cache counters (cumulative)."""

    hits: int = 0  # full blocks found in the prefix cache
    misses: int = 0  # full blocks looked up and not found
    evictions: int = 0  # this model's cached pages reclaimed for new content (by any model)
    thrash: int = 0  # misses on a key that was cached before and evicted

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class NoFreePages(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError("the KV memory budget is smaller than one page")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.shared_pages = 0  # pages with more than one owner (none: no write needs a copy first)
        self.owner = [-1] * num_pages  # model index while in use or cached, -1 when free
        self.released_by = [-1] * num_pages  # a free page's last owner (-1: never owned)
        self.block_hash: list[int | None] = [None] * num_pages
        self.untouched = list(range(num_pages - 1, -1, -1))  # never handed out, page 0 first
        self.free_by: list[list[int]] = []  # per owner: the free pages it released, the latest last
        self.cached: OrderedDict[int, None] = OrderedDict()  # count-0 keyed pages, LRU first
        self.hash_to_block: dict[int, int] = {}
        self.evicted_hashes: set[int] = set()
        self.stats: list[CacheStats] = []  # per owner
        self.in_use: list[int] = []  # per owner: pages with count > 0
        self.num_cached: list[int] = []  # per owner: cached pages
        # owners whose next waiting sequence did not fit, first come first: while one waits,
        # the others only run what they already hold, so pages flow to it as they are released
        self.starving: dict[int, None] = {}
        self.handovers: list[set[int]] = []  # per owner: owners it took pages from since it last asked

    def register(self) -> int:
        """A new model on this pool; returns its owner index."""
        self.stats.append(CacheStats())
        self.in_use.append(0)
        self.num_cached.append(0)
        self.handovers.append(set())
        self.free_by.append([])
        return len(self.stats) - 1

    def take_handovers(self, owner: int) -> set[int]:
        """The owners `owner` took pages from since the last call (and forget them)."""
        handed = self.handovers[owner]
        if handed:
            self.handovers[owner] = set()
        return handed

    def may_admit(self, owner: int) -> bool:
        """Whether `owner` may take pages for new sequences now (no other model waits first)."""
        return not self.starving or next(iter(self.starving)) == owner

    def set_starving(self, owner: int, starving: bool) -> None:
        if starving:
            self.starving.setdefault(owner, None)
        else:
            self.starving.pop(owner, None)

    @property
    def shared(self) -> bool:
        return len(self.stats) > 1

    @property
    def num_available(self) -> int:
        """Pages that can be handed out now (free, or cached and evictable)."""
        return self.num_free + len(self.cached)

    @property
    def num_free(self) -> int:
        return len(self.untouched) + sum(map(len, self.free_by))

    # ---- page state transitions --------------------------------------------------------
    def take(self, owner: int) -> int:
        """A page for `owner` with count 1: a free one (its own latest, a page never handed out, another
        model's), else the least recently cached one."""
        pages = self.free_by[owner] or self.untouched or max(self.free_by, key=len)
        if pages:
            block = pages.pop()
            previous = self.released_by[block]
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            previous = self.owner[block]
            key = self.block_hash[block]
            del self.hash_to_block[key]
            self.block_hash[block] = None
            self.evicted_hashes.add(key)
            self.num_cached[self.owner[block]] -= 1
            self.stats[self.owner[block]].evictions += 1
        else:
            raise NoFreePages("no free KV pages")
        if previous != owner and previous >= 0:
            self.handovers[owner].add(previous)
        self.ref_counts[block] = 1
        self.owner[block] = owner
        self.in_use[owner] += 1
        return block

    def acquire(self, block: int) -> None:
        """One more owner of a page in use or cached (a prefix-cache hit, a fork)."""
        if self.ref_counts[block] == 0:
            self.cached.pop(block)
            self.num_cached[self.owner[block]] -= 1
            self.in_use[self.owner[block]] += 1
        self.ref_counts[block] += 1
        self.shared_pages += self.ref_counts[block] == 2

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        count = self.ref_counts[block]
        self.shared_pages -= count == 1
        if count < 0:
            raise AssertionError(f"page {block} released more often than acquired")
        if count == 0:
            owner = self.owner[block]
            self.in_use[owner] -= 1
            if self.block_hash[block] is not None:
                self.cached[block] = None
                self.num_cached[owner] += 1
            else:
                self.free_by[owner].append(block)
                self.released_by[block] = owner
                self.owner[block] = -1

    def key(self, block: int, key: int) -> None:
        """Enter an in-use page in the prefix cache under `key` (first writer wins)."""
        if key not in self.hash_to_block and self.block_hash[block] is None:
            self.hash_to_block[key] = block
            self.block_hash[block] = key
            self.evicted_hashes.discard(key)

    # ---- invariants -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError unless every page is in exactly one consistent state."""
        free, cached = set(self.untouched).union(*self.free_by), set(self.cached)
        assert len(free) == self.num_free, "a page is twice on the free lists"
        assert not free & cached, "a page is both free and cached"
        in_use = [0] * len(self.stats)
        num_cached = [0] * len(self.stats)
        for block, count in enumerate(self.ref_counts):
            assert count >= 0, f"page {block} has a negative reference count"
            assert (count > 0) + (block in free) + (block in cached) == 1, f"page {block} has no single state"
            if block in free:
                assert self.block_hash[block] is None, f"free page {block} still has a key"
                assert self.owner[block] == -1, f"free page {block} still has an owner"
                continue
            assert 0 <= self.owner[block] < len(self.stats), f"page {block} has no owner"
            if block in cached:
                assert self.block_hash[block] is not None, f"cached page {block} has no key"
                num_cached[self.owner[block]] += 1
            else:
                in_use[self.owner[block]] += 1
        assert in_use == self.in_use, f"pages in use per model {self.in_use}, counted {in_use}"
        shared = sum(count > 1 for count in self.ref_counts)
        assert shared == self.shared_pages, f"{self.shared_pages} pages counted as shared, {shared} are"
        assert num_cached == self.num_cached, f"cached pages per model {self.num_cached}, counted {num_cached}"
        for key, block in self.hash_to_block.items():
            assert self.block_hash[block] == key, f"prefix cache maps a key to page {block} which holds another"
        assert sum(h is not None for h in self.block_hash) == len(self.hash_to_block)
