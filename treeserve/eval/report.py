"""Results documents of an evaluation run: build, write, read, validate and upgrade them.

A document is {"config", "summary", "problems", "counters"} (docs/eval.md); `grade_problems`
turns a search's texts and step scores into graded `ProblemOutcome`s. It never calls an engine.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import MISSING, Field, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from treeserve.eval.grading import Grader, extract_answer
from treeserve.eval.metrics import (
    AGGREGATIONS,
    SELECTIONS,
    ProblemOutcome,
    ScoredCompletion,
    aggregate_scores,
    group_ids,
    select,
    summarize,
)
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RUNTIME_CONFIGS
from treeserve.search.config import SearchConfig

PROBLEM_KEYS = ("unique_id", "level", "problem", "answer", "pred", "correct", "completions")
COMPLETION_KEYS = ("text", "answer", "step_scores", "score", "correct")
REQUIRED_SUMMARY_KEYS = ("accuracy", "problems_per_s")

# One completion as a search returns it: (text, step_scores) or {"text": ..., "step_scores": ...}.
RawCompletion = tuple[str, Sequence[float]] | Mapping[str, Any]


@dataclass
class RunStats:
    """Cost numbers of a run, measured by the caller (the CLI) and copied into the summary."""

    wall_time_s: float
    generated_tokens: int = 0
    prm_tokens_prefilled: int = 0  # tokens the PRM actually computed (prefix-cache misses)
    prm_unique_tokens: int = 0  # distinct tokens the PRM had to read (the lower bound of the above)
    prefix_hit_rate: float | None = None


def grade_problems(
    records: Sequence[Mapping[str, Any]],
    completions: Sequence[Sequence[RawCompletion]],
    grader: Grader,
    *,
    preds: Sequence[str | None] | None = None,
    selection: str = "weighted",
    agg: str = "last",
    reasoning: bool = False,
) -> list[ProblemOutcome]:
    """Grade every completion of every problem at once and choose each problem's answer:
    `preds[i]` when the strategy chose one, else the completion `selection` picks under `agg`.
    A record without `grader` is graded as "math"; equivalent answers share a `group`."""
    if len(records) != len(completions):
        raise ValueError(f"{len(records)} records but completions for {len(completions)} problems")
    if preds is not None and len(preds) != len(records):
        raise ValueError(f"{len(records)} records but {len(preds)} preds")
    if selection not in SELECTIONS or agg not in AGGREGATIONS:
        raise ValueError(f"selection must be one of {SELECTIONS} and agg one of {AGGREGATIONS}")
    kinds = [rec.get("grader", "math") for rec in records]
    parsed = [[_parse_completion(c) for c in problem] for problem in completions]
    answers = [[extract_answer(text, reasoning) for text, _ in problem] for problem in parsed]
    pred_answers = (
        [None if p is None else (extract_answer(p) if "\\boxed" in p else p.strip() or None) for p in preds]
        if preds is not None
        else []
    )

    golds = [rec["answer"] for rec in records]
    items = [(a, gold, kind) for gold, kind, row in zip(golds, kinds, answers, strict=True) for a in row]
    if preds is not None:
        items += [(a, gold, kind) for gold, kind, a in zip(golds, kinds, pred_answers, strict=True)]
    verdicts = iter(grader.grade_many(items))
    keys_by_kind: dict[str, Iterator[str | None]] = {}  # one batch per grader kind, consumed in order below
    for kind in set(kinds):
        kind_answers = [a for k, row in zip(kinds, answers, strict=True) if k == kind for a in row]
        keys_by_kind[kind] = iter(grader.answer_keys(kind_answers, kind))

    outcomes: list[ProblemOutcome] = []
    for rec, kind, texts, row in zip(records, kinds, parsed, answers, strict=True):
        keys = [next(keys_by_kind[kind]) for _ in row]
        scored = [
            ScoredCompletion(text=text, answer=answer, step_scores=scores, correct=next(verdicts), group=group)
            for (text, scores), answer, group in zip(texts, row, group_ids(keys), strict=True)
        ]
        outcomes.append(
            ProblemOutcome(
                unique_id=str(rec["unique_id"]),
                level=rec.get("level"),
                problem=rec["problem"],
                answer=rec["answer"],
                completions=scored,
            )
        )
    if preds is not None:
        for outcome, answer in zip(outcomes, pred_answers, strict=True):
            outcome.pred, outcome.correct = answer, next(verdicts)
    else:
        for outcome in outcomes:
            i = select(outcome.completions, selection, agg)
            if i is not None:
                outcome.pred, outcome.correct = outcome.completions[i].answer, outcome.completions[i].correct
    return outcomes


def _parse_completion(c: RawCompletion) -> tuple[str, list[float]]:
    if isinstance(c, Mapping):
        text, scores = c.get("text"), c.get("step_scores", [])
    elif isinstance(c, tuple | list) and len(c) == 2:
        text, scores = c
    else:
        raise TypeError(f"a completion is (text, step_scores) or a mapping with 'text', got {type(c).__name__}")
    if not isinstance(text, str):
        raise TypeError(f"completion text must be a string, got {type(text).__name__}")
    return text, [float(s) for s in scores]


def problem_record(p: ProblemOutcome, agg: str = "last") -> dict:
    """The JSON record of one problem (keys PROBLEM_KEYS; completions with COMPLETION_KEYS)."""
    return {
        "unique_id": p.unique_id,
        "level": p.level,
        "problem": p.problem,
        "answer": p.answer,
        "pred": p.pred,
        "correct": bool(p.correct),
        "completions": [
            {
                "text": c.text,
                "answer": c.answer,
                "step_scores": [_finite(s) for s in c.step_scores],
                "score": _finite(aggregate_scores(c.step_scores, agg)),
                "correct": bool(c.correct),
                "group": c.group,
            }
            for c in p.completions
        ],
    }


def _finite(x: float) -> float | None:
    """JSON has no NaN or infinity: write them as null."""
    return float(x) if math.isfinite(x) else None


def build_summary(
    problems: Sequence[ProblemOutcome], stats: RunStats, agg: str = "last", rule: str | None = None
) -> dict:
    """Quality metrics (`metrics.summarize`; `rule`: the selection that chose the answers) plus
    throughput and cache numbers from `stats`."""
    wall = stats.wall_time_s
    summary = summarize(problems, agg, rule)
    summary.update(
        wall_time_s=wall,
        problems_per_s=len(problems) / wall if wall > 0 else 0.0,
        generated_tokens=stats.generated_tokens,
        generated_tokens_per_s=stats.generated_tokens / wall if wall > 0 else 0.0,
        prm_tokens_prefilled=stats.prm_tokens_prefilled,
        prm_tokens_per_s=stats.prm_tokens_prefilled / wall if wall > 0 else 0.0,
        prm_unique_tokens=stats.prm_unique_tokens,
        prefix_hit_rate=stats.prefix_hit_rate,
    )
    return summary


def build_results(
    config: Mapping[str, Any], problems: Sequence[ProblemOutcome], stats: RunStats, agg: str = "last"
) -> dict:
    """The whole results document: {"config", "summary", "problems"}; the summary's
    `accuracy_rule` is the config's `selection`."""
    if stats.wall_time_s < 0:
        raise ValueError(f"wall_time_s must be >= 0, got {stats.wall_time_s}")
    return {
        "config": dict(config),
        "summary": build_summary(problems, stats, agg, config.get("selection")),
        "problems": [problem_record(p, agg) for p in problems],
    }


