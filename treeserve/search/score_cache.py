"""The score cache: (question, step prefix) -> PRM score of that prefix's last step.

A step's score depends only on the question and the steps up to it, so a beam that
survives an iteration never has its earlier steps re-scored, and beams that share a
prefix share its scores. Keys chain hashes of the steps (xxhash), so lookups cost one
hash per step, not the text of the whole prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash


def prefix_keys(question: str, steps: list[str]) -> list[int]:
    keys = []
    h = xxhash.xxh3_64_intdigest(question.encode())
    for step in steps:
        h = xxhash.xxh3_64_intdigest(step.encode(), seed=h)
        keys.append(h)
    return keys


@dataclass
class ScoreCache:
    scores: dict[int, float] = field(default_factory=dict)
    hits: int = 0  # steps whose score came from the cache
    misses: int = 0  # steps that had to be scored

    def known(self, keys: list[int]) -> list[float]:
        """Scores of the longest cached leading run of `keys`."""
        found = []
        for key in keys:
            if key not in self.scores:
                break
            found.append(self.scores[key])
        self.hits += len(found)
        self.misses += len(keys) - len(found)
        return found

    def store(self, keys: list[int], scores: list[float]) -> None:
        self.scores.update(zip(keys, scores, strict=True))
