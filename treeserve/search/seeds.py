"""Seeds for search: sampled text depends only on (run seed, problem, beam lineage, position).
Trailing zeros of a lineage are dropped, so copy 0 continues its parent's stream (decode-ahead)."""

from __future__ import annotations

import xxhash


def lineage_seed(run_seed: int, problem_id: str, path: tuple[int, ...]) -> int:
    while path and path[-1] == 0:
        path = path[:-1]
    key = f"{run_seed}|{problem_id}|{','.join(map(str, path))}"
    return xxhash.xxh3_64_intdigest(key.encode()) & ((1 << 63) - 1)


def resample_seed(run_seed: int, problem_id: str, iteration: int) -> int:
    """The seed of particle filtering's resampling draws after `iteration` of one problem."""
    return xxhash.xxh3_64_intdigest(f"{run_seed}|{problem_id}|resample|{iteration}".encode())