def write_results(results: Mapping[str, Any], path: str | Path) -> Path:
    """Validate and write a results document as JSON (atomically; parent folders are created)."""
    path = Path(path)
    validate_results(results, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_dumps(results))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _dumps(results: Mapping[str, Any]) -> str:
    """The document as JSON: indented, except each problem (with its completions and trace) and
    each page-log row, which take one line each (traces and page logs are most of a file)."""

    def compact(obj: Any) -> str:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)

    def lines(items: Sequence[Any]) -> str:
        return "[\n  " + ",\n  ".join(map(compact, items)) + "\n ]" if items else "[]"

    parts = []
    for key, value in results.items():
        if key == "problems":
            text = lines(value)
        elif key == "page_logs" and isinstance(value, Mapping) and value:
            text = "{\n" + ",\n".join(f" {compact(name)}: {lines(rows)}" for name, rows in value.items()) + "\n }"
        else:
            text = json.dumps(value, indent=1, ensure_ascii=False, allow_nan=False).replace("\n", "\n ")
        parts.append(f" {compact(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def read_results(path: str | Path) -> dict:
    """A validated results document; ValueError naming the file when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"results file not found: {path}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a treeserve results file (not valid JSON: {e})") from None
    document = validate_results(obj, str(path))
    document["config"] = upgrade_config(document["config"])
    return document


# flat per-model keys of old results: both models', the generator's, the PRM's (renamed)
_OLD_BOTH = ("dequantize", "quant_activations", "async_scheduling", "enforce_eager", "distributed_executor_backend")
_OLD_GENERATOR = ("quantization", "speculative_config", "tensor_parallel_size", "pipeline_parallel_size")
_OLD_PRM = {
    "prm_style": "style",
    "prm_quantization": "quantization",
    "prm_kv_fraction": "kv_fraction",
    "prm_tensor_parallel_size": "tensor_parallel_size",
    "prm_pipeline_parallel_size": "pipeline_parallel_size",
}


def upgrade_config(config: Mapping[str, Any]) -> dict:
    """A results document's (or journal's) config in today's form: flat per-model keys become
    `generator` and `prm` sections, flat settings the sub-configs holding them, search settings
    added since are filled in at their defaults (an adaptive run from before the picked budget ran
    without one)."""
    config = dict(config)
    if isinstance(config.get("search"), Mapping):
        search = dict(config["search"])
        if "speculative_steps" in search:  # decode_ahead's name before 2026-12-02
            search["decode_ahead"] = search.pop("speculative_steps")
        if "prefix_cache" in search:  # a search setting before 2026-12-02, the runtime's since
            config.setdefault("prefix_cache", search.pop("prefix_cache"))
        unbudgeted = search.get("adaptive") and search.get("budget_tokens") is None
        before = {"budget_fraction": None} if unbudgeted and "budget_fraction" not in search else {}
        config["search"] = {**asdict(SearchConfig()), **before, **search}
    if isinstance(config.get("generator"), str) or isinstance(config.get("prm"), str):
        tuned = config.pop("engine_args", None) or {}
        both = {k: config.pop(k) for k in _OLD_BOTH if k in config}
        generator = {k: config.pop(k) for k in _OLD_GENERATOR if k in config}
        prm = {new: config.pop(old) for old, new in _OLD_PRM.items() if old in config}
        for name, own in (("generator", generator), ("prm", prm)):
            if isinstance(config.get(name), str):
                config[name] = {"path": config[name], **both, **own, **tuned.get(name, {})}
    for name in ("generator", "prm", "verifier"):  # flat sections before 2026-12-02: the sub-configs since
        section = config.get(name)
        if isinstance(section, Mapping) and "load_config" not in section:
            config[name] = asdict(ModelSettings.from_flat(**section))
    if "prefix_cache" in config:  # the runtime's settings were flat before 2026-12-02
        config["enable_prefix_caching"] = config.pop("prefix_cache")
    for group, kind in RUNTIME_CONFIGS.items():
        if group not in config and any(f.name in config for f in fields(kind)):
            config[group] = {f.name: config.pop(f.name, _default(f)) for f in fields(kind)}
    return config


def _default(f: Field) -> object:
    return f.default_factory() if f.default is MISSING else f.default


def validate_results(obj: Any, source: str = "results") -> dict:
    """Check the shape of a results document and return it; ValueError saying what is wrong."""

    def fail(what: str) -> ValueError:
        return ValueError(f"{source}: not a treeserve results file ({what})")

    if not isinstance(obj, Mapping):
        raise fail(f"top level is a {type(obj).__name__}, expected an object")
    for key, kind in (("config", Mapping), ("summary", Mapping), ("problems", list)):
        if key not in obj:
            raise fail(f"missing {key!r}")
        if not isinstance(obj[key], kind):
            raise fail(f"{key!r} must be {'a list' if kind is list else 'an object'}")
    for key in REQUIRED_SUMMARY_KEYS:
        value = obj["summary"].get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail(f"summary[{key!r}] must be a number, got {value!r:.60}")
    for i, p in enumerate(obj["problems"]):
        if not isinstance(p, Mapping):
            raise fail(f"problems[{i}] is not an object")
        missing = [k for k in PROBLEM_KEYS if k not in p]
        if missing:
            raise fail(f"problems[{i}] lacks {', '.join(missing)}")
        if not isinstance(p["completions"], list):
            raise fail(f"problems[{i}].completions must be a list")
        for j, c in enumerate(p["completions"]):
            if not isinstance(c, Mapping) or any(k not in c for k in COMPLETION_KEYS):
                raise fail(f"problems[{i}].completions[{j}] must be an object with keys {', '.join(COMPLETION_KEYS)}")
    return dict(obj)


def answer_rule(results: Mapping[str, Any]) -> str | None:
    """The rule that chose a results document's answers: the config's `selection` (the summary's
    `accuracy_rule` in documents that only record it there); None when neither does."""
    return results["config"].get("selection") or results["summary"].get("accuracy_rule")


def problems_from_results(results: Mapping[str, Any]) -> list[ProblemOutcome]:
    """ProblemOutcomes back from a results document (to recompute metrics, e.g. under another agg)."""
    validate_results(results)
    return problems_from_records(results["problems"])


def problems_from_records(records: Sequence[Mapping[str, Any]]) -> list[ProblemOutcome]:
    """ProblemOutcomes back from problem records (`problem_record`'s). Files written before
    records kept answer groups vote by the answers' stripped text."""
    return [
        ProblemOutcome(
            unique_id=p["unique_id"],
            level=p["level"],
            problem=p["problem"],
            answer=p["answer"],
            completions=[
                ScoredCompletion(
                    text=c["text"],
                    answer=c["answer"],
                    correct=bool(c["correct"]),
                    step_scores=[math.nan if s is None else float(s) for s in c["step_scores"]],
                    group=c.get("group"),
                )
                for c in p["completions"]
            ],
            pred=p["pred"],
            correct=bool(p["correct"]),
        )
        for p in records
    ]
