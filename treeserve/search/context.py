"""What every strategy needs for one run: settings, the runtime, the PRM, caches, counters.

The values strategies pass around (`Problem`, `Beam`, `Leftover`) are `types.py`'s.

Also the primitives strategies are written in: `expand` (generate the next step of a
beam, as token ids so the next prompt is exactly what was sampled), `score` (PRM scores of
a beam's steps, through the score cache when it is on) and `score_beam` (the same for a
beam, after a greedy lookahead rollout whose text is scored and then discarded), and
`verify` (the final beams re-scored by an outcome reward model, `verifier`).

A beam whose PRM input outgrows the PRM's context (`PRMInputTooLong`) is dropped: marked
`dropped`, counted (`prm_too_long`, `Problem.too_long`) and traced as "too_long"; a
strategy left with nothing to return raises the error (`check_left`), which the server
answers with a 400.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field, replace

from treeserve.outputs import CompletionOutput
from treeserve.runtime.runtime import Runtime, check_constraint
from treeserve.sampling_params import SamplingParams, StructuredOutputsParams
from treeserve.search.prm.base import PRM, PRMInputTooLong
from treeserve.search.reasoning import check_generator, prm_view, spread
from treeserve.search.score_cache import ScoreCache, prefix_keys, shared
from treeserve.search.seeds import lineage_seed
from treeserve.search.trace import SearchTrace
from treeserve.search.tree_tokens import TreeTokens
from treeserve.search.types import STEP_STOP, Beam, Leftover, Problem, aggregate

STRATEGIES = (
    "best_of_n",
    "weighted_best_of_n",
    "majority",
    "beam_search",
    "dvts",
    "rebase",
    "particle_filtering",
    "mcts",
)
# strategies whose own rule spends the budget: they take no adaptive search and no speculative steps
OWN_BUDGET = ("rebase", "particle_filtering", "mcts")
# the softmax temperature over rewards each strategy that has one uses unless `reward_temperature` is given:
# REBASE's T_b over step scores (search/rebase.py), particle filtering's over their log-odds (its_hub's 1.0)
REWARD_TEMPERATURES = {"rebase": 0.2, "particle_filtering": 1.0}
# what an unset step_regex / answer_regex allows: any text without a blank line (the separator);
# a step is not empty (an empty step would end the solution)
ANY_STEP = r"(?:[^\n]|\n[^\n])+"
ANY_ANSWER = r"(?:[^\n]|\n[^\n])*\n?"
# adaptive search's self-picked budget, calibrated on 120 level-4/5 arithmetic problems apart from the
# held-out ones (docs/decisions.md)
BUDGET_FRACTION = 0.3


@dataclass
class SearchConfig:
    strategy: str = "beam_search"
    n: int = 16
    beam_width: int = 4
    num_iterations: int = 40
    temperature: float = 0.8
    top_p: float = 1.0
    max_tokens: int = 256  # per step for step-wise search; per completion for best-of-N
    agg: str = "last"  # step-score aggregation: last | min | prod
    filter_duplicates: bool = False
    final_to_eos: bool = False  # search-and-learn: sample the last iteration to EOS
    # beam search, DVTS: rank a new step by the PRM's score at the end of a greedy rollout of this
    # many more steps (Snell et al. 2024's lookahead search; the rollout's text is discarded)
    lookahead: int = 0
    # benchmarks on random weights: every step is max_tokens tokens (no stop string, EOS ignored)
    # and only the last iteration ends a beam
    fixed_steps: bool = False
    system_prompt: str | None = None
    # the generator's prompt as plain text, "{question}" replaced by the question, instead of its chat
    # template: for a base model (few-shot examples, say), which has no chat template
    prompt_format: str | None = None
    # more stop strings; one ends the solution where it appears (a base model writing on past its answer)
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    # optimisations (all on by default; `reference()` turns them off)
    prefix_cache: bool = True
    score_cache: bool = True
    max_concurrent_problems: int = 64
    speculative_steps: int = 0  # beam search: decode this many steps past the boundary while the PRM scores
    # constrained steps (llguidance regexes, matched against the whole step, separator removed):
    # a step that the separator ends matches step_regex, the final step (then EOS) answer_regex
    step_regex: str | None = None
    answer_regex: str | None = None
    trace: bool = False  # record every candidate step, its scores and its fate (search/trace.py); outputs only
    # adaptive search (search/certainty.py): a problem starts at `first_width` beams or samples,
    # grows toward n while its certainty stays below `certainty`, and stops once it reaches it
    adaptive: bool = False
    certainty: float = 0.9
    first_width: int = 4
    # adaptive: the tokens the whole run may sample and feed the PRM, an equal share a problem:
    # problems grow within their share (the less settled first) and narrow past it; sampling
    # rounds and DVTS waves that may not grow stop (docs/adaptive.md)
    budget_tokens: int | None = None
    # adaptive without budget_tokens, over a run's problems: the run picks its budget itself, for a mean
    # width of first_width + budget_fraction * (n - first_width) at the tokens a beam's search costs in the
    # problems ended so far (`SearchContext.budget`); None: no budget
    budget_fraction: float | None = BUDGET_FRACTION
    # a reasoning generator (<think>...</think>): the PRM reads the steps with the think tags
    # removed, a step that is only a tag not at all (search/reasoning.py); answers come from the text
    # after </think>
    reasoning: bool = False
    # REBASE, particle filtering: the softmax temperature over rewards (None: REWARD_TEMPERATURES'); particle
    # filtering resamples when the weights' effective sample size is at most this fraction of n (1: every step)
    reward_temperature: float | None = None
    resample_threshold: float = 1.0
    exploration: float = 1.0  # MCTS: UCT's exploration constant c (search/mcts.py)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}")
        if self.n < 1 or self.beam_width < 1 or self.num_iterations < 1:
            raise ValueError("n, beam_width and num_iterations must be >= 1")
        if self.strategy in ("beam_search", "dvts") and self.n % self.beam_width:
            raise ValueError(f"n={self.n} must be divisible by beam_width={self.beam_width} for {self.strategy}")
        if self.agg not in ("last", "min", "prod"):
            raise ValueError(f"agg must be last, min or prod, got {self.agg!r}")
        if self.max_concurrent_problems < 1 or self.speculative_steps < 0:
            raise ValueError("max_concurrent_problems must be >= 1 and speculative_steps >= 0")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.lookahead and self.strategy not in ("beam_search", "dvts", "mcts"):
            raise ValueError(
                f"lookahead={self.lookahead} rolls out further steps, but {self.strategy!r} does not: "
                "use it with beam_search, dvts or mcts, or leave lookahead at 0"
            )
        if self.fixed_steps and self.speculative_steps:
            raise ValueError("fixed_steps has no step boundaries to speculate past: use speculative_steps=0")
        if not isinstance(self.reasoning, bool):
            raise ValueError(f"reasoning must be True or False, got {self.reasoning!r}")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens)  # validates
        self._check_adaptive()
        self._check_rewards()
        self._check_constraints()
        self._check_prompt()

    def _check_adaptive(self) -> None:
        if not isinstance(self.certainty, int | float) or not 0.0 < self.certainty <= 1.0:
            raise ValueError(f"certainty must be in (0, 1] (1: never settled early), got {self.certainty!r}")
        if not isinstance(self.first_width, int) or self.first_width < 1:
            raise ValueError(f"first_width must be an integer >= 1, got {self.first_width!r}")
        if self.budget_tokens is not None and (not isinstance(self.budget_tokens, int) or self.budget_tokens < 1):
            raise ValueError(f"budget_tokens must be a positive number of tokens, got {self.budget_tokens!r}")
        f = self.budget_fraction
        if f is not None and (not isinstance(f, int | float) or not 0.0 <= f <= 1.0):
            raise ValueError(f"budget_fraction must be in [0, 1] (0: the first width, 1: n) or None, got {f!r}")
        if self.budget_tokens is not None and not self.adaptive:
            raise ValueError("budget_tokens moves compute between problems: it needs adaptive=True (--adaptive)")
        if self.adaptive and self.strategy in ("beam_search", "dvts") and self.first_width % self.beam_width:
            raise ValueError(
                f"adaptive {self.strategy}: first_width={self.first_width} must be a multiple of "
                f"beam_width={self.beam_width}"
            )

    def _check_rewards(self) -> None:
        t = self.reward_temperature
        if t is not None and (not isinstance(t, int | float) or not math.isfinite(t) or t <= 0):
            raise ValueError(f"reward_temperature must be a number > 0, got {t!r}")
        if t is not None and self.strategy not in REWARD_TEMPERATURES:
            raise ValueError(
                f"reward_temperature weighs rewards for {' and '.join(REWARD_TEMPERATURES)}, not "
                f"{self.strategy!r}: leave it unset"
            )
        r = self.resample_threshold
        if not isinstance(r, int | float) or not 0.0 < r <= 1.0:
            raise ValueError(f"resample_threshold must be in (0, 1] (1: resample every step), got {r!r}")
        if r != 1.0 and self.strategy != "particle_filtering":
            raise ValueError(f"resample_threshold is particle filtering's, not {self.strategy!r}: leave it at 1")
        x = self.exploration
        if not isinstance(x, int | float) or not math.isfinite(x) or x < 0:
            raise ValueError(f"exploration must be a number >= 0, got {x!r}")
        if x != 1.0 and self.strategy != "mcts":
            raise ValueError(f"exploration is MCTS's, not {self.strategy!r}: leave it at 1")
        if self.strategy in OWN_BUDGET:
            if self.adaptive:
                raise ValueError(
                    f"{self.strategy} spends its budget by its rewards already: adaptive search is "
                    "beam search's, DVTS's and the sampling strategies'"
                )
            if self.speculative_steps:
                raise ValueError(f"speculative_steps is beam search's; {self.strategy} takes speculative_steps=0")

    def softmax_temperature(self) -> float:
        """The softmax temperature over rewards the strategy uses: `reward_temperature`, or its default."""
        return REWARD_TEMPERATURES[self.strategy] if self.reward_temperature is None else self.reward_temperature

    def widths(self) -> list[int]:
        """Adaptive search's widths: first_width, doubled until n (n alone when not adaptive)."""
        if not self.adaptive:
            return [self.n]
        out = [min(self.first_width, self.n)]
        while out[-1] < self.n:
            out.append(min(2 * out[-1], self.n))
        return out

    def _check_prompt(self) -> None:
        if self.prompt_format is not None:
            if not isinstance(self.prompt_format, str) or "{question}" not in self.prompt_format:
                raise ValueError(f"prompt_format must be text containing '{{question}}', got {self.prompt_format!r}")
            if self.system_prompt:
                raise ValueError(
                    "system_prompt is a chat message, and prompt_format replaces the chat template: "
                    "put the instructions in prompt_format"
                )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple) or any(not isinstance(t, str) or not t for t in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if self.stop and (self.speculative_steps or self.fixed_steps):
            raise ValueError(
                "stop strings end a solution, but speculative_steps counts stop strings as step "
                "boundaries and fixed_steps has none: use them apart"
            )

    def _check_constraints(self) -> None:
        if self.step_regex is None and self.answer_regex is None:
            return
        if self.fixed_steps:
            raise ValueError(
                "fixed_steps has no step boundaries and ignores EOS: it cannot take step_regex or answer_regex"
            )
        if self.speculative_steps:
            raise ValueError(
                "speculative_steps decodes past the step boundary in one request, where a per-step "
                "constraint (step_regex, answer_regex) ends it: use speculative_steps=0"
            )
        for name in ("step_regex", "answer_regex"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty regex, got {value!r}")
            try:  # alone first: a fragment such as "a)|(b" would pass inside the combined regex
                check_constraint(StructuredOutputsParams(regex=value))
            except ValueError as e:
                raise ValueError(f"{name} {value!r} is not a valid regex: {e}") from None
        check_constraint(self.constraint(whole=False))
        check_constraint(self.constraint(whole=True))

    def constraint(self, whole: bool) -> StructuredOutputsParams | None:
        """What every sampled step must match: one step (`(?:STEP)\\n\\n|(?:ANSWER)`), or with
        `whole` the rest of a solution (`(?:(?:STEP)\\n\\n)*(?:ANSWER)`); None when unconstrained."""
        if self.step_regex is None and self.answer_regex is None:
            return None
        step = rf"(?:{self.step_regex or ANY_STEP})\n\n"
        answer = f"(?:{self.answer_regex or ANY_ANSWER})"
        return StructuredOutputsParams(regex=f"(?:{step})*{answer}" if whole else f"{step}|{answer}")

    def reference(self) -> SearchConfig:
        """The plain path: no prefix cache, no score cache, one problem at a time."""
        return replace(self, prefix_cache=False, score_cache=False, max_concurrent_problems=1, speculative_steps=0)


async def gather_or_cancel(*aws: Awaitable) -> list:
    """`asyncio.gather`, except that when one fails the others are cancelled (their engine
    requests aborted) before the error propagates: a failed engine step ends the whole search
    at once instead of leaving its other beams decoding for nobody."""
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
    # an outcome reward model that re-scores the beams a strategy returns (`verify`): their step
    # scores become its scores by the prefix rule (search/prm/outcome.py), the PRM's stay in the trace
    verifier: PRM | None = None
    cache: ScoreCache = field(default_factory=ScoreCache)
    prm_tree: TreeTokens = field(default_factory=TreeTokens)  # distinct tokens the PRM was shown
    prm_requests: int = 0
    prm_too_long: int = 0  # beams dropped because their PRM input outgrew the PRM's context
    in_flight: dict[int, asyncio.Future] = field(default_factory=dict)  # prefix key -> scores being computed
    rollouts: dict[tuple[int, ...], asyncio.Future] = field(default_factory=dict)  # prompt -> rollout running
    generated_tokens: int = 0  # every token the generator sampled for this context, kept or pruned
    prm_input_tokens: int = 0  # tokens of every PRM input built (cached or not)
    verifier_input_tokens: int = 0  # tokens of every verifier input built
    lookahead_generated_tokens: int = 0  # of generated_tokens, those of lookahead rollouts
    lookahead_prm_tokens: int = 0  # of the PRM inputs' tokens, those of rollout steps
    on_iteration: Callable[[int, list[Beam]], None] | None = None  # progress: (iteration, scored beams)
    traces: dict[str, SearchTrace] = field(default_factory=dict)  # problem id -> its trace (config.trace)
    # adaptive search: a completion's answer key (equal keys: the same answer; None: no answer),
    # given by the caller, which owns the answer rules (eval's grader, the server's); it gets the
    # whole text (with `config.reasoning` theirs read the text after </think>)
    answer_of: Callable[[Problem, str], Hashable | None] | None = None
    _scoring: Problem | None = None  # the problem whose PRM input is being built (see _score)
    certainties: dict[str, float] = field(default_factory=dict)  # paced: problems in flight, latest
    # paced (a budget given or picked): the problems the run will search (`expect`: each gets an equal
    # share); of those that ended, how many, what they spent, and the sum of what a beam of each cost
    expected_problems: int = 0
    ended: int = 0
    ended_spent: int = 0
    ended_beam_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.prm is not None:
            self.prm.on_input = self._saw_prm_input
        if self.verifier is not None:
            self.verifier.on_input = self._saw_verifier_input
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

    def _saw_prm_input(self, ids: list[int]) -> None:
        self.prm_tree.add(ids)
        self.prm_input_tokens += len(ids)
        if self._scoring is not None:
            self._scoring.prm_tokens += len(ids)

    def _saw_verifier_input(self, ids: list[int]) -> None:
        self.verifier_input_tokens += len(ids)

    def answers(self, problem: Problem, beams: list[Beam]) -> list[Hashable | None]:
        """Each beam's answer key (adaptive search; None: no answer yet)."""
        return [self.answer_of(problem, b.text) for b in beams]

    def decide(
        self, problem: Problem, iteration: int, width: int, certainty: float, exhausted: bool, grows: bool
    ) -> str:
        """An adaptive decision after `iteration` (a round or wave for sampling and DVTS), recorded
        in `problem.stop` (each iteration's width and certainty; once it stops, where and why):
        why the problem stops now, or "" to go on. "settled": its certainty reached the
        threshold; "exhausted": it ran to its end; "budget": going on means growing (`grows`:
        a sampling round, a DVTS wave) and it may not (`may_widen`). Beam search never stops
        for the budget: it narrows (`next_width`). An ended problem's unspent share joins the
        surplus."""
        c = self.config
        reason = "settled" if certainty >= c.certainty else "exhausted" if exhausted else ""
        stop = problem.stop if problem.stop is not None else {"widths": [], "certainty": []}
        problem.stop = stop
        if self.paced:
            problem.count_beam_tokens(width, cumulative=grows)
            self.certainties[problem.uid] = certainty
            if not reason and grows and not self.may_widen(problem):
                reason = "budget"
            if reason:
                del self.certainties[problem.uid]
                self.ended += 1
                self.ended_spent += problem.spent_tokens
                self.ended_beam_tokens += problem.beam_tokens
                if c.budget_tokens is None:  # the budget the run picked, as it stands now
                    stop["budget_tokens"] = round(self.budget)
        stop["widths"].append(width)
        stop["certainty"].append(round(certainty, 4))
        if reason:
            stop |= {"iteration": iteration, "reason": reason}
        return reason

    @property
    def paced(self) -> bool:
        """A budget paces the problems: `budget_tokens`, or adaptive search over a run's problems
        (`expect`) with `budget_fraction`."""
        c = self.config
        picked = c.adaptive and c.budget_fraction is not None and self.expected_problems > 0
        return c.budget_tokens is not None or picked

    @property
    def budget(self) -> float | None:
        """The tokens the run may sample and feed the PRM: `budget_tokens`, or the run's own pick
        (`budget_fraction`): its problems x the mean width first_width + budget_fraction x (n -
        first_width) x the tokens a beam's search cost, on average over the problems ended so far
        (None until one has ended, and without a budget)."""
        c = self.config
        if c.budget_tokens is not None:
            return c.budget_tokens
        if not self.paced or not self.ended:
            return None
        first = c.widths()[0]
        width = first + c.budget_fraction * (c.n - first)
        return self.expected_problems * width * self.ended_beam_tokens / self.ended

    def may_widen(self, problem: Problem) -> bool:
        """With a `budget`: whether `problem` may grow its width, i.e. it is among the less
        settled half of the problems in flight, it is not `over_pace`, and the budget is not
        spent. This reads the other problems: with a budget, what a problem gets depends on
        what else is in flight."""
        budget = self.budget
        if budget is None:
            return True
        return self.spent_tokens < budget and not self.over_pace(problem) and self._less_settled(problem)

    def next_width(self, problem: Problem, width: int, widths: list[int]) -> int:
        """Beam search's width for the next iteration, of `widths`: one step wider while
        `may_widen`; with a budget, one step narrower once the problem is `over_pace`, unless it
        is less settled than the median of those in flight (a wider width goes on spending at
        every iteration; and before its beams finish a problem's certainty is 0, like most
        others'); else the same."""
        at = widths.index(width)
        if self.may_widen(problem):  # (always, without a budget)
            return widths[min(at + 1, len(widths) - 1)]
        if not self.over_pace(problem):
            return width
        if self.spent_tokens >= self.budget:  # all of it spent: the first width, to the end
            return widths[0]
        return width if self._less_settled(problem, strictly=True) else widths[max(at - 1, 0)]

    def _less_settled(self, problem: Problem, strictly: bool = False) -> bool:
        """`problem`'s certainty is at or below (`strictly`: below) the median of the problems in
        flight: it is among the less settled half."""
        ordered = sorted(self.certainties.values())
        mine, median = self.certainties.get(problem.uid, 0.0), ordered[(len(ordered) - 1) // 2]
        return mine < median if strictly else mine <= median

    def expect(self, problems: int) -> None:
        """The run searches `problems` problems: each gets that share of a budget. The largest
        count given stands (`search_problems` gives its list's; a Ray worker is told the run's,
        then searches one problem a call)."""
        self.expected_problems = max(self.expected_problems, problems)

    @property
    def share(self) -> float:
        """With a `budget`: each problem's share of it (all of it when the run expected no
        number of problems: one search)."""
        budget = self.budget
        return budget / self.expected_problems if self.expected_problems else budget

    @property
    def surplus(self) -> float:
        """What the problems that ended left of their shares, less what they spent beyond them."""
        return self.ended * self.share - self.ended_spent

    def over_pace(self, problem: Problem) -> bool:
        """With a `budget`: `problem` spent its share and its part of the surplus (shared by the
        problems in flight). Paced per problem: a run-wide count let the first problems in
        flight spend the whole budget, and the last ones of a run stopped at their first decision."""
        if self.budget is None:
            return False
        in_flight = max(1, len(self.certainties))
        return problem.spent_tokens >= self.share + max(0.0, self.surplus) / in_flight

    @property
    def spent_tokens(self) -> int:
        """Tokens the search sampled and fed the PRM so far (what `budget_tokens` bounds)."""
        return self.generated_tokens + self.prm_input_tokens

    def problem(self, uid: str, question: str, messages: list[dict] | None = None) -> Problem:
        """The generator's prompt for `question` (a user message), or for a whole conversation
        `messages` whose last user turn is the question the PRM sees; with `prompt_format`, that
        text with the question in it, encoded as plain text (BOS and all)."""
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
        """The generator's draft group of `problem`'s requests (speculative `tree` drafting: the
        beams of one problem draft from each other's text)."""
        return f"{id(self):x}/{problem.uid}"

    def forget(self, problem: Problem) -> None:
        """`problem`'s search ended: the generator drops its drafting text."""
        self.runtime.forget_draft_group(self.generator, self.draft_group(problem))

    def report(self, problem: Problem, iteration: int, beams: list[Beam], fates: list[str]) -> None:
        """An iteration's scored candidates and what the search did with each (trace.FATES)."""
        if self.config.trace:
            c = self.config
            trace = self.traces.setdefault(problem.uid, SearchTrace(c.strategy, c.n, c.beam_width, c.agg))
            trace.add(iteration, beams, fates)
        if self.on_iteration is not None:
            self.on_iteration(iteration, beams)

    def take_trace(self, problem: Problem, completions: list[Beam], seconds: float) -> dict | None:
        """`problem`'s trace as JSON (None unless `config.trace`), forgotten here."""
        trace = self.traces.pop(problem.uid, None)
        if not self.config.trace:
            return None
        if trace is None:  # a search that reported no iteration
            c = self.config
            trace = SearchTrace(c.strategy, c.n, c.beam_width, c.agg)
        doc = trace.to_json(completions, seconds)
        if problem.stop is not None:  # adaptive search: every stop is in the trace
            doc["stop"] = problem.stop
        return doc

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
        if n == 1 and self.config.speculative_steps and not to_eos:
            return [await self._expand_speculative(problem, prompt, beam, params)]
        out = await self.runtime.generate(
            self.generator, {"prompt_token_ids": prompt}, params, self.draft_group(problem)
        )
        self._generated(problem, sum(len(c.token_ids) for c in out.outputs))
        return [self._extend(beam, i, c) for i, c in enumerate(out.outputs)]

    def _generated(self, problem: Problem, tokens: int) -> None:
        self.generated_tokens += tokens
        problem.generated_tokens += tokens

    async def _expand_speculative(
        self, problem: Problem, prompt: list[int], beam: Beam, params: SamplingParams
    ) -> Beam:
        """Take the next step from what this lineage already decoded, or start a request that
        reports its first step early and keeps decoding `speculative_steps` more."""
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
            child.leftover, child.speculative = rest, True
            return child
        params.n_stop_occurrences = 1 + self.config.speculative_steps
        params.max_tokens = limit * params.n_stop_occurrences
        speculation = await self.runtime.generate_ahead(
            self.generator, {"prompt_token_ids": prompt}, params, self.draft_group(problem)
        )
        c = (await speculation.first).outputs[0]
        if c.stop_offsets and c.stop_offsets[0][0] <= limit:
            child = self._grow(beam, 0, c.token_ids[: c.stop_offsets[0][0]], False)
            child.pending = speculation
            return child
        speculation.cancel()  # no stop string within the step budget: this step ends the solution
        return self._grow(beam, 0, c.token_ids[:limit], True)

    async def score_beam(self, problem: Problem, beam: Beam, lookahead: bool = False) -> None:
        """Set `beam.scores` and, with `lookahead`, `beam.lookahead_scores`: the scores of a rollout
        of `config.lookahead` more steps, which the PRM reads after the beam's own steps."""
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
        if rollout:  # the rollout's share of the PRM input (as if read whole: the same with caches or without)
            shown, owner = self.prm_steps(beam.steps + rollout)
            if shown:
                _, positions = self.prm.build(problem.question, shown)
                last_own = owner[len(beam.steps) - 1] if beam.steps else -1
                own = positions[last_own] + 1 if last_own >= 0 else 0
                self.lookahead_prm_tokens += positions[-1] + 1 - own

    def drop(self, problem: Problem, beam: Beam, error: PRMInputTooLong) -> None:
        """`beam`'s PRM input outgrew the PRM's context: search neither extends nor returns it."""
        beam.dropped, beam.scores, beam.lookahead_scores = True, [], []
        beam.drop_speculation()
        self.prm_too_long += 1
        problem.too_long += 1
        problem.too_long_error = error

    @staticmethod
    def check_left(problem: Problem, beams: list[Beam]) -> list[Beam]:
        """`beams`, unless none is left because every one was dropped as too long: then the
        PRM's error, which names the lengths (an HTTP 400 on /v1/search)."""
        if not beams and problem.too_long_error is not None:
            raise problem.too_long_error
        return beams

    async def verify(self, problem: Problem, beams: list[Beam]) -> list[Beam]:
        """With a verifier: each beam's scores become the verifier's (the prefix rule: step i's
        is its score of the solution that ends with step i), and the beams are sorted by their
        aggregated verifier score (stable). A beam too long for the verifier is dropped."""
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
            beam.scores = spread(await self.verifier.score(problem.question, shown), owner)
        except PRMInputTooLong as e:
            self.drop(problem, beam, e)
            return False
        return True

    def prm_steps(self, steps: list[str]) -> tuple[list[str], list[int]]:
        """The steps the PRM (and the verifier) read, and which of them each step takes its score
        from: all of them, as they are; with `config.reasoning`, `reasoning.prm_view`'s."""
        if not self.config.reasoning:
            return steps, list(range(len(steps)))
        return prm_view(steps)

    async def rollout(self, problem: Problem, beam: Beam) -> list[str]:
        """Up to `config.lookahead` steps after `beam`'s at temperature 0 (text, separator removed).
        A finished beam has none. Greedy steps depend only on the prompt, so with the score cache
        on, beams with the same tokens rolling out at the same time share one rollout (which
        then finishes even if the beam that started it is cancelled)."""
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
        """One request per greedy step; each prompt is the tokens so far, so the prefix cache
        holds all but the newest. Stops where a beam would end (EOS, length, empty step, full
        context)."""
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
        """PRM scores of every step; with the score cache, only steps never scored are read,
        and beams with the same steps asking at the same time share one PRM request."""
        return (await self._score(problem, steps))[0]

    async def _score(self, problem: Problem, steps: list[str]) -> tuple[list[float], str]:
        """`score`'s scores and where they came from: "prm" (a request of its own), "cache"
        (every step scored before), "shared" (another beam's request for the same steps)."""
        if self.prm is None:
            raise ValueError(f"strategy {self.config.strategy!r} needs a PRM")
        shown, owner = self.prm_steps(steps)
        scores, source = await self._score_shown(problem, shown)
        return spread(scores, owner), source

    async def _score_shown(self, problem: Problem, steps: list[str]) -> tuple[list[float], str]:
        """`_score` of the steps the PRM reads."""
        if not steps:
            return [], ""
        if not self.config.score_cache:
            self.prm_requests += 1
            self._scoring = problem  # read by _saw_prm_input, which prm.score calls before its first await
            return await self.prm.score(problem.question, steps), "prm"
        keys = prefix_keys(problem.question, steps)
        known = self.cache.known(keys)
        if len(known) == len(steps):
            return known, "cache"

        async def read() -> list[float]:
            self.prm_requests += 1
            self._scoring = problem  # as above
            scores = known + await self.prm.score(problem.question, steps, start=len(known))
            self.cache.store(keys, scores)
            return scores

        scores, was_shared = await shared(self.in_flight, keys[-1], read)
        return scores, "shared" if was_shared else "prm"
