"""One evaluation run: dataset -> runtime (generator, PRM, verifier) -> search -> grading ->
results JSON. Bad inputs are refused before any model loads.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from treeserve.eval.datasets import load_dataset
from treeserve.eval.grading import Grader, extract_answer
from treeserve.eval.journal import Journal, journal_path
from treeserve.eval.metrics import DEFAULT_SELECTION, SELECTIONS
from treeserve.eval.report import (
    RunStats,
    build_results,
    grade_problems,
    problem_record,
    problems_from_records,
    write_results,
)
from treeserve.models.tokenizer import Tokenizer
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime import Runtime
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import check_verifier, load_prm
from treeserve.search.reasoning import check_generator
from treeserve.search.run import ProblemResult, search_problems
from treeserve.search.types import Problem

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_GENERATOR = str(ASSETS / "arith-generator")
DEFAULT_PRM = str(ASSETS / "arith-prm")


@dataclass
class EvalSettings:
    dataset: str = "arith:level=4,5,size=40,seed=0"
    generator: ModelSettings = field(default_factory=lambda: ModelSettings(DEFAULT_GENERATOR))
    prm: ModelSettings | None = field(default_factory=lambda: ModelSettings(DEFAULT_PRM))  # None: majority only
    verifier: ModelSettings | None = None  # an outcome RM re-ranking every strategy's completions
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    memory_report: str | None = None
    page_logs: bool = False
    reference: bool = False
    limit: int | None = None
    shard: str | None = None  # "i/k": of those, problems i, i+k, i+2k, ... (`treeserve merge` joins shards)
    selection: str | None = None
    progress: bool = True

    def answer_rule(self, strategy: str) -> str:
        """The selection that picks each problem's answer (`--select`, else the strategy's default)."""
        return self.selection or DEFAULT_SELECTION[strategy]

    def check(self) -> None:
        self.runtime.check(self.generator, self.prm, self.verifier)
        if self.verifier is not None:
            check_verifier(self.verifier.path, self.verifier.style)
        if self.shard is not None:
            parse_shard(self.shard)
        if self.selection is not None and self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")


def runtime_settings(settings: EvalSettings) -> RuntimeSettings:
    """The runtime's settings as the run uses them: the reference path has no prefix cache."""
    if not settings.reference:
        return settings.runtime
    return replace(settings.runtime, arena_config=replace(settings.runtime.arena_config, enable_prefix_caching=False))


def build_runtime(settings: EvalSettings, config: SearchConfig) -> Runtime:
    prm = settings.prm if config.strategy != "majority" else None
    if config.strategy != "majority" and prm is None:
        raise ValueError(f"strategy {config.strategy!r} needs a PRM")
    return runtime_settings(settings).load(settings.generator, prm, settings.verifier)


def search_context(
    settings: EvalSettings, config: SearchConfig, runtime: Runtime, grader: Grader, kinds: dict[str, str]
) -> SearchContext:
    """A run's context over `runtime` (`build_runtime`'s): its PRM and verifier adapters, and
    adaptive search's answer keys by `grader` for the problems' `kinds` (unique id -> kind)."""
    prm = load_prm(runtime, "prm", settings.prm.style) if "prm" in runtime.engines else None
    verifier = load_prm(runtime, "verifier", settings.verifier.style) if settings.verifier else None
    answers = answer_rule(grader, kinds, config.reasoning)
    return SearchContext(config, runtime, "generator", prm, verifier=verifier, answer_of=answers)


