"""`/v1/search`: one problem, one strategy, over the server's generator and PRM.

A request becomes a `SearchConfig` (protocol.search_config) and a `SearchContext` over the
shared runtime. Answers are chosen as `treeserve eval` chooses. With `deadline_s` the search
answers from the scored beams it held at the deadline.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import time
from collections.abc import AsyncIterator

from treeserve.eval.grading import extract_answer
from treeserve.eval.metrics import DEFAULT_SELECTION, SELECTIONS, ScoredCompletion, aggregate_scores, select
from treeserve.runtime.runtime import StepFailed
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.run import STRATEGY_FUNCTIONS
from treeserve.search.types import Beam, Problem, aggregate
from treeserve.server.completions import Served
from treeserve.server.protocol import SearchRequest, error_body, new_id, now, search_config

clock = time.monotonic  # tests swap it


class SearchDeadline(ValueError):
    """`deadline_s` passed before the first scored iteration: a 400 (the input left no answer)."""

    def __init__(self, seconds: float):
        super().__init__(
            f"deadline_s={seconds:g} passed before the search scored its first iteration, so there is no answer "
            "to give: allow more time (best_of_n and majority score only at their end)"
        )


def answer_key(problem: Problem, text: str) -> str | None:
    """The answer as the response reports and groups it: the last `\\boxed{}`, stripped."""
    return extract_answer(text)


def reasoning_answer_key(problem: Problem, text: str) -> str | None:
    return extract_answer(text, reasoning=True)


def search_context(served: Served, req: SearchRequest) -> tuple[SearchContext, Problem]:
    """The context and the problem of one request; ValueError before any work starts."""
    served.check_model(req.model)
    if (req.problem is None) == (req.messages is None):
        raise ValueError("give exactly one of 'problem' or 'messages'")
    config = search_config(req)
    if req.deadline_s is not None and not (math.isfinite(req.deadline_s) and req.deadline_s > 0):
        raise ValueError(f"deadline_s must be a finite number of seconds > 0, got {req.deadline_s!r}")
    prm = None
    if config.strategy != "majority":
        if served.prm is None:
            raise ValueError(f"strategy {config.strategy!r} needs a PRM; start the server with --prm DIR")
        prm = copy.copy(served.prm)
    if req.verify and served.verifier is None:
        raise ValueError(
            "verify: true needs a verifier, and this server has none: start it with --verifier DIR "
            "(an outcome reward model), or leave verify out"
        )
    verify = served.verifier is not None if req.verify is None else req.verify
    verifier = copy.copy(served.verifier) if verify else None
    ctx = SearchContext(
        config,
        served.runtime,
        served.generator,
        prm,
        verifier=verifier,
        answer_of=reasoning_answer_key if config.reasoning else answer_key,
    )
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            raise ValueError("messages need a user turn (the question the PRM judges steps against)")
        problem = ctx.problem(users[-1], users[-1], messages)
    else:
        if not req.problem.strip():
            raise ValueError("problem must not be empty")
        problem = ctx.problem(req.problem, req.problem)
    limit = served.max_model_len
    if len(problem.prompt_ids) + 1 >= limit:
        raise ValueError(
            f"the problem's prompt ({len(problem.prompt_ids)} tokens) leaves no room within "
            f"the context of {limit} tokens"
        )
    return ctx, problem


class HeldBeams:
    """The scored beams a search holds as its iterations report, and whether its deadline passed:
    beam search's newest beams plus every finished one, DVTS's newest per subtree."""

    def __init__(self, config: SearchConfig, seconds: float):
        self.config = config
        self.per_subtree = config.strategy == "dvts"
        self.seconds = seconds
        self.start = clock()
        self.expired = asyncio.Event()
        self.iteration: int | None = None
        self.newest: dict[int, list[Beam]] = {}  # subtree (0: the whole search) -> newest scored beams
        self.finished: dict[tuple[int, ...], Beam] = {}  # beam search: every ended beam, by path

    def saw(self, iteration: int, beams: list[Beam]) -> None:
        if beams:
            self.iteration = iteration if self.iteration is None else max(self.iteration, iteration)
            self.newest[beams[0].path[0] if self.per_subtree else 0] = list(beams)
        if not self.per_subtree:
            self.finished |= {b.path: b for b in beams if b.completed}
        if clock() - self.start >= self.seconds:
            self.expired.set()

    def beams(self) -> list[Beam]:
        newest = [b for key in sorted(self.newest) for b in self.newest[key]]
        if self.per_subtree:
            return newest
        paths = {b.path for b in newest}
        beams = [b for path, b in self.finished.items() if path not in paths] + newest
        beams.sort(key=lambda b: -aggregate(b.scores, self.config.agg))  # stable
        return beams[: self.config.n]


async def _until_deadline(ctx: SearchContext, problem: Problem, seconds: float) -> list[Beam]:
    """The strategy's beams, or after `seconds` the scored beams held then (the search cancelled);
    SearchDeadline when none."""
    held = HeldBeams(ctx.config, seconds)
    progress = ctx.traces.on_iteration

    def saw(iteration: int, beams: list[Beam]) -> None:
        held.saw(iteration, beams)
        if progress is not None:
            progress(iteration, beams)

    ctx.traces.on_iteration = saw
    search = asyncio.ensure_future(STRATEGY_FUNCTIONS[ctx.config.strategy](ctx, problem))
    expired = asyncio.ensure_future(held.expired.wait())
    try:
        await asyncio.wait({search, expired}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:  # deadline or client gone: stop the search, freeing its pages
        search.cancel()
        expired.cancel()
        await asyncio.gather(search, expired, return_exceptions=True)
    if not search.cancelled():
        return search.result()
    beams = held.beams()
    if not beams:
        raise SearchDeadline(seconds)
    problem.stop = (problem.stop or {}) | {"iteration": held.iteration, "reason": "deadline", "deadline_s": seconds}
    return beams


async def run_search(served: Served, req: SearchRequest, ctx: SearchContext, problem: Problem) -> dict:
    start = time.perf_counter()
    try:
        if req.deadline_s is None:
            beams = await STRATEGY_FUNCTIONS[ctx.config.strategy](ctx, problem)
        else:
            beams = await _until_deadline(ctx, problem, req.deadline_s)
    finally:
        ctx.forget(problem)
    seconds = time.perf_counter() - start
    served.metrics.search_seconds.labels(ctx.config.strategy).observe(seconds)
    result = _result(served, req, ctx, len(problem.prompt_ids), beams, seconds)
    result["stop"] = problem.stop
    result["spent"] = problem.spent
    if req.trace:
        result["trace"] = ctx.traces.take(problem, beams, seconds)
        result["problem"] = problem.question
    return result


def _result(
    served: Served, req: SearchRequest, ctx: SearchContext, prompt_tokens: int, beams: list[Beam], seconds: float
) -> dict:
    config = ctx.config
    scored = [
        ScoredCompletion(b.text, extract_answer(b.text, config.reasoning), b.scores, correct=False) for b in beams
    ]
    method = req.selection or DEFAULT_SELECTION[config.strategy]
    picks = {rule: select(scored, rule, config.agg) for rule in SELECTIONS}
    chosen = picks[method]
    completions = [
        {
            "index": i,
            "text": b.text,
            "steps": b.steps,
            "step_scores": b.scores,
            "score": aggregate_scores(b.scores, config.agg),
            "answer": s.answer,
            "generated_tokens": b.generated_tokens,
        }
        for i, (b, s) in enumerate(zip(beams, scored, strict=True))
    ]
    return {
        "id": new_id("search"),
        "object": "search",
        "created": now(),
        "model": served.model_name,
        "strategy": config.strategy,
        "selection": method,
        "agg": config.agg,
        "verified": ctx.verifier is not None,
        "answer": None if chosen is None else scored[chosen].answer,
        "chosen_index": chosen,
        "answers_by_rule": {rule: None if i is None else scored[i].answer for rule, i in picks.items()},
        "completions": completions,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "generator_tokens": ctx.generated_tokens,
            "prm_tokens": ctx.prm_input_tokens,
            "prm_unique_tokens": len(ctx.prm_tree),
            "prm_requests": ctx.prm_requests,
            "verifier_tokens": ctx.verifier_input_tokens,
            "lookahead_generator_tokens": ctx.lookahead_generated_tokens,
            "lookahead_prm_tokens": ctx.lookahead_prm_tokens,
        },
        "timing": {"seconds": seconds},
    }


async def stream_search(served: Served, req: SearchRequest, ctx: SearchContext, problem: Problem) -> AsyncIterator[str]:
    events: asyncio.Queue = asyncio.Queue()
    start = time.perf_counter()

    def progress(iteration: int, beams: list[Beam]) -> None:
        scores = [aggregate_scores(b.scores, ctx.config.agg) for b in beams]
        events.put_nowait(
            {
                "object": "search.progress",
                "iteration": iteration,
                "beams": len(beams),
                "completed": sum(b.completed for b in beams),
                "best_score": max(scores, default=None),
                "generator_tokens": ctx.generated_tokens,
                "elapsed_s": time.perf_counter() - start,
            }
        )

    ctx.traces.on_iteration = progress
    task = asyncio.create_task(run_search(served, req, ctx, problem))
    task.add_done_callback(lambda _: events.put_nowait(None))
    try:
        while (event := await events.get()) is not None:
            yield f"data: {json.dumps(event)}\n\n"
        try:
            result = task.result()
        except ValueError as e:  # found while searching (SearchDeadline too)
            result = error_body(400, str(e))
        except StepFailed as e:
            result = error_body(500, str(e))
        yield f"data: {json.dumps(result)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
