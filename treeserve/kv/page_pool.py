"""The state of every page of one arena, shared by the models that use it; page numbers and
keys only, nothing about tokens or tensors.

A page is in use (count > 0, copy-on-write when shared), cached (count 0, keyed, evicted LRU
first) or free. Free pages and the LRU serve every model (keys are salted per model). A model
takes back its own latest free page first, then an untouched one, then another model's, then
evicts: untouched CPU pages cost a kernel zeroing on first write. A page changing owner is a
hand-over (`take_handovers`): the engine fences its device queue on the old owner's steps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class CacheStats:
    """One model's cumulative prefix-cache counters, in full pages."""

    hits: int = 0
    tail_hits: int = 0  # part-written last pages read instead of recomputed (not counted in hits)
    misses: int = 0
    evictions: int = 0  # by any model
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
        self.shared_pages = 0  # pages with count > 1 (0: no write needs a copy)
        self.owner = [-1] * num_pages  # model index while in use or cached, -1 when free
        self.released_by = [-1] * num_pages  # a free page's last owner (-1: never owned)
        self.page_hash: list[int | None] = [None] * num_pages
        self.untouched = list(range(num_pages - 1, -1, -1))  # page 0 popped first
        # per owner below
        self.free_by: list[list[int]] = []  # latest released last
        self.cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.hash_to_page: dict[int, int] = {}
        self.evicted_hashes: set[int] = set()
        self.stats: list[CacheStats] = []
        self.in_use: list[int] = []
        self.num_cached: list[int] = []
        # owners whose next sequence did not fit, in order; the others admit nothing new meanwhile
        self.starving: dict[int, None] = {}
        self.handovers: list[set[int]] = []  # owners it took pages from since it last asked

    def register(self) -> int:
        self.stats.append(CacheStats())
        self.in_use.append(0)
        self.num_cached.append(0)
        self.handovers.append(set())
        self.free_by.append([])
        return len(self.stats) - 1

    def take_handovers(self, owner: int) -> set[int]:
        handed = self.handovers[owner]
        if handed:
            self.handovers[owner] = set()
        return handed

    def may_admit(self, owner: int) -> bool:
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
        return self.num_free + len(self.cached)

    @property
    def num_free(self) -> int:
        return len(self.untouched) + sum(map(len, self.free_by))

    # ---- page state transitions --------------------------------------------------------
    def take(self, owner: int) -> int:
        pages = self.free_by[owner] or self.untouched or max(self.free_by, key=len)
        if pages:
            page = pages.pop()
            previous = self.released_by[page]
        elif self.cached:
            page, _ = self.cached.popitem(last=False)
            previous = self.owner[page]
            key = self.page_hash[page]
            del self.hash_to_page[key]
            self.page_hash[page] = None
            self.evicted_hashes.add(key)
            self.num_cached[self.owner[page]] -= 1
            self.stats[self.owner[page]].evictions += 1
        else:
            raise NoFreePages("no free KV pages")
        if previous != owner and previous >= 0:
            self.handovers[owner].add(previous)
        self.ref_counts[page] = 1
        self.owner[page] = owner
        self.in_use[owner] += 1
        return page

    def acquire(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            self.cached.pop(page)
            self.num_cached[self.owner[page]] -= 1
            self.in_use[self.owner[page]] += 1
        self.ref_counts[page] += 1
        self.shared_pages += self.ref_counts[page] == 2

    def release(self, page: int) -> None:
        self.ref_counts[page] -= 1
        count = self.ref_counts[page]
        self.shared_pages -= count == 1
        if count < 0:
            raise AssertionError(f"page {page} released more often than acquired")
        if count == 0:
            owner = self.owner[page]
            self.in_use[owner] -= 1
            if self.page_hash[page] is not None:
                self.cached[page] = None
                self.num_cached[owner] += 1
            else:
                self.free_by[owner].append(page)
                self.released_by[page] = owner
                self.owner[page] = -1

    def key(self, page: int, key: int) -> None:
        """Key an in-use page in the prefix cache (first writer wins)."""
        if key not in self.hash_to_page and self.page_hash[page] is None:
            self.hash_to_page[key] = page
            self.page_hash[page] = key
            self.evicted_hashes.discard(key)

    def check_invariants(self) -> None:
        free, cached = set(self.untouched).union(*self.free_by), set(self.cached)
        assert len(free) == self.num_free, "a page is twice on the free lists"
        assert not free & cached, "a page is both free and cached"
        in_use = [0] * len(self.stats)
        num_cached = [0] * len(self.stats)
        for page, count in enumerate(self.ref_counts):
            assert count >= 0, f"page {page} has a negative reference count"
            assert (count > 0) + (page in free) + (page in cached) == 1, f"page {page} has no single state"
            if page in free:
                assert self.page_hash[page] is None, f"free page {page} still has a key"
                assert self.owner[page] == -1, f"free page {page} still has an owner"
                continue
            assert 0 <= self.owner[page] < len(self.stats), f"page {page} has no owner"
            if page in cached:
                assert self.page_hash[page] is not None, f"cached page {page} has no key"
                num_cached[self.owner[page]] += 1
            else:
                in_use[self.owner[page]] += 1
        assert in_use == self.in_use, f"pages in use per model {self.in_use}, counted {in_use}"
        shared = sum(count > 1 for count in self.ref_counts)
        assert shared == self.shared_pages, f"{self.shared_pages} pages counted as shared, {shared} are"
        assert num_cached == self.num_cached, f"cached pages per model {self.num_cached}, counted {num_cached}"
        for key, page in self.hash_to_page.items():
            assert self.page_hash[page] == key, f"prefix cache maps a key to page {page} which holds another"
        assert sum(h is not None for h in self.page_hash) == len(self.hash_to_page)