def check_reasoning(settings: EvalSettings, config: SearchConfig) -> None:
    """With `config.reasoning`, refuse a generator without think tokens before any weights load."""
    if config.reasoning:
        check_generator(Tokenizer(str(settings.generator.path)))


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped a run before every problem was done; the finished ones are in
    its journal, and running the same command again resumes it."""

    def __init__(self, signum: int, done: int, total: int, journal: Path | None) -> None:
        self.signum, self.done, self.total, self.journal = signum, done, total, journal
        kept = f"kept in {journal}" if journal else "not kept: the run has no --output"
        super().__init__(f"stopped by {signal.Signals(signum).name} with {done} of {total} problems done ({kept})")


def run_eval(
    settings: EvalSettings,
    config: SearchConfig,
    inline: list[dict] | None = None,
    output: str | Path | None = None,
    resume: bool = False,
    grace: float | None = None,
) -> dict:
    """Search and grade `settings.dataset` (or `inline` records); the results document. With
    `output`, finished problems go to its journal, an earlier run's journal is resumed (`resume`
    demands one) and the document is written there. With `grace`, SIGINT/SIGTERM give problems
    in flight `grace` seconds, then raise `Interrupted`."""
    records = load_problems(settings, inline)
    check_reasoning(settings, config)
    if settings.reference:
        config = config.reference()
    journal, todo = open_journal(settings, run_config(settings, config, records), records, output, resume)
    extra: dict = {}
    stopped = None
    if todo:
        kinds = {str(r["unique_id"]): r.get("grader", "math") for r in todo}
        with Grader() as grader:
            if "math" in kinds.values():
                grader.start()  # its workers start while the models load
            runtime = build_runtime(settings, config)
            if settings.memory_report:
                runtime.memory_plan.write(settings.memory_report)
            if settings.progress:
                print(runtime.memory_plan.table(), file=sys.stderr)
            ctx = search_context(settings, config, runtime, grader, kinds)
            recorder = Recorder(
                journal,
                grader,
                settings.answer_rule(config.strategy),
                config.agg,
                lambda: run_counters(runtime, ctx),
                reasoning=config.reasoning,
            )
            stopped = asyncio.run(_search(ctx, todo, recorder, settings.progress, grace))
        runtime.check_pages_idle()
        extra["memory"] = runtime.memory_plan.to_json()
        extra["quantization"] = {name: engine.quantization for name, engine in runtime.engines.items()}
        if settings.page_logs:
            extra["page_logs"] = {name: engine.page_log.rows() for name, engine in runtime.engines.items()}
    return finish(journal, records, config.agg, output, sections=extra, stopped=stopped)


def open_journal(
    settings: EvalSettings, config: dict, records: list[dict], output: str | Path | None, resume: bool
) -> tuple[Journal, list[dict]]:
    """The run's journal (next to `output`, or in memory) and the records it has not finished."""
    journal = Journal.open(journal_path(output) if output else None, config, resume)
    todo = [r for r in records if str(r["unique_id"]) not in journal.records]
    if journal.records and settings.progress:
        print(
            f"treeserve: resuming {journal.path}: {len(records) - len(todo)} of {len(records)} problems done",
            file=sys.stderr,
        )
    return journal, todo


def load_problems(settings: EvalSettings, inline: list[dict] | None = None) -> list[dict]:
    """The records a run searches (`inline` or the dataset, cut to `settings.limit`, then to
    `settings.shard`), after checking the settings; raises before any model is loaded."""
    settings.check()
    records = (inline if inline is not None else load_dataset(settings.dataset))[: settings.limit]
    if settings.shard:
        index, count = parse_shard(settings.shard)
        records = records[index::count]
    if not records:
        where = f" in shard {settings.shard}" if settings.shard else ""
        raise ValueError(f"dataset {settings.dataset!r} has no problems{where}")
    return records


def parse_shard(text: str) -> tuple[int, int]:
    """`i/k` -> (i, k): the i-th of k strided slices (problems i, i+k, i+2k, ...), 0 <= i < k."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be i/k with whole numbers, e.g. 0/4; got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard i/k needs k >= 1 and 0 <= i < k; got {text!r}")
    return index, count


def run_config(settings: EvalSettings, config: SearchConfig, records: list[dict], extra: dict | None = None) -> dict:
    """The results document's "config": what ran, on how many problems: the settings (each
    model's a section of its own, the runtime's sub-configs beside them), the search's nested."""
    own = {k: v for k, v in asdict(settings).items() if k not in ("progress", "runtime")}
    return {
        "search": asdict(config),
        **own,
        **asdict(runtime_settings(settings)),
        "selection": settings.answer_rule(config.strategy),
        "num_problems": len(records),
        **(extra or {}),
    }


