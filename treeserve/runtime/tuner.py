"""The min-max tuner's rule (thesis section 7.2) and its settings file (`--config`).

Pick the KV split and batch setting under which the slower model is fastest:
argmax over the grid of min(T_LLM / best T_LLM, T_PRM / best T_PRM), each throughput divided
by its own best (they count different tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from treeserve.config import VLLM_NAMES
from treeserve.runtime.model_settings import TUNED_KEYS

CONFIG_KEYS = {"kv_cache_memory", "memory_budget", "memory_fraction", "prm_kv_fraction", "engine_args"}


@dataclass
class GridPoint:
    prm_kv_fraction: float | None  # None: the shared arena
    engine_args: dict  # {"generator": {...}, "prm": {...}}
    generator_throughput: float  # generated tokens / s of generator step time
    prm_throughput: float  # PRM tokens computed / s of PRM step time
    problems_per_min: float  # reported, not used by the rule


def choose(points: list[GridPoint]) -> tuple[GridPoint, list[float]]:
    """The min-max choice among `points` and every point's normalised min score."""
    if not points:
        raise ValueError("the tuning grid is empty")
    best_gen = max(p.generator_throughput for p in points) or 1.0
    best_prm = max(p.prm_throughput for p in points) or 1.0
    scores = [min(p.generator_throughput / best_gen, p.prm_throughput / best_prm) for p in points]
    return points[max(range(len(points)), key=scores.__getitem__)], scores


def write_config(path: str, kv_cache_memory: int, prm_kv_fraction: float | None, engine_args: dict) -> dict:
    config = {"kv_cache_memory": kv_cache_memory, "prm_kv_fraction": prm_kv_fraction, "engine_args": engine_args}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return config


def read_config(path: str) -> dict:
    """A settings file (`treeserve tune`'s, or by hand): only the known keys."""
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"settings file not found: {path!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"settings file {path!r} is not JSON: {e}") from None
    if not isinstance(config, dict) or set(config) - CONFIG_KEYS:
        unknown = sorted(set(config) - CONFIG_KEYS) if isinstance(config, dict) else config
        raise ValueError(f"settings file {path!r} has unknown keys {unknown}; known: {sorted(CONFIG_KEYS)}")
    args = config.get("engine_args") or {}
    allowed = set(TUNED_KEYS)
    for model, settings in args.items():
        if isinstance(settings, dict):  # a file written before pages were named pages
            args[model] = settings = {VLLM_NAMES.get(k, k): v for k, v in settings.items()}
        if model not in ("generator", "prm") or not isinstance(settings, dict) or set(settings) - allowed:
            raise ValueError(f"settings file {path!r}: engine_args must map generator/prm to {sorted(allowed)}")
    return config
