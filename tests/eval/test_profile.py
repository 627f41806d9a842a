"""`treeserve profile` and `treeserve tune`: real sweeps on a tiny grid, the min-max rule, the settings file."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from treeserve.cli import main
from treeserve.runtime.model_settings import TUNED_KEYS, ModelSettings
from treeserve.runtime.tuner import GridPoint, choose, read_config

SMALL = [
    "--dataset",
    "arith:level=1,size=2,seed=0",
    "--n",
    "4",
    "--beam-width",
    "2",
    "--num-iterations",
    "3",
    "--dtype",
    "float32",
]


def test_profile_writes_runs_timelines_and_plots(tmp_path, capsys):
    out = tmp_path / "prof"
    args = [
        "profile",
        *SMALL,
        "--budgets",
        "12M,16M",
        "--splits",
        "0.5",
        "--max-num-seqs",
        "4,64",
        "--max-num-batched-tokens",
        "512",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    doc = json.loads((out / "profile.json").read_text())
    assert len(doc["runs"]) == 2 * 2 + 2  # every budget x (shared, 0.5), then the batch grid at one budget
    assert all(r["problems_per_min"] > 0 and r["error"] is None for r in doc["runs"])
    shared = doc["timelines"]["shared"]
    assert set(shared) == {"generator", "prm"} and shared["generator"][-1]["step"] == len(shared["generator"])
    for name in ("timeline", "budget", "split", "batch"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert "KV 12 MiB shared" in capsys.readouterr().out


def test_tune_writes_settings_that_eval_accepts(tmp_path):
    tuned, report = tmp_path / "tuned.json", tmp_path / "report.json"
    args = [
        "tune",
        *SMALL,
        "--kv-cache-memory",
        "12M",
        "--splits",
        "shared,0.5",
        "--max-num-seqs",
        "4,64",
        "--max-num-batched-tokens",
        "512",
        "--output",
        str(tuned),
        "--report",
        str(report),
    ]
    assert main(args) == 0
    config = read_config(str(tuned))
    grid = json.loads(report.read_text())
    assert len(grid["grid"]) == len(grid["min_scores"]) == 4 and all(m["error"] is None for m in grid["grid"])
    assert grid["min_scores"][[m == grid["choice"] for m in grid["grid"]].index(True)] == max(grid["min_scores"])
    chosen = grid["choice"]
    assert config["prm_kv_fraction"] == chosen["prm_kv_fraction"] and config["kv_cache_memory"] == 12 << 20
    assert config["engine_args"]["generator"]["max_num_seqs"] == chosen["max_num_seqs"]
    results = tmp_path / "results.json"
    assert main(["eval", *SMALL, "--config", str(tuned), "--output", str(results)]) == 0
    doc = json.loads(results.read_text())
    assert tuned_of(doc) == file_settings(config) and doc["config"]["prm"]["kv_fraction"] == config["prm_kv_fraction"]
    assert doc["memory"]["kv_bytes"] == 12 << 20
    # a budget flag replaces the file's budget (any kind); the file's other settings still apply
    assert main(["eval", *SMALL, "--config", str(tuned), "--memory-budget", "600M", "--output", str(results)]) == 0
    doc = json.loads(results.read_text())
    assert doc["memory"]["budget"] == 600 << 20 and tuned_of(doc) == file_settings(config)


def tuned_of(doc: dict) -> dict:
    """Each model's batch settings a results file records."""
    return {name: _batch(doc["config"][name]) for name in ("generator", "prm")}


def file_settings(config: dict) -> dict:
    """Each model's batch settings a tune settings file gives (flat, as it writes them)."""
    return {name: _batch(asdict(ModelSettings.from_flat("m", **args))) for name, args in config["engine_args"].items()}


def _batch(section: dict) -> dict:
    return {
        k: v for group in ("scheduler_config", "cache_config") for k, v in section[group].items() if k in TUNED_KEYS
    }


def test_min_max_rule_picks_the_best_worst_model():
    points = [
        GridPoint(0.1, {}, generator_throughput=100, prm_throughput=5, problems_per_min=1),  # min(1.0, 0.5)
        GridPoint(0.5, {}, generator_throughput=70, prm_throughput=10, problems_per_min=1),  # min(0.7, 1.0)
        GridPoint(None, {}, generator_throughput=90, prm_throughput=8, problems_per_min=1),  # min(0.9, 0.8)
    ]
    best, scores = choose(points)
    assert best is points[2] and scores == pytest.approx([0.5, 0.7, 0.8])
    with pytest.raises(ValueError, match="empty"):
        choose([])


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"bogus": 1}', "unknown keys"),
        ("not json", "not JSON"),
        ('{"engine_args": {"critic": {}}}', "engine_args must map"),
        ('{"engine_args": {"prm": {"max_num_seqs": 4, "temperature": 1}}}', "engine_args must map"),
    ],
)
def test_bad_settings_files_are_refused(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["eval", *SMALL, "--config", str(path)]) == 2
    assert message in capsys.readouterr().err
