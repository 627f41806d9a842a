"""Counts the distinct tokens of a family of inputs: the nodes of their prefix trie."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TreeTokens:
    seen: set[int] = field(default_factory=set)

    def add(self, token_ids: list[int]) -> None:
        h = 0
        for token in token_ids:
            h = hash((h, token))
            self.seen.add(h)

    def __len__(self) -> int:
        return len(self.seen)
