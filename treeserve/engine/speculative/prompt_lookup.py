"""Prompt lookup: drafts read from text already seen, and one sequence's drafting state.

Tokens are characters here (code point = token id), so an n-gram lookup is `str.rfind`.
"""

from __future__ import annotations

from dataclasses import dataclass

SEPARATOR = chr(0x10FFFF)  # between the sequences of a group (no vocabulary is that large): no n-gram spans two
MAX_PAUSE_STEPS = 64


@dataclass
class DraftState:
    k: int
    text: str = ""
    misses: int = 0  # verifications in a row that accepted nothing
    paused_until: int = 0  # engine step before which this sequence drafts nothing

    def sync(self, token_ids: list[int]) -> str:
        if len(self.text) < len(token_ids):
            self.text += "".join(map(chr, token_ids[len(self.text) :]))
        return self.text

    def adapt(self, drafted: int, accepted: int, limit: int, step: int) -> None:
        """Some accepted -> one more than that; none, twice or more -> pause 2, 4, ... 64 steps, then 1."""
        if accepted == drafted:
            self.k, self.misses = min(limit, drafted + 1), 0
        elif accepted:
            self.k, self.misses = min(limit, accepted + 1), 0
        else:
            self.misses += 1
            self.k = 1
            if self.misses >= 2:
                self.paused_until = step + min(MAX_PAUSE_STEPS, 1 << (self.misses - 1))


def lookup(corpus: str, own_end: int, suffix: str, k: int) -> list[int]:
    """Up to `k` tokens after the latest occurrence of `suffix` in `corpus` that has a continuation."""
    end = len(corpus)
    while (at := corpus.rfind(suffix, 0, end)) >= 0:
        start = at + len(suffix)
        tail = corpus[start : start + k].split(SEPARATOR, 1)[0] if start != own_end else ""
        if tail:
            return [ord(c) for c in tail]
        end = start - 1
    return []


def propose_lookup(corpus: str, own_end: int, tokens: str, k: int, n_min: int, n_max: int) -> list[int]:
    """The draft after the longest suffix n-gram (n_max down to n_min) of `tokens` found in `corpus`."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        draft = lookup(corpus, own_end, tokens[len(tokens) - n :], k)
        if draft:
            return draft
    return []
