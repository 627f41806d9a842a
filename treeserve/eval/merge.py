"""`treeserve merge`: one results document from the shards of one run (`eval --shard i/k`; shard i holds
problems i, i+k, ...), interleaved back into dataset order. The summary is recomputed; counters and search
seconds are summed, so `problems_per_s` is per machine-second, not the shards' parallel wall time."""

from __future__ import annotations

from pathlib import Path

from treeserve.eval.journal import config_differences
from treeserve.eval.report import build_results, problems_from_records, read_results, write_results
from treeserve.eval.runner import parse_shard, summarize

PER_SHARD = ("shard", "num_problems")


def merge_results(paths: list[str | Path]) -> dict:
    """The merged document of one run's shard files (any order); else ValueError naming file and problem."""
    if not paths:
        raise ValueError("merge needs the shards' results files")
    by_index: dict[int, tuple[str, dict]] = {}
    counts = set()
    for path, doc in [(str(p), read_results(p)) for p in paths]:
        shard = doc["config"].get("shard")
        if not shard:
            raise ValueError(f"{path} is not a shard (its run had no --shard)")
        if "counters" not in doc:
            raise ValueError(f"{path} has no counters (written before treeserve could merge shards); run it again")
        index, count = parse_shard(shard)
        counts.add(count)
        if index in by_index:
            raise ValueError(f"{path} and {by_index[index][0]} are both shard {shard}: shards overlap")
        by_index[index] = (path, doc)
    if len(counts) > 1:
        raise ValueError(f"the files are shards of different splits: {sorted(f'k={k}' for k in counts)}")
    [count] = counts
    missing = [f"{i}/{count}" for i in range(count) if i not in by_index]
    if missing:
        raise ValueError(f"missing shards: {', '.join(missing)}")
    first_path, first = by_index[0]
    for i in range(1, count):
        path, doc = by_index[i]
        differences = config_differences(_common(first["config"]), _common(doc["config"]), f"in {first_path}", "here")
        if differences:
            raise ValueError(f"{path} comes from another run than {first_path}: {'; '.join(differences)}")

    total = sum(len(by_index[i][1]["problems"]) for i in range(count))
    seen: dict[str, str] = {}
    for i in range(count):
        path, doc = by_index[i]
        expected = len(range(i, total, count))
        if len(doc["problems"]) != expected:
            raise ValueError(
                f"{path} holds {len(doc['problems'])} problems; shard {i}/{count} of {total} has {expected}"
            )
        for p in doc["problems"]:
            uid = str(p["unique_id"])
            if uid in seen:
                raise ValueError(f"problem {uid!r} is in both {seen[uid]} and {path}: shards overlap")
            seen[uid] = path

    rows = [by_index[j % count][1]["problems"][j // count] for j in range(total)]
    counters: dict[str, int] = {}
    wall = 0.0
    for _, doc in by_index.values():
        wall += doc["summary"]["wall_time_s"]
        for k, v in doc["counters"].items():
            counters[k] = counters.get(k, 0) + v
    config = {
        **first["config"],
        "shard": None,
        "num_problems": total,
        "merged_from": [by_index[i][0] for i in range(count)],
    }
    stats, summary = summarize(counters, wall)
    document = build_results(config, problems_from_records(rows), stats, config["search"]["agg"])
    document["problems"] = rows
    document["summary"] |= summary | {"shards": count}
    document["counters"] = counters
    for key in ("memory", "quantization"):
        if key in first:
            document[key] = first[key]
    return document


def _common(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in PER_SHARD}


def merge_files(paths: list[str | Path], output: str | Path) -> Path:
    return write_results(merge_results(paths), output)
