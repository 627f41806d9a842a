"""`POST /v1/prm/score`: the server's PRM as a service for search loops that run elsewhere.
A step's score depends only on the question and the steps up to it, so cached prefixes are not
read again, the rest read with `start=` over prefix-cached pages, and concurrent requests for the
same steps share one PRM request (`ServedScores`, LRU). A batch's first error cancels the rest.
"""

from __future__ import annotations

import asyncio
import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from treeserve.search.context import gather_or_cancel
from treeserve.search.prm.base import PRM
from treeserve.search.score_cache import ScoreCache, prefix_keys, shared
from treeserve.server.completions import ModelNotFound
from treeserve.server.protocol import PRMScoreRequest, new_id, now

if TYPE_CHECKING:
    from treeserve.server.completions import Served

SCORE_CACHE_ENTRIES = 1 << 17  # prefix scores the server keeps (LRU): ~131k steps, ~20 MB
PRM_ENGINE = "prm"


@dataclass
class LRUScores(ScoreCache):
    capacity: int = SCORE_CACHE_ENTRIES
    scores: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def known(self, keys: list[int]) -> list[float]:
        found = super().known(keys)
        self._touch(keys[: len(found)])
        return found

    def store(self, keys: list[int], scores: list[float]) -> None:
        super().store(keys, scores)
        self._touch(keys)
        while len(self.scores) > self.capacity:
            self.scores.popitem(last=False)

    def _touch(self, keys: list[int]) -> None:
        for key in reversed(keys):  # a chain loses its tail first
            self.scores.move_to_end(key)


@dataclass
class RequestUsage:
    prompt_tokens: int = 0
    cached_steps: int = 0  # answered by the cache or a shared request


@dataclass
class ServedScores:
    prm: PRM
    cache: LRUScores = field(default_factory=LRUScores)
    in_flight: dict[int, asyncio.Future] = field(default_factory=dict)  # prefix key -> scores being read

    async def score(self, question: str, steps: list[str], usage: RequestUsage) -> list[float]:
        keys = prefix_keys(question, steps)
        known = self.cache.known(keys)
        if len(known) == len(steps):
            usage.cached_steps += len(steps)
            return known

        async def read() -> list[float]:
            scores = known + await self._read(question, steps, len(known), usage)
            usage.cached_steps += len(known)
            self.cache.store(keys, scores)
            return scores

        scores, was_shared = await shared(self.in_flight, keys[-1], read)
        if was_shared:
            usage.cached_steps += len(steps)
        return scores

    async def _read(self, question: str, steps: list[str], start: int, usage: RequestUsage) -> list[float]:
        prm = copy.copy(self.prm)

        def built(ids: list[int]) -> None:
            usage.prompt_tokens += len(ids)

        prm.on_input = built
        return await prm.score(question, steps, start=start)


def _solutions(req: PRMScoreRequest) -> list[tuple[str, list[str]]]:
    if req.steps is not None:
        return [("steps", req.steps)]
    return [(f"solutions[{i}]", steps) for i, steps in enumerate(req.solutions or [])]


def check_request(served: Served, req: PRMScoreRequest) -> None:
    """ValueError (a 400) or ModelNotFound (a 404) for a request that cannot be scored, before any work."""
    if served.prm_name is None:
        raise ValueError("this server has no PRM to score steps with: start it with --prm DIR")
    if req.model is not None and req.model != served.prm_name:
        if req.model in (served.model_name, served.verifier_name):
            raise ValueError(f"model: `{req.model}` is not a PRM; /v1/prm/score scores with `{served.prm_name}`")
        raise ModelNotFound(f"The model `{req.model}` does not exist; this server's PRM is `{served.prm_name}`.")
    if not req.question.strip():
        raise ValueError("question must not be empty")
    if (req.steps is None) == (req.solutions is None):
        raise ValueError("give exactly one of 'steps' (one solution's steps) or 'solutions' (a list of them)")
    engine = served.runtime.engine(PRM_ENGINE)
    for where, steps in _solutions(req):
        if len(steps) >= engine.max_model_len:  # each step ends with at least one token (its tag)
            raise ValueError(
                f"{where}: {len(steps)} steps cannot fit in the PRM's context of {engine.max_model_len} tokens"
            )
        try:
            engine.check_text_length(req.question + "".join(steps))  # before tokenising megabytes
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


async def _scored(
    scores: ServedScores, question: str, where: str, steps: list[str], usage: RequestUsage
) -> list[float]:
    try:
        return await scores.score(question, steps, usage)
    except ValueError as e:  # PRMInputTooLong, or a step the PRM's format cannot hold
        raise ValueError(f"{where}: {e}") from e


async def score_request(served: Served, scores: ServedScores, req: PRMScoreRequest) -> dict:
    usage = RequestUsage()
    solutions = [_scored(scores, req.question, where, steps, usage) for where, steps in _solutions(req)]
    result = await gather_or_cancel(*solutions)
    return {
        "id": new_id("prmscore"),
        "object": "prm.score",
        "created": now(),
        "model": served.prm_name,
        "scores": result[0] if req.steps is not None else result,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": 0,
            "total_tokens": usage.prompt_tokens,
            "cached_steps": usage.cached_steps,
        },
    }