@dataclass
class Recorder:
    """Grades each problem as its search finishes and writes its record to the run's journal,
    with the run's counters at that moment (`counters()`)."""

    journal: Journal
    grader: Grader
    selection: str
    agg: str
    counters: Callable[[], dict[str, int]]
    reasoning: bool = False
    start: float = field(default_factory=time.perf_counter)

    def add(
        self,
        record: dict,
        completions: list[tuple[str, list[float]]],
        trace: dict | None = None,
        extra: dict | None = None,
    ) -> None:
        """`extra`: the search's own record of the problem (tokens spent; adaptive: its stop)."""
        [outcome] = grade_problems(
            [record], [completions], self.grader, selection=self.selection, agg=self.agg, reasoning=self.reasoning
        )
        row = problem_record(outcome, self.agg) | {k: v for k, v in (extra or {}).items() if v is not None}
        if trace is not None:
            row["trace"] = trace
        self.journal.add(row, time.perf_counter() - self.start, self.counters())


def finish(
    journal: Journal,
    records: list[dict],
    agg: str,
    output: str | Path | None = None,
    extra_summary: dict | None = None,
    sections: dict | None = None,
    stopped: int | None = None,
) -> dict:
    """The results document from the journal (with `output`, written there and the journal
    removed); `Interrupted` when a problem is missing (the run was stopped by `stopped`)."""
    if len(journal.records) < len(records):
        journal.close()
        raise Interrupted(stopped or signal.SIGINT, len(journal.records), len(records), journal.path)
    wall, counters = journal.totals()
    rows = [journal.records[str(r["unique_id"])] for r in records]
    stats, summary = summarize(counters, wall)
    document = build_results(journal.config, problems_from_records(rows), stats, agg)
    document["problems"] = rows
    document["summary"] |= summary | (extra_summary or {}) | {"sessions": len(journal.sessions)}
    document["counters"] = counters
    document |= sections or {}
    if output is not None:
        write_results(document, output)
    journal.close(remove=output is not None)  # only once the results are written
    return document


