"""One evaluation run: dataset -> runtime (generator + PRM) -> search -> grading -> results JSON.

Everything that can be wrong with the inputs (dataset lines, strategy, n vs beam width,
model directories) is checked before any model is loaded or any problem is searched.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from treeserve.config import check_model_path
from treeserve.device import resolve_attention_backend, resolve_device
from treeserve.eval.datasets import load_dataset
from treeserve.eval.grading import Grader
from treeserve.eval.report import RunStats, build_results, grade_problems
from treeserve.runtime.runtime import Runtime, per_model_engine_args
from treeserve.search.context import SearchConfig, SearchContext
from treeserve.search.prm import load_prm
from treeserve.search.run import ProblemResult, search_problems

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_GENERATOR = str(ASSETS / "arith-generator")
DEFAULT_PRM = str(ASSETS / "arith-prm")

# how each strategy picks its final answer from its completions (all three are reported)
SELECTION = {
    "best_of_n": "naive",
    "weighted_best_of_n": "weighted",
    "majority": "majority",
    "beam_search": "weighted",
    "dvts": "weighted",
}


@dataclass
class EvalSettings:
    dataset: str = "arith:level=4,5,size=40,seed=0"
    generator: str = DEFAULT_GENERATOR
    prm: str = DEFAULT_PRM
    prm_style: str | None = None
    dtype: str = "bfloat16"
    device: str | None = None  # None: cuda when torch sees a GPU, else cpu
    attention_backend: str | None = None  # None: the device's default (triton on CUDA, cpu on a CPU)
    kv_cache_memory: int | None = None  # KV bytes (1 GiB when no budget below is given either)
    memory_budget: int | None = None  # bytes for weights + activations + KV (see runtime/planner.py)
    memory_fraction: float | None = None  # of the memory free at start, for everything
    prm_kv_fraction: float | None = None  # None: one page arena shared by both models; else a static split
    engine_args: dict | None = None  # per-model engine settings, {"generator": {...}, "prm": {...}} (from `tune`)
    quantization: str | None = None  # the generator's: "int8" (a Hugging Face checkpoint), "gguf" (a GGUF file's own)
    prm_quantization: str | None = None  # the PRM's, likewise
    dequantize: bool = False  # load GGUF files dense
    memory_report: str | None = None  # write the memory plan (JSON) here
    page_logs: bool = False  # put every engine's per-step page statistics in the results
    reference: bool = False
    limit: int | None = None  # only the first `limit` problems
    selection: str | None = None  # override SELECTION[strategy]
    progress: bool = True

    def check(self) -> None:
        self.device = resolve_device(self.device)  # resolved, so results record what ran
        self.attention_backend = resolve_attention_backend(self.attention_backend, self.device)
        for name, path in (("generator", self.generator), ("prm", self.prm)):
            check_model_path(str(path), f"{name} model")
        if self.prm_kv_fraction is not None and not 0.0 < self.prm_kv_fraction < 1.0:
            raise ValueError(f"prm_kv_fraction must be in (0, 1), got {self.prm_kv_fraction}")


def build_runtime(settings: EvalSettings, config: SearchConfig) -> Runtime:
    prm = settings.prm if config.strategy != "majority" else None
    engine_args = per_model_engine_args(
        settings.engine_args, settings.quantization, settings.prm_quantization, settings.dequantize
    )
    return Runtime.for_search(
        settings.generator, prm, settings.kv_cache_memory, settings.prm_kv_fraction, engine_args,
        dtype=settings.dtype, enable_prefix_caching=config.prefix_cache, memory_budget=settings.memory_budget,
        memory_fraction=settings.memory_fraction, device=settings.device, attention_backend=settings.attention_backend,
    )  # fmt: skip


def run_eval(settings: EvalSettings, config: SearchConfig, inline: list[dict] | None = None) -> dict:
    """Search and grade `settings.dataset` (or the `inline` records) and return the results document."""
    records = load_problems(settings, inline)
    if settings.reference:
        config = config.reference()
    runtime = build_runtime(settings, config)
    if settings.memory_report:
        runtime.memory_plan.write(settings.memory_report)
    if settings.progress:
        print(runtime.memory_plan.table(), file=sys.stderr)
    prm = load_prm(runtime, "prm", settings.prm_style) if "prm" in runtime.engines else None
    ctx = SearchContext(config, runtime, "generator", prm)
    start = time.perf_counter()
    results = asyncio.run(_search(ctx, records, settings.progress))
    wall = time.perf_counter() - start
    runtime.check_pages_idle()

    completions = [[(b.text, b.scores) for b in r.beams] for r in results]
    stats, summary = summarize(run_counters(runtime, ctx), wall)
    results = grade_and_report(settings, config, records, completions, stats, summary)
    results["memory"] = runtime.memory_plan.to_json()
    results["quantization"] = {name: engine.quantization for name, engine in runtime.engines.items()}
    if settings.page_logs:
        results["page_logs"] = {name: engine.page_log.rows() for name, engine in runtime.engines.items()}
    return results


def load_problems(settings: EvalSettings, inline: list[dict] | None = None) -> list[dict]:
    """The records a run searches (`inline` or the dataset, cut to `settings.limit`), after
    checking the settings; raises before any model is loaded."""
    settings.check()
    records = (inline if inline is not None else load_dataset(settings.dataset))[: settings.limit]
    if not records:
        raise ValueError(f"dataset {settings.dataset!r} has no problems")
    return records


def grade_and_report(
    settings: EvalSettings,
    config: SearchConfig,
    records: list[dict],
    completions: list[list[tuple[str, list[float]]]],
    stats: RunStats,
    extra_summary: dict,
    extra_config: dict | None = None,
) -> dict:
    """Grade the completions of every record and build the results document."""
    with Grader() as grader:
        outcomes = grade_problems(
            records, completions, grader, selection=settings.selection or SELECTION[config.strategy], agg=config.agg
        )
    run_config = {
        "search": asdict(config),
        **{k: v for k, v in asdict(settings).items() if k != "progress"},
        "selection": settings.selection or SELECTION[config.strategy],
        "num_problems": len(records),
        **(extra_config or {}),
    }
    document = build_results(run_config, outcomes, stats, agg=config.agg)
    document["summary"].update(extra_summary)
    return document


async def _search(ctx: SearchContext, records: list[dict], progress: bool) -> list[ProblemResult]:
    bar = tqdm(total=len(records), unit="problem", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    engine = ctx.runtime.engines["generator"]

    def done(result: ProblemResult) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{engine.num_generated_tokens / (time.perf_counter() - start):.0f} tok/s")

    try:
        return await search_problems(ctx, [(r["unique_id"], r["problem"]) for r in records], done)
    finally:
        bar.close()
        await ctx.runtime.close()


def run_counters(runtime: Runtime, ctx: SearchContext) -> dict[str, int]:
    """Everything a run (or one Ray worker of it) has done, as counts that add up across workers."""
    out = {
        "score_cache_hits": ctx.cache.hits,
        "score_cache_misses": ctx.cache.misses,
        "prm_requests": ctx.prm_requests,
        "prm_unique_tokens": len(ctx.prm_tree),
    }
    for name, engine in runtime.engines.items():
        stats = engine.blocks.stats
        out |= {f"{name}_prefix_hits": stats.hits, f"{name}_prefix_misses": stats.misses}
        out |= {f"{name}_evictions": stats.evictions, f"{name}_thrash": stats.thrash}
        out |= {f"{name}_preemptions": engine.scheduler.num_preemptions, f"{name}_steps": runtime.steps[name]}
        out[f"{name}_generated_tokens"] = engine.num_generated_tokens
        out[f"{name}_computed_tokens"] = engine.num_computed_tokens
        out[f"{name}_busy_ms"] = round(runtime.busy_s[name] * 1000)  # time inside its steps
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
    for name in ("generator", "prm"):
        if f"{name}_steps" in counters:
            summary[f"{name}_prefix_hit_rate"] = _hit_rate(counters, name)
            summary |= {f"{name}_{k}": counters[f"{name}_{k}"] for k in ("evictions", "thrash", "preemptions", "steps")}
            summary[f"{name}_computed_tokens"] = counters[f"{name}_computed_tokens"]
            summary[f"{name}_busy_s"] = counters[f"{name}_busy_ms"] / 1000
    return stats, summary


def _hit_rate(counters: dict[str, int], engine: str) -> float:
    hits, misses = counters[f"{engine}_prefix_hits"], counters[f"{engine}_prefix_misses"]
    return hits / (hits + misses) if hits + misses else 0.0
