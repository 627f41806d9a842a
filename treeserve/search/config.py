"""A search's settings (`SearchConfig`): every option a strategy reads, declared once.

Each field's metadata holds its help text, bounds (`ge`, `gt`, `le`), `choices`, a request cap
(`cap`) and whether it is a flag (`flag`) and a `/v1/search` field (`http`). The eval and solve
flags (cli.py), `/v1/search`'s request model (server/protocol.py) and the results file's config
are made from these fields; `__post_init__` checks the bounds and the cross-field rules.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any

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
AGGREGATIONS = ("last", "min", "prod")
# strategies whose own rule spends the budget: they take no adaptive search and no decode-ahead
OWN_BUDGET = ("rebase", "particle_filtering", "mcts")
# the softmax temperature over rewards unless `reward_temperature` is given (REBASE's T_b)
REWARD_TEMPERATURES = {"rebase": 0.2, "particle_filtering": 1.0}
# an unset step_regex / answer_regex: any text without a blank line (the separator); a step is not empty
ANY_STEP = r"(?:[^\n]|\n[^\n])+"
ANY_ANSWER = r"(?:[^\n]|\n[^\n])*\n?"
BUDGET_FRACTION = 0.3  # adaptive search's self-picked budget (docs/adaptive.md)
MAX_N = 256  # the widest search a request may ask for (a server's protection, not a rule of search)
MAX_ITERATIONS = 200  # likewise for num_iterations and lookahead


def setting(default: Any, help: str, *, factory: Any = None, **meta: Any) -> Any:
    """A SearchConfig field: `help`, and in `meta` its bounds (`ge`, `gt`, `le`), `choices`, `cap`
    (the most a request may ask), `metavar`, `flag=False` (no CLI flag), `http=False` (no
    `/v1/search` field)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


