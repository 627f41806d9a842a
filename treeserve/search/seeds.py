"""Seeds for search: sampled text depends only on (run seed, problem, beam lineage, position).

A beam's lineage is the path of copy indices from its root (root j has path (j,); copy c of
a beam with path p has path p + (c,)). Trailing zeros are dropped before hashing, so copy 0
of a beam continues its parent's random stream: the text a beam would decode past a step
boundary (decode-ahead) is exactly what its copy 0 would generate next.
The sampler adds the completion index and the absolute position to this seed. Particle
filtering's resampling draws come from `resample_seed` (run seed, problem, iteration).
"""

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
