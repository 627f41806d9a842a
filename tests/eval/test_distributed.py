"""`treeserve eval --workers N` on a local Ray cluster (2 CPUs, 2 workers of 1 CPU each).

The distributed run must write the single-process run's results: the same completions, step
scores (within 1e-5: batch shapes differ, as between the optimised and reference paths) and
answers, every problem exactly once, also when a worker dies mid-run. Each worker checks its
pages when it closes (every page free or cached), and the single-process run checks its own.
"""

from __future__ import annotations

import json
import sys

import pytest

from treeserve.cli import main
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig

DATASET = "arith:level=4,5,size=6,seed=0"  # the shipped arithmetic generator and PRM
FLAGS = ["--n", "4", "--beam-width", "2", "--dtype", "float32", "--kv-cache-memory", str(64 << 20)]
QUALITY = ("accuracy", "accuracy_by_level", "naive@n", "weighted@n", "majority@n", "pass@N", "generated_tokens")


def settings() -> EvalSettings:
    return EvalSettings(
        dataset=DATASET, runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20), progress=False
    )


def config() -> SearchConfig:
    return SearchConfig(strategy="beam_search", n=4, beam_width=2)


def signature(doc: dict, approx: bool = False) -> list:
    """Problems, picks and completion texts; with `approx`, step scores to match within 1e-5
    (rounding both sides instead flips at a rounding boundary now and then)."""

    def scores(values: list[float]):
        return pytest.approx(values, abs=1e-5) if approx else values

    return [
        (p["unique_id"], p["pred"], [(c["text"], scores(c["step_scores"])) for c in p["completions"]])
        for p in doc["problems"]
    ]


@pytest.fixture(scope="module")
def single() -> dict:
    return run_eval(settings(), config())


@pytest.fixture(scope="module")
def cluster():
    import ray  # in the test extra: CI runs these

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_two_workers_write_the_single_process_results(cluster, single, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert (
        main(
            [
                "eval",
                "--dataset",
                DATASET,
                *FLAGS,
                "--output",
                str(out),
                "--workers",
                "2",
                "--cpus-per-worker",
                "1",
                "--trace",
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert signature(doc) == signature(single, approx=True)  # traced on the workers: the same search
    assert all(len(p["trace"]["completions"]) == len(p["completions"]) for p in doc["problems"])
    assert {k: doc["summary"][k] for k in QUALITY} == {k: single["summary"][k] for k in QUALITY}
    assert doc["summary"]["workers"] == 2 and doc["summary"]["worker_failures"] == 0
    assert doc["summary"]["retried_problems"] == []
    assert doc["config"]["distributed"]["cpus_per_worker"] == 1
    assert "problems/min" in capsys.readouterr().out


def test_a_dead_workers_problems_are_retried_and_answered_once(cluster, single, capsys):
    from treeserve.eval.distributed import RayOptions, run_eval_distributed

    # worker 0 exits (os._exit) as it finishes its 2nd problem: that answer and the problems it
    # has in flight are lost with it
    doc = run_eval_distributed(settings(), config(), RayOptions(workers=2, crash_after={0: 2}))
    uids = [p["unique_id"] for p in single["problems"]]
    assert [p["unique_id"] for p in doc["problems"]] == uids
    assert signature(doc) == signature(single, approx=True)
    summary = doc["summary"]
    assert summary["worker_failures"] == 1
    assert summary["retried_problems"] and set(summary["retried_problems"]) <= set(uids)
    err = capsys.readouterr().err
    assert "worker 0" in err and "died" in err and "retried" in err


def test_the_driver_resumes_a_journal_and_searches_only_the_rest(cluster, single, tmp_path):
    from treeserve.eval.distributed import RayOptions, run_eval_distributed
    from treeserve.eval.journal import Journal, journal_path
    from treeserve.eval.runner import load_problems, run_config

    out = tmp_path / "results.json"
    s = settings()
    journal = Journal.open(journal_path(out), run_config(s, config(), load_problems(s)))
    for record in single["problems"][:3]:  # as a killed in-process run of the same config left them
        journal.add(record, 1.0, {"generator_generated_tokens": 0})
    journal.close()
    doc = run_eval_distributed(settings(), config(), RayOptions(workers=2), output=str(out))
    assert json.loads(out.read_text()) == doc and not journal_path(out).exists()
    assert signature(doc) == signature(single, approx=True)
    assert {k: doc["summary"][k] for k in QUALITY if k != "generated_tokens"} == {
        k: single["summary"][k] for k in QUALITY if k != "generated_tokens"
    }
    assert doc["summary"]["sessions"] == 2
    assert 0 < doc["summary"]["generated_tokens"] < single["summary"]["generated_tokens"]  # 3 of 6 searched


def test_more_workers_than_cpus_is_a_clear_error(cluster):
    from treeserve.eval.distributed import RayOptions, run_eval_distributed

    with pytest.raises(ValueError, match="need 3 CPUs but the Ray cluster has 2"):
        run_eval_distributed(settings(), config(), RayOptions(workers=3))


def test_a_worker_that_cannot_start_says_why(cluster):
    from treeserve.eval.distributed import RayOptions, WorkerError, run_eval_distributed

    bad = settings()
    bad.runtime.arena_config.kv_cache_memory = 10_000  # passes the driver's checks; the worker's engine refuses it
    with pytest.raises(WorkerError, match="worker 0 failed to start: ValueError: the KV budget"):
        run_eval_distributed(bad, config(), RayOptions(workers=1))


def test_without_ray_workers_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "r.json"
    assert main(["eval", "--dataset", DATASET, *FLAGS, "--output", str(out), "--workers", "2"]) == 2
    assert "pip install 'treeserve[ray]'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "0"], "--workers must be >= 1"),
        (["--ray-address", "auto"], "need --workers"),
        (["--workers", "2", "--memory-report", "plan.json"], "each worker plans its own"),
    ],
)
def test_bad_ray_flags(flags, message, tmp_path, capsys):
    assert main(["eval", "--dataset", DATASET, "--output", str(tmp_path / "r.json"), *flags]) == 2
    assert message in capsys.readouterr().err


def test_shipped_models_resolve_to_each_nodes_installed_copy():
    from treeserve.eval.distributed import _local_path
    from treeserve.eval.runner import ASSETS

    assert _local_path("/other/site-packages/treeserve/assets/arith-prm", "/other/site-packages/treeserve/assets") == (
        str(ASSETS / "arith-prm")
    )
    assert _local_path("/models/generator", "/other/site-packages/treeserve/assets") == "/models/generator"


@pytest.mark.slow  # ~17s (CI runs the slow step); the default suite keeps to ~10 minutes
def test_a_hung_worker_is_killed_and_its_problems_retried(cluster, single, capsys):
    from treeserve.eval.distributed import RayOptions, run_eval_distributed

    # worker 0's event loop blocks for good as it finishes its first problem (a hung step): its
    # heartbeat goes unanswered, and it is killed like a dead worker
    options = RayOptions(workers=2, heartbeat_timeout_s=3.0, hang_after={0: 1})
    doc = run_eval_distributed(settings(), config(), options)
    assert [p["unique_id"] for p in doc["problems"]] == [p["unique_id"] for p in single["problems"]]
    assert signature(doc) == signature(single, approx=True)
    assert doc["summary"]["worker_failures"] == 1
    err = capsys.readouterr().err
    assert "worker 0" in err and "no answer to a heartbeat for 3 s" in err
