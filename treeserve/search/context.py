"""The primitives strategies are written in: `expand`, `score`, `score_beam`, `verify`.
`SearchContext` holds a run's runtime, PRM, caches and counters, its `Budget` and `Traces`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field

from treeserve.outputs import CompletionOutput
from treeserve.runtime.runtime import Runtime
from treeserve.sampling_params import SamplingParams
from treeserve.search.budget import Budget
from treeserve.search.config import SearchConfig
from treeserve.search.prm.base import PRM, PRMInputTooLong
from treeserve.search.reasoning import check_generator, prm_view, spread
from treeserve.search.score_cache import ScoreCache, prefix_keys, shared
from treeserve.search.seeds import lineage_seed
from treeserve.search.trace import Traces
from treeserve.search.tree_tokens import TreeTokens
from treeserve.search.types import STEP_STOP, Beam, Leftover, Problem, aggregate


async def gather_or_cancel(*aws: Awaitable) -> list:
    """`asyncio.gather`, but one failure cancels the others (aborting their requests)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclass
class SearchContext:
    config: SearchConfig
    runtime: Runtime
    generator: str
    prm: PRM | None
    verifier: PRM | None = None
    cache: ScoreCache = field(default_factory=ScoreCache)
    prm_tree: TreeTokens = field(default_factory=TreeTokens)  # distinct tokens the PRM was shown
    in_flight: dict[int, asyncio.Future] = field(default_factory=dict)  # prefix key -> scores being computed
    rollouts: dict[tuple[int, ...], asyncio.Future] = field(default_factory=dict)  # prompt -> rollout running
    # every token sampled (kept or pruned), and of every PRM input built (cached or not)
    prm_requests: int = 0
    prm_too_long: int = 0
    generated_tokens: int = 0
    prm_input_tokens: int = 0
    verifier_input_tokens: int = 0
    lookahead_generated_tokens: int = 0  # of generated_tokens
    lookahead_prm_tokens: int = 0  # of prm_input_tokens
    # adaptive search: a completion's answer key (equal keys: the same answer; None: no answer)
    answer_of: Callable[[Problem, str], Hashable | None] | None = None
    budget: Budget = field(init=False)
    traces: Traces = field(init=False)

    def __post_init__(self) -> None:
        self.budget = Budget(self.config, lambda: self.spent_tokens)
        self.traces = Traces(self.config)
        if self.verifier is not None and not self.verifier.outcome:
            raise ValueError(
                f"the verifier re-scores whole solutions: it must be an outcome reward model "
                f"(style orm), got style {self.verifier.style!r}"
            )
        if self.config.reasoning:
            check_generator(self.runtime.tokenizer(self.generator))
        if self.config.adaptive and self.answer_of is None:
            raise ValueError(
                "adaptive search needs an answer rule (SearchContext.answer_of) to tell when answers agree"
            )

    @property
    def spent_tokens(self) -> int:
        return self.generated_tokens + self.prm_input_tokens

    def _saw_prm_input(self, problem: Problem, ids: list[int]) -> None:
        self.prm_tree.add(ids)
        self.prm_input_tokens += len(ids)
        problem.prm_tokens += len(ids)

    def _saw_verifier_input(self, ids: list[int]) -> None:
        self.verifier_input_tokens += len(ids)

    def answers(self, problem: Problem, beams: list[Beam]) -> list[Hashable | None]:
        return [self.answer_of(problem, b.text) for b in beams]

    def problem(self, uid: str, question: str, messages: list[dict] | None = None) -> Problem:
        """The generator's prompt for `question`, or for `messages` whose last user turn is `question`."""
        tokenizer = self.runtime.tokenizer(self.generator)
        if self.config.prompt_format is not None:
            if messages is not None:
                raise ValueError("prompt_format takes a question, not a conversation: send the question alone")
            text = self.config.prompt_format.replace("{question}", question)
            return Problem(uid, question, tokenizer.encode(text, add_special_tokens=True))
        if messages is None:
            messages = [{"role": "user", "content": question}]
            if self.config.system_prompt:
                messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return Problem(uid, question, tokenizer.encode(text, add_special_tokens=False))

    def draft_group(self, problem: Problem) -> str:
        return f"{id(self):x}/{problem.uid}"

    def forget(self, problem: Problem) -> None:
        self.runtime.forget_draft_group(self.generator, self.draft_group(problem))

    def sampling(self, problem: Problem, path: tuple[int, ...], n: int, to_eos: bool) -> SamplingParams:
        c = self.config
        return SamplingParams(
            n=n,
            temperature=c.temperature,
            top_p=c.top_p,
            max_tokens=c.max_tokens,
            stop=(c.stop or None) if to_eos or c.fixed_steps else [STEP_STOP, *c.stop],
            include_stop_str_in_output=True,
            ignore_eos=c.fixed_steps,
            seed=lineage_seed(c.seed, problem.uid, path),
            structured_outputs=c.constraint(whole=to_eos),
        )

    async def expand(self, problem: Problem, beam: Beam, n: int = 1, to_eos: bool = False) -> list[Beam]:
        """`n` children of `beam`, each one step longer (child i samples completion index i)."""
        prompt = problem.prompt_ids + [t for step in beam.step_ids for t in step]
        engine = self.runtime.engine(self.generator)
        if len(prompt) + 1 >= engine.max_model_len:
            done = beam.child(0)
            done.completed = True
            return [done]
        params = self.sampling(problem, beam.path, n, to_eos)
        if n == 1 and self.config.decode_ahead and not to_eos:
            return [await self._expand_ahead(problem, prompt, beam, params)]
        out = await self.runtime.generate(
            self.generator, {"prompt_token_ids": prompt}, params, self.draft_group(problem)
        )
        self._generated(problem, sum(len(c.token_ids) for c in out.outputs))
        return [self._extend(beam, i, c) for i, c in enumerate(out.outputs)]

    def _generated(self, problem: Problem, tokens: int) -> None:
        self.generated_tokens += tokens
        problem.generated_tokens += tokens

    async def _expand_ahead(self, problem: Problem, prompt: list[int], beam: Beam, params: SamplingParams) -> Beam:
        limit = self.config.max_tokens
        if beam.pending is not None:
            out = await beam.pending.final
            c = out.outputs[0]
            self._generated(problem, len(c.token_ids))
            first = c.stop_offsets[0][0]
            beam.leftover = Leftover(
                list(c.token_ids[first:]),
                [t - first for t, _ in c.stop_offsets[1:]],
                c.finish_reason == "stop" and c.stop_reason is None,
            )
            beam.pending = None
        taken = beam.leftover.next_step(limit) if beam.leftover is not None else None
        if taken is not None:
            tokens, ends, rest = taken
            child = self._grow(beam, 0, tokens, ends)
            child.leftover, child.decoded_ahead = rest, True
            return child
        params.n_stop_occurrences = 1 + self.config.decode_ahead
        params.max_tokens = limit * params.n_stop_occurrences
        ahead = await self.runtime.generate_ahead(
            self.generator, {"prompt_token_ids": prompt}, params, self.draft_group(problem)
        )
        c = (await ahead.first).outputs[0]
        if c.stop_offsets and c.stop_offsets[0][0] <= limit:
            child = self._grow(beam, 0, c.token_ids[: c.stop_offsets[0][0]], False)
            child.pending = ahead
            return child
        ahead.cancel()  # no stop string within max_tokens: this step ends the solution
        return self._grow(beam, 0, c.token_ids[:limit], True)

    async def score_beam(self, problem: Problem, beam: Beam, lookahead: bool = False) -> None:
        """Set `beam.scores`; with `lookahead`, `beam.lookahead_scores` too, of a greedy rollout."""
        rollout = await self.rollout(problem, beam) if lookahead else []
        try:
            try:
                scores, beam.score_source = await self._score(problem, beam.steps + rollout)
            except PRMInputTooLong:
                if not rollout:
                    raise
                rollout = []  # the rollout outgrew the PRM: the beam is ranked by its own steps
                scores, beam.score_source = await self._score(problem, beam.steps)
        except PRMInputTooLong as e:
            self.drop(problem, beam, e)
            return
        beam.scores, beam.lookahead_scores = scores[: len(beam.steps)], scores[len(beam.steps) :]
        if rollout:  # counted as if read whole, so the count is the same with caches or without
            shown, owner = self.prm_steps(beam.steps + rollout)
            if shown:
                _, positions = self.prm.build(problem.question, shown)
                last_own = owner[len(beam.steps) - 1] if beam.steps else -1
                own = positions[last_own] + 1 if last_own >= 0 else 0
                self.lookahead_prm_tokens += positions[-1] + 1 - own

    def drop(self, problem: Problem, beam: Beam, error: PRMInputTooLong) -> None:
        beam.dropped, beam.scores, beam.lookahead_scores = True, [], []
        beam.drop_decode_ahead()
        self.prm_too_long += 1
        problem.too_long += 1
        problem.too_long_error = error

    @staticmethod
    def check_left(problem: Problem, beams: list[Beam]) -> list[Beam]:
        """`beams`, or the PRM's error when every beam was dropped as too long."""
        if not beams and problem.too_long_error is not None:
            raise problem.too_long_error
        return beams

    async def verify(self, problem: Problem, beams: list[Beam]) -> list[Beam]:
        """`beams` re-scored by the verifier and sorted by its score (stable)."""
        if self.verifier is None or not beams:
            return beams
        scored = await gather_or_cancel(*(self._verify(problem, b) for b in beams))
        kept = [b for b, ok in zip(beams, scored, strict=True) if ok]
        kept.sort(key=lambda b: -aggregate(b.scores, self.config.agg))
        return self.check_left(problem, kept)

    async def _verify(self, problem: Problem, beam: Beam) -> bool:
        shown, owner = self.prm_steps(beam.steps)
        if not shown:
            return True
        try:
            scores = await self.verifier.score(problem.question, shown, on_input=self._saw_verifier_input)
            beam.scores = spread(scores, owner)
        except PRMInputTooLong as e:
            self.drop(problem, beam, e)
            return False
        return True

    def prm_steps(self, steps: list[str]) -> tuple[list[str], list[int]]:
        """The steps the PRM reads, and for each step the one it takes its score from."""
        if not self.config.reasoning:
            return steps, list(range(len(steps)))
        return prm_view(steps)

    async def rollout(self, problem: Problem, beam: Beam) -> list[str]:
        """Up to `config.lookahead` greedy steps after `beam`'s; beams of equal tokens share one."""
        if beam.completed or not self.config.lookahead:
            return []
        prompt = problem.prompt_ids + [t for step in beam.step_ids for t in step]
        if not self.config.score_cache:
            return await self._roll_out(problem, prompt)
        key = tuple(prompt)
        shared = self.rollouts.get(key)
        if shared is None:
            shared = self.rollouts[key] = asyncio.ensure_future(self._roll_out(problem, prompt))
            shared.add_done_callback(lambda _: self.rollouts.pop(key, None))
        return list(await asyncio.shield(shared))

    async def _roll_out(self, problem: Problem, prompt: list[int]) -> list[str]:
        c = self.config
        tokenizer = self.runtime.tokenizer(self.generator)
        limit = self.runtime.engine(self.generator).max_model_len
        steps: list[str] = []
        ended = False
        while not ended and len(steps) < c.lookahead and len(prompt) + 1 < limit:
            stop = None if c.fixed_steps else [STEP_STOP, *c.stop]
            params = SamplingParams(
                temperature=0.0,
                max_tokens=c.max_tokens,
                stop=stop,
                include_stop_str_in_output=True,
                ignore_eos=c.fixed_steps,
                structured_outputs=c.constraint(whole=False),
            )
            out = await self.runtime.generate(
                self.generator, {"prompt_token_ids": prompt}, params, self.draft_group(problem)
            )
            out = out.outputs[0]
            self._generated(problem, len(out.token_ids))
            self.lookahead_generated_tokens += len(out.token_ids)
            prompt = prompt + list(out.token_ids)
            text = tokenizer.decode(list(out.token_ids))
            steps.append(text.removesuffix(STEP_STOP))
            ended_by_stop_string = out.finish_reason == "stop" and out.stop_reason == STEP_STOP
            ended = not (ended_by_stop_string or c.fixed_steps) or not text.strip()
        return steps

    def _extend(self, beam: Beam, copy: int, c: CompletionOutput) -> Beam:
        ended_by_stop_string = c.finish_reason == "stop" and c.stop_reason == STEP_STOP
        return self._grow(beam, copy, c.token_ids, not ended_by_stop_string and not self.config.fixed_steps)

    def _grow(self, beam: Beam, copy: int, tokens: list[int], ends: bool) -> Beam:
        child = beam.child(copy)
        child.pending = child.leftover = None
        text = self.runtime.tokenizer(self.generator).decode(list(tokens))
        child.step_ids.append(list(tokens))
        child.steps.append(text.removesuffix(STEP_STOP))
        child.generated_tokens += len(tokens)
        child.completed = ends or not text.strip()
        return child

    async def score(self, problem: Problem, steps: list[str]) -> list[float]:
        return (await self._score(problem, steps))[0]

    async def _score(self, problem: Problem, steps: list[str]) -> tuple[list[float], str]:
        """Scores and where they came from: "prm", "cache" or "shared" (another beam's request)."""
        if self.prm is None:
            raise ValueError(f"strategy {self.config.strategy!r} needs a PRM")
        shown, owner = self.prm_steps(steps)
        scores, source = await self._score_shown(problem, shown)
        return spread(scores, owner), source

    async def _score_shown(self, problem: Problem, steps: list[str]) -> tuple[list[float], str]:
        if not steps:
            return [], ""

        def seen(ids: list[int]) -> None:
            self._saw_prm_input(problem, ids)

        if not self.config.score_cache:
            self.prm_requests += 1
            return await self.prm.score(problem.question, steps, on_input=seen), "prm"
        keys = prefix_keys(problem.question, steps)
        known = self.cache.known(keys)
        if len(known) == len(steps):
            return known, "cache"

        async def read() -> list[float]:
            self.prm_requests += 1
            scores = known + await self.prm.score(problem.question, steps, start=len(known), on_input=seen)
            self.cache.store(keys, scores)
            return scores

        scores, was_shared = await shared(self.in_flight, keys[-1], read)
        return scores, "shared" if was_shared else "prm"
