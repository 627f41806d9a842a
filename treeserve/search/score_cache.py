"""The score cache: (question, step prefix) -> PRM score of that prefix's last step.
Keys chain xxhash over the steps; `shared` lets concurrent asks for one prefix share a read."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
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


async def shared(
    in_flight: dict[int, asyncio.Future], key: int, read: Callable[[], Awaitable[list[float]]]
) -> tuple[list[float], bool]:
    """`read()`'s scores, and True when another caller's read under `key` served them. A read
    cancelled with its caller leaves the others to read for themselves; an error reaches all."""
    pending = in_flight.get(key)
    if pending is not None:
        try:
            return list(await asyncio.shield(pending)), True
        except asyncio.CancelledError:
            if not pending.cancelled():
                raise  # this caller was cancelled
            # the read it waited on was cancelled with its own caller: read here
    future: asyncio.Future = asyncio.get_running_loop().create_future()
    in_flight[key] = future
    try:
        scores = await read()
    except asyncio.CancelledError:
        future.cancel()
        raise
    except Exception as e:
        future.set_exception(e)
        future.exception()  # retrieved: waiters re-raise it, and nobody else needs to
        raise
    finally:
        in_flight.pop(key, None)
    future.set_result(scores)
    return scores, False
