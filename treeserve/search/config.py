"""A search's settings (`SearchConfig`): every option a strategy reads, its default and its checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from treeserve.runtime.runtime import check_constraint
from treeserve.sampling_params import SamplingParams, StructuredOutputsParams

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
# strategies whose own rule spends the budget: they take no adaptive search and no decode-ahead
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
    decode_ahead: int = 0  # beam search: decode this many steps past the boundary while the PRM scores
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
        if self.max_concurrent_problems < 1 or self.decode_ahead < 0:
            raise ValueError("max_concurrent_problems must be >= 1 and decode_ahead >= 0")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.lookahead and self.strategy not in ("beam_search", "dvts", "mcts"):
            raise ValueError(
                f"lookahead={self.lookahead} rolls out further steps, but {self.strategy!r} does not: "
                "use it with beam_search, dvts or mcts, or leave lookahead at 0"
            )
        if self.fixed_steps and self.decode_ahead:
            raise ValueError("fixed_steps has no step boundaries to decode past: use decode_ahead=0")
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
            if self.decode_ahead:
                raise ValueError(f"decode_ahead is beam search's; {self.strategy} takes decode_ahead=0")

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
        if self.stop and (self.decode_ahead or self.fixed_steps):
            raise ValueError(
                "stop strings end a solution, but decode_ahead counts stop strings as step "
                "boundaries and fixed_steps has none: use them apart"
            )

    def _check_constraints(self) -> None:
        if self.step_regex is None and self.answer_regex is None:
            return
        if self.fixed_steps:
            raise ValueError(
                "fixed_steps has no step boundaries and ignores EOS: it cannot take step_regex or answer_regex"
            )
        if self.decode_ahead:
            raise ValueError(
                "decode_ahead decodes past the step boundary in one request, where a per-step "
                "constraint (step_regex, answer_regex) ends it: use decode_ahead=0"
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
        return replace(self, prefix_cache=False, score_cache=False, max_concurrent_problems=1, decode_ahead=0)
