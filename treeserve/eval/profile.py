"""`treeserve profile` and `treeserve tune` (thesis chapter 6): real `run_eval`s of arithmetic beam search
per memory layout (a shared arena or a static PRM share) and batch setting, each reduced to a
`Measurement`; throughputs are tokens per second of that model's step time. `tune` picks by
`treeserve.runtime.tuner`'s min-max rule."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from treeserve.config import SchedulerConfig
from treeserve.eval.runner import EvalSettings, load_problems, run_eval
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.tuner import GridPoint, choose
from treeserve.search.config import SearchConfig

DEFAULT_SPLITS = (0.1, 0.2, 0.3, 0.5, 0.7)
DEFAULT_BATCH = ((32, 512), (64, 1024), (256, 2048))  # (max_num_seqs, max_num_batched_tokens)


@dataclass
class Measurement:
    kv_cache_memory: int
    prm_kv_fraction: float | None  # None: one shared arena
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    problems_per_min: float
    accuracy: float
    generator_throughput: float
    prm_throughput: float
    generator_hit_rate: float
    prm_hit_rate: float
    evictions: int
    thrash: int
    preemptions: int
    error: str | None = None  # the setting cannot run (e.g. a share too small for one sequence)

    @property
    def engine_args(self) -> dict:
        if self.max_num_seqs is None:
            return {}
        return batch_engine_args((self.max_num_seqs, self.max_num_batched_tokens))

    @property
    def label(self) -> str:
        return "shared" if self.prm_kv_fraction is None else f"prm {self.prm_kv_fraction:g}"


def batch_engine_args(batch: tuple[int, int]) -> dict:
    """Per-model engine settings giving both models `batch` = (max_num_seqs, max_num_batched_tokens)."""
    one = {"max_num_seqs": batch[0], "max_num_batched_tokens": batch[1]}
    return {"generator": dict(one), "prm": dict(one)}


def batched(model: ModelSettings, batch: tuple[int, int] | None) -> ModelSettings:
    """`model` at `batch` = (max_num_seqs, max_num_batched_tokens), None: the defaults; its page size the role's."""
    seqs, tokens = batch or (SchedulerConfig.max_num_seqs, SchedulerConfig.max_num_batched_tokens)
    scheduler = replace(model.scheduler_config, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    return replace(model, scheduler_config=scheduler, cache_config=replace(model.cache_config, page_size=None))


def measure(
    settings: EvalSettings,
    config: SearchConfig,
    kv_cache_memory: int,
    prm_kv_fraction: float | None,
    batch: tuple[int, int] | None = None,
    records: list[dict] | None = None,
) -> tuple[Measurement, dict]:
    """One run; returns its measurement and the whole results document."""
    arena = replace(settings.runtime.arena_config, kv_cache_memory=kv_cache_memory)
    run = replace(
        settings,
        progress=False,
        runtime=replace(settings.runtime, arena_config=arena, memory_budget=None, memory_fraction=None),
        generator=batched(settings.generator, batch),
        prm=settings.prm and replace(batched(settings.prm, batch), kv_fraction=prm_kv_fraction),
    )
    try:
        doc = run_eval(run, config, inline=records)
    except ValueError as e:  # refused at load time: counts as zero throughput
        zero = Measurement(
            kv_cache_memory,
            prm_kv_fraction,
            *(batch or (None, None)),
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0.0,
            0,
            0,
            0,
            error=str(e),
        )
        return zero, {"page_logs": {}}
    s = doc["summary"]
    m = Measurement(
        kv_cache_memory=kv_cache_memory,
        prm_kv_fraction=prm_kv_fraction,
        max_num_seqs=batch[0] if batch else None,
        max_num_batched_tokens=batch[1] if batch else None,
        problems_per_min=s["problems_per_s"] * 60,
        accuracy=s["accuracy"],
        generator_throughput=s["generated_tokens"] / max(s["generator_busy_s"], 1e-9),
        prm_throughput=s.get("prm_computed_tokens", 0) / max(s.get("prm_busy_s", 0.0), 1e-9),
        generator_hit_rate=s["generator_prefix_hit_rate"],
        prm_hit_rate=s.get("prm_prefix_hit_rate", 0.0),
        evictions=s["generator_evictions"] + s.get("prm_evictions", 0),
        thrash=s["generator_thrash"] + s.get("prm_thrash", 0),
        preemptions=s["generator_preemptions"] + s.get("prm_preemptions", 0),
    )
    return m, doc


def profile(
    settings: EvalSettings,
    config: SearchConfig,
    budgets: list[int],
    splits: list[float],
    batches: list[tuple[int, int]],
    out_dir: str,
    progress: bool = True,
) -> dict:
    """The sweeps of `treeserve profile`; writes profile.json and the plots into `out_dir`."""
    from treeserve.eval.profile_plots import plot_all

    records = load_problems(settings)
    timeline_budget = budgets[len(budgets) // 2]
    runs: list[Measurement] = []
    timelines: dict[str, dict] = {}

    def note(m: Measurement) -> None:
        runs.append(m)
        if progress and m.error:
            print(f"  KV {m.kv_cache_memory / (1 << 20):g} MiB {m.label}: cannot run: {m.error}", flush=True)
        elif progress:
            batch = "" if m.max_num_seqs is None else f" seqs {m.max_num_seqs} tokens {m.max_num_batched_tokens}"
            print(
                f"  KV {m.kv_cache_memory / (1 << 20):g} MiB {m.label}{batch}: {m.problems_per_min:.1f} problems/min, "
                f"hit gen {m.generator_hit_rate:.2f} prm {m.prm_hit_rate:.2f}, thrash {m.thrash}",
                flush=True,
            )

    quantization = None  # what each model ran with, from the first run that loaded them
    for budget in budgets:
        for split in [None, *splits]:
            m, doc = measure(
                replace(settings, page_logs=budget == timeline_budget), config, budget, split, records=records
            )
            note(m)
            quantization = quantization or doc.get("quantization")
            if budget == timeline_budget and split in (None, 0.3) and not m.error:
                timelines[m.label] = doc["page_logs"]
    for batch in batches:
        note(measure(settings, config, timeline_budget, None, batch, records)[0])
    result = {
        "config": {
            "search": asdict(config),
            "dataset": settings.dataset,
            "num_problems": len(records),
            "budgets": budgets,
            "splits": splits,
            "batches": batches,
            "timeline_budget": timeline_budget,
            "quantization": quantization,
        },
        "runs": [asdict(m) for m in runs],
        "timelines": timelines,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(result))
    result["plots"] = [str(p) for p in plot_all(result, out)]
    return result


def tune(
    settings: EvalSettings,
    config: SearchConfig,
    kv_cache_memory: int,
    splits: list[float | None],
    batches: list[tuple[int, int]],
    progress: bool = True,
) -> tuple[Measurement, list[Measurement], list[float]]:
    """Measure every (split, batch) and pick by the min-max rule: (choice, measurements, normalised min scores)."""
    records = load_problems(settings)
    grid: list[Measurement] = []
    for split in splits:
        for batch in batches:
            m = measure(settings, config, kv_cache_memory, split, batch, records)[0]
            grid.append(m)
            if progress:
                print(
                    f"  {m.label} seqs {batch[0]} tokens {batch[1]}: generator {m.generator_throughput:.0f} tok/s, "
                    f"PRM {m.prm_throughput:.0f} tok/s, {m.problems_per_min:.1f} problems/min",
                    flush=True,
                )
    points = [
        GridPoint(m.prm_kv_fraction, m.engine_args, m.generator_throughput, m.prm_throughput, m.problems_per_min)
        for m in grid
    ]
    best, scores = choose(points)
    return grid[points.index(best)], grid, scores