async def _search(
    ctx: SearchContext, records: list[dict], recorder: Recorder, progress: bool, grace: float | None
) -> int | None:
    """Search `records`, each recorded as it finishes; the signal that stopped the run, or None."""
    bar = tqdm(total=len(records), unit="problem", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    engine = ctx.runtime.engines["generator"]
    by_uid = {str(r["unique_id"]): r for r in records}

    def done(result: ProblemResult) -> None:
        recorder.add(
            by_uid[result.uid],
            [(b.text, b.scores) for b in result.beams],
            result.trace,
            {"spent": result.spent, "stop": result.stop},
        )
        bar.update(1)
        bar.set_postfix_str(f"{engine.num_generated_tokens / (time.perf_counter() - start):.0f} tok/s")

    stop = asyncio.Event()
    task = asyncio.ensure_future(search_problems(ctx, [(uid, r["problem"]) for uid, r in by_uid.items()], done, stop))
    caught: list[int] = []
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if caught:
            task.cancel()
            return
        caught.append(signum)
        stop.set()
        tqdm.write(
            f"treeserve: {signal.Signals(signum).name}: admitting no more problems; those in flight get "
            f"{grace:g} s to finish (signal again to stop now)",
            file=sys.stderr,
        )
        loop.call_later(grace, task.cancel)

    signals = (signal.SIGINT, signal.SIGTERM) if grace is not None else ()
    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await task
    except asyncio.CancelledError:
        if not caught:
            raise
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        bar.close()
        await ctx.runtime.close()
    return caught[0] if caught else None


def answer_rule(grader: Grader, kinds: dict[str, str], reasoning: bool = False) -> Callable[[Problem, str], str | None]:
    """Adaptive search's answer key of a completion: its last `\\boxed{}` (with `reasoning`, after
    `</think>`) under the grader's equivalence for its problem's kind (`kinds`: unique id -> arith
    or math), as voting groups it."""

    def key(problem: Problem, text: str) -> str | None:
        answer = extract_answer(text, reasoning)
        return None if answer is None else grader.answer_keys([answer], kinds.get(problem.uid, "math"))[0]

    return key


def run_counters(runtime: Runtime, ctx: SearchContext) -> dict[str, int]:
    """Everything a run (or one Ray worker of it) has done, as counts that add up across workers."""
    out = {
        "score_cache_hits": ctx.cache.hits,
        "score_cache_misses": ctx.cache.misses,
        "prm_requests": ctx.prm_requests,
        "prm_unique_tokens": len(ctx.prm_tree),
        "lookahead_generated_tokens": ctx.lookahead_generated_tokens,  # rollouts' (text discarded)
        "lookahead_prm_tokens": ctx.lookahead_prm_tokens,  # rollout steps' share of PRM inputs
    }
    for name, engine in runtime.engines.items():
        stats = engine.pages.stats
        out |= {f"{name}_prefix_hits": stats.hits, f"{name}_prefix_misses": stats.misses}
        out[f"{name}_prefix_tail_hits"] = stats.tail_hits  # part-written last pages read, not recomputed
        out |= {f"{name}_evictions": stats.evictions, f"{name}_thrash": stats.thrash}
        out |= {f"{name}_preemptions": engine.scheduler.num_preemptions, f"{name}_steps": runtime.steps[name]}
        out[f"{name}_generated_tokens"] = engine.num_generated_tokens
        out[f"{name}_computed_tokens"] = engine.num_computed_tokens
        out[f"{name}_busy_ms"] = round(runtime.busy_s[name] * 1000)
        if engine.speculator is not None:
            spec = engine.speculator.stats
            out[f"{name}_spec_drafts"] = spec.num_drafts
            out[f"{name}_spec_draft_tokens"] = spec.num_draft_tokens
            out[f"{name}_spec_accepted_tokens"] = spec.num_accepted_tokens
    return out


def summarize(counters: dict[str, int], wall: float) -> tuple[RunStats, dict]:
    """The run's stats and the summary's cache/engine fields, from (summed) `run_counters`."""
    stats = RunStats(
        wall_time_s=wall,
        generated_tokens=counters["generator_generated_tokens"],
        prm_tokens_prefilled=counters.get("prm_computed_tokens", 0),
        prm_unique_tokens=counters["prm_unique_tokens"],
        prefix_hit_rate=_hit_rate(counters, "generator"),
    )
    summary = {k: counters[k] for k in ("score_cache_hits", "score_cache_misses", "prm_requests")}
    summary |= {k: counters.get(k, 0) for k in ("lookahead_generated_tokens", "lookahead_prm_tokens")}
    for name in ("generator", "prm"):
        if f"{name}_steps" in counters:
            summary[f"{name}_prefix_hit_rate"] = _hit_rate(counters, name)
            summary |= {f"{name}_{k}": counters[f"{name}_{k}"] for k in ("evictions", "thrash", "preemptions", "steps")}
            summary[f"{name}_computed_tokens"] = counters[f"{name}_computed_tokens"]
            summary[f"{name}_busy_s"] = counters[f"{name}_busy_ms"] / 1000
        if f"{name}_spec_drafts" in counters:
            drafts, drafted, accepted = (
                counters[f"{name}_spec_{k}"] for k in ("drafts", "draft_tokens", "accepted_tokens")
            )
            summary[f"{name}_spec_draft_tokens"] = drafted
            summary[f"{name}_spec_accepted_tokens"] = accepted
            summary[f"{name}_spec_acceptance_rate"] = accepted / drafted if drafted else 0.0
            summary[f"{name}_spec_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
    # what accuracy is plotted against (treeserve plot): every token both models ran
    summary["computed_tokens"] = sum(counters.get(f"{name}_computed_tokens", 0) for name in ("generator", "prm"))
    return stats, summary


def _hit_rate(counters: dict[str, int], engine: str) -> float:
    hits, misses = counters[f"{engine}_prefix_hits"], counters[f"{engine}_prefix_misses"]
    return hits / (hits + misses) if hits + misses else 0.0