@dataclass
class SearchConfig:
    strategy: str = setting("beam_search", f"one of {', '.join(STRATEGIES)}", choices=STRATEGIES)
    n: int = setting(16, "beams or samples a problem gets (generate: completions a prompt gets)", ge=1, cap=MAX_N)
    beam_width: int = setting(4, "beams kept per selection (beam search, DVTS)", ge=1, cap=MAX_N)
    num_iterations: int = setting(40, "the most steps a solution takes", ge=1, cap=MAX_ITERATIONS)
    temperature: float = setting(0.8, "the generator's sampling temperature", ge=0.0, cap=100.0)
    top_p: float = setting(1.0, "the generator's nucleus sampling mass", gt=0.0, le=1.0)
    max_tokens: int = setting(256, "per step (beam/DVTS) or per completion", ge=1)
    agg: str = setting("last", "step-score aggregation", choices=AGGREGATIONS)
    filter_duplicates: bool = setting(False, "drop beams whose text repeats another's")
    final_to_eos: bool = setting(False, "search-and-learn: sample the last iteration to EOS")
    lookahead: int = setting(
        0,
        "beam search, DVTS, MCTS: score each new step after K more greedy steps (their text discarded)",
        ge=0,
        cap=MAX_ITERATIONS,
        metavar="K",
    )
    fixed_steps: bool = setting(
        False,
        "benchmarks on random weights: every step is max_tokens tokens (no stop string, EOS ignored)",
        flag=False,
        http=False,
    )
    system_prompt: str | None = setting(None, "a system message before the question", flag=False, http=False)
    prompt_format: str | None = setting(
        None,
        "the generator's prompt as plain text with {question} in it, instead of its chat template "
        "(a base model: few-shot examples)",
        metavar="TEXT",
    )
    stop: list[str] = setting(
        None,
        "a stop string that ends a solution (repeatable), e.g. a base model's next 'Question:'",
        factory=list,
        metavar="STR",
    )
    seed: int = setting(0, "the search's seed (each beam's draws follow from it and its path)")
    score_cache: bool = setting(True, "reuse PRM scores of steps scored before", http=False)
    max_concurrent_problems: int = setting(64, "problems searched at once", ge=1, http=False)
    decode_ahead: int = setting(
        0, "beam search: decode K steps past each boundary while the PRM scores", ge=0, http=False
    )
    step_regex: str | None = setting(
        None, "every step the separator ends must match this (llguidance regex, whole step)", metavar="REGEX"
    )
    answer_regex: str | None = setting(
        None, r"the final step must match this, e.g. '.*\\boxed\{[^{}]+\}.*'", metavar="REGEX"
    )
    trace: bool = setting(
        False,
        "record every candidate step, its PRM scores and its fate in the results "
        "(see them with treeserve view); changes no answer",
    )
    adaptive: bool = setting(
        False, "stop a problem once its answer is settled, starting narrow (docs: adaptive search)"
    )
    certainty: float = setting(
        0.9, "with --adaptive: the certainty in (0, 1] at which a problem stops (default 0.9)", gt=0.0, le=1.0
    )
    first_width: int = setting(
        4, "with --adaptive: beams or samples to start with, doubled up to --n (default 4)", ge=1
    )
    budget_tokens: int | None = setting(
        None,
        "with --adaptive: tokens the run may sample and feed the PRM, an equal share a problem; "
        "problems grow within their share and narrow past it, the least settled first (docs/adaptive.md)",
        ge=1,
    )
    budget_fraction: float | None = setting(
        BUDGET_FRACTION,
        "with --adaptive and no --budget-tokens: the run picks its budget, for a mean width this far from "
        f"--first-width to --n (default {BUDGET_FRACTION}; off: no budget; docs/adaptive.md)",
        ge=0.0,
        le=1.0,
        http=False,
    )
    reasoning: bool = setting(
        False,
        "a reasoning generator (<think>...</think>): steps split on blank lines inside the think "
        "block too, the PRM reads them without the think tags, answers are read after </think>",
    )
    reward_temperature: float | None = setting(
        None,
        "rebase, particle_filtering: the softmax temperature over rewards (default 0.2 for rebase, "
        "1.0 for particle_filtering; lower is greedier)",
        gt=0.0,
    )
    resample_threshold: float = setting(
        1.0,
        "particle_filtering: resample when the weights' effective sample size is at most this "
        "fraction of --n (default 1: every step)",
        gt=0.0,
        le=1.0,
    )
    exploration: float = setting(1.0, "mcts: UCT's exploration constant (default 1; 0: greedy by value)", ge=0.0)

    def __post_init__(self) -> None:
        if self.stop is None:  # a request's "stop": null
            self.stop = []
        for f in fields(self):
            check_bounds(f, getattr(self, f.name))
        if self.strategy in ("beam_search", "dvts") and self.n % self.beam_width:
            raise ValueError(f"n={self.n} must be divisible by beam_width={self.beam_width} for {self.strategy}")
        if self.lookahead and self.strategy not in ("beam_search", "dvts", "mcts"):
            raise ValueError(
                f"lookahead={self.lookahead} rolls out further steps, but {self.strategy!r} does not: "
                "use it with beam_search, dvts or mcts, or leave lookahead at 0"
            )
        if self.fixed_steps and self.decode_ahead:
            raise ValueError("fixed_steps has no step boundaries to decode past: use decode_ahead=0")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens)
        self._check_adaptive()
        self._check_rewards()
        self._check_constraints()
        self._check_prompt()

    def _check_adaptive(self) -> None:
        if self.budget_tokens is not None and not self.adaptive:
            raise ValueError("budget_tokens moves compute between problems: it needs adaptive=True (--adaptive)")
        if self.adaptive and self.strategy in ("beam_search", "dvts") and self.first_width % self.beam_width:
            raise ValueError(
                f"adaptive {self.strategy}: first_width={self.first_width} must be a multiple of "
                f"beam_width={self.beam_width}"
            )

    def _check_rewards(self) -> None:
        if self.reward_temperature is not None and self.strategy not in REWARD_TEMPERATURES:
            raise ValueError(
                f"reward_temperature weighs rewards for {' and '.join(REWARD_TEMPERATURES)}, not "
                f"{self.strategy!r}: leave it unset"
            )
        if self.resample_threshold != 1.0 and self.strategy != "particle_filtering":
            raise ValueError(f"resample_threshold is particle filtering's, not {self.strategy!r}: leave it at 1")
        if self.exploration != 1.0 and self.strategy != "mcts":
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
        """The plain path: no score cache, one problem at a time (the runtime turns the prefix cache off)."""
        return replace(self, score_cache=False, max_concurrent_problems=1, decode_ahead=0)


def check_bounds(f: Field, value: Any) -> None:
    """`value` against field `f`'s type (its annotation's text), `choices` and bounds."""
    meta, name, optional = f.metadata, f.name, "None" in f.type
    if value is None and optional:
        return
    if "choices" in meta:
        if value not in meta["choices"]:
            raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(meta['choices'])}")
        return
    kind = f.type.split(" |")[0]
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    if kind not in ("int", "float"):
        return
    lo, hi, closed = meta.get("ge", meta.get("gt")), meta.get("le"), "ge" in meta
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (kind == "float" or isinstance(value, int))
    ok = ok and (lo is None or value > lo or (closed and value == lo)) and (hi is None or value <= hi)
    if ok:
        return
    if lo is not None and hi is not None:
        what = f"in {'[' if closed else '('}{lo:g}, {hi:g}]"
    elif kind == "int":
        what = "a positive integer" if lo == 1 else f">= {lo} (an integer)"
    else:
        what = f"a number {'>=' if closed else '>'} {lo:g}"
    raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")
