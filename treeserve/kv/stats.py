"""Per-step page statistics of one model: a row of O(1) pool counters after every engine step,
the newest `max_rows` kept; cheap enough to leave on."""

from __future__ import annotations

import time
from collections import deque

from treeserve.kv.page_manager import PageManager

COLUMNS = ("step", "time_s", "in_use", "cached", "free", "hits", "misses", "evictions", "thrash")


class PageLog:
    def __init__(self, pages: PageManager, max_rows: int = 200_000):
        self.pages = pages
        self.start = time.perf_counter()
        self.steps = 0
        self._rows: deque[tuple] = deque(maxlen=max_rows)

    def record(self) -> None:
        b, pool, stats = self.pages, self.pages.pool, self.pages.stats
        self.steps += 1
        self._rows.append(
            (
                self.steps,
                time.perf_counter() - self.start,
                pool.in_use[b.owner],
                pool.num_cached[b.owner],
                pool.num_free,
                stats.hits,
                stats.misses,
                stats.evictions,
                stats.thrash,
            )
        )

    def rows(self) -> list[dict]:
        return [dict(zip(COLUMNS, row, strict=True)) for row in self._rows]
