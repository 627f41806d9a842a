"""Evaluations that survive: the journal, kill and resume, signals, shards and `merge`.

A run killed with SIGKILL (and, separately, stopped with SIGTERM) after some problems and then
resumed must write the uninterrupted run's records (fp32: identical), a torn last line of the
journal is recomputed, and a config change on resume is refused with the difference named.
`--shard i/k` runs joined by `treeserve merge` must equal the unsharded run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from treeserve.cli import main
from treeserve.eval.journal import Journal, config_differences, journal_path
from treeserve.eval.merge import merge_results
from treeserve.eval.report import upgrade_config
from treeserve.search.config import SearchConfig

# the shipped arithmetic generator and PRM; one problem at a time, so problems finish one by one
FLAGS = [
    "--dataset",
    "arith:level=4,5,size=8,seed=0",
    "--n",
    "4",
    "--beam-width",
    "2",
    "--dtype",
    "float32",
    "--kv-cache-memory",
    str(64 << 20),
    "--max-concurrent-problems",
    "1",
]
QUALITY = ("accuracy", "accuracy_by_level", "naive@n", "weighted@n", "majority@n", "pass@n", "pass@N", "num_problems")


def eval_cli(output: Path, *extra: str) -> int:
    return main(["eval", *FLAGS, "--output", str(output), *extra])


def start_eval(output: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "treeserve.cli", "eval", *FLAGS, "--output", str(output)]
    return subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )


def wait_for_problems(process: subprocess.Popen, journal: Path, count: int, timeout: float = 120.0) -> int:
    """Wait until the journal holds `count` finished problems; returns how many it holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the eval finished before it could be stopped"
        if journal.exists():
            done = journal.read_bytes().count(b"\n") - 1
            if done >= count:
                return done
        time.sleep(0.01)
    raise AssertionError(f"no {count} problems in {journal} after {timeout} s")


def finished(journal: Path) -> int:
    return journal.read_bytes().count(b"\n") - 1


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("baseline") / "results.json"
    assert eval_cli(out) == 0
    assert not journal_path(out).exists(), "the journal is removed once the results are written"
    return json.loads(out.read_text())


def same_run(doc: dict, baseline: dict) -> None:
    assert doc["problems"] == baseline["problems"]  # fp32: identical records, texts and step scores
    assert {k: doc["summary"][k] for k in QUALITY} == {k: baseline["summary"][k] for k in QUALITY}


@pytest.mark.slow  # ~45s (CI runs the slow step); the default suite keeps to ~10 minutes
def test_sigkill_then_resume_equals_the_uninterrupted_run(baseline, tmp_path, capsys):
    out = tmp_path / "results.json"
    journal = journal_path(out)
    process = start_eval(out, tmp_path / "log.txt")
    try:
        wait_for_problems(process, journal, 3)
    finally:
        process.kill()
        process.wait()
    done = finished(journal)
    assert 3 <= done < 8 and not out.exists()
    # tear the last record as a kill mid-write would: that problem must be searched again
    data = journal.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    journal.write_bytes(data[: last + (len(data) - last) // 2])

    assert eval_cli(out, "--resume") == 0
    err = capsys.readouterr().err
    assert "dropping a torn last line" in err and f"{done - 1} of 8 problems done" in err
    doc = json.loads(out.read_text())
    same_run(doc, baseline)
    assert doc["summary"]["sessions"] == 2 and not journal.exists()


@pytest.mark.slow  # ~24s (CI runs the slow step); the default suite keeps to ~10 minutes
def test_sigterm_stops_admitting_and_resumes(baseline, tmp_path, capsys):
    out = tmp_path / "results.json"
    journal = journal_path(out)
    log = tmp_path / "log.txt"
    process = start_eval(out, log)
    try:
        at_signal = wait_for_problems(process, journal, 2)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    finally:
        process.kill()
    text = log.read_text()
    assert code == 128 + signal.SIGTERM, text[-2000:]
    assert "SIGTERM: admitting no more problems" in text and "run the same command again to resume" in text
    done = finished(journal)
    assert at_signal <= done < 8  # the problem in flight may finish within the grace period, no more start
    assert not out.exists()

    assert eval_cli(out) == 0  # the same command resumes
    assert f"resuming {journal}: {done} of 8" in capsys.readouterr().err
    same_run(json.loads(out.read_text()), baseline)


def test_resume_refuses_another_config_and_a_missing_journal(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert eval_cli(out, "--resume") == 2
    assert "--resume: no partial results to resume" in capsys.readouterr().err

    Journal.open(journal_path(out), {"search": {"n": 64}, "dataset": "arith:level=4,5,size=8,seed=0"}).close()
    assert eval_cli(out) == 2
    err = capsys.readouterr().err
    assert "search.n: 64 in the file, 4 now" in err and "move the file away" in err
    assert finished(journal_path(out)) == 0  # left as it was


def test_settings_added_since_a_file_was_written_at_their_defaults_are_the_same_run():
    """A journal written before a setting existed resumes while that setting is at its default."""
    old = {"search": {"n": 4}, "dataset": "d"}
    assert config_differences(old, {"search": {"n": 4, "stop": [], "prompt_format": None}, "dataset": "d"}) == []
    assert config_differences(old, {"search": {"n": 4, "stop": ["Q:"]}, "dataset": "d"}) == [
        "search.stop: '<absent>' in the file, ['Q:'] now"
    ]
    assert config_differences({"search": {"n": 4, "stop": []}}, {"search": {"n": 4}}) == [
        "search.stop: [] in the file, '<absent>' now"  # a setting the code no longer has
    ]
    # search settings added since, at defaults that are not empty (resample_threshold 1.0, exploration 1.0)
    now = {"search": asdict(SearchConfig(n=4)), "dataset": "d"}
    written = {
        "search": {k: v for k, v in now["search"].items() if k not in ("resample_threshold", "exploration")},
        "dataset": "d",
    }
    assert config_differences(upgrade_config(written), now) == []
    assert config_differences(upgrade_config(written), {**now, "search": {**now["search"], "exploration": 2.0}}) == [
        "search.exploration: 1.0 in the file, 2.0 now"
    ]


@pytest.mark.slow  # ~23s (CI runs the slow step); the default suite keeps to ~10 minutes
def test_shards_merge_to_the_unsharded_run(baseline, tmp_path):
    shards = [tmp_path / f"shard{i}.json" for i in range(3)]
    for i, path in enumerate(shards):
        assert eval_cli(path, "--shard", f"{i}/3") == 0
    assert [json.loads(p.read_text())["config"]["num_problems"] for p in shards] == [3, 3, 2]
    merged = merge_results(list(reversed(shards)))
    same_run(merged, baseline)
    assert merged["config"]["shard"] is None and merged["summary"]["shards"] == 3
    assert merged["summary"]["generated_tokens"] == sum(
        json.loads(p.read_text())["summary"]["generated_tokens"] for p in shards
    )

    assert main(["merge", *map(str, shards), "--output", str(tmp_path / "all.json")]) == 0
    assert main(["compare", str(tmp_path / "all.json"), str(tmp_path / "all.json")]) == 0

    with pytest.raises(ValueError, match=r"missing shards: 2/3"):
        merge_results(shards[:2])
    with pytest.raises(ValueError, match="both shard 1/3: shards overlap"):
        merge_results([shards[0], shards[1], shards[1], shards[2]])
    other = json.loads(shards[2].read_text())
    other["config"]["search"]["n"] = 8
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"comes from another run .*search\.n: 4 in .*, 8 here"):
        merge_results([shards[0], shards[1], tmp_path / "other.json"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shard", "3/3"], "0 <= i < k"),
        (["--shard", "one/3"], "--shard must be i/k"),
        (["--grace", "-1"], "--grace must be >= 0"),
    ],
)
def test_bad_flags_fail_before_any_model_loads(tmp_path, capsys, argv, message):
    assert eval_cli(tmp_path / "r.json", *argv) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no journal: nothing ran


def test_an_adaptive_run_resumes_with_the_budget_it_picks(tmp_path, capsys):
    """`--adaptive` alone journals the budget fraction it picks by: a journal holding some of its
    problems resumes with the same command (the resumed invocation picks its budget from the
    problems it searches) and the records kept are the journal's; a journal of the run without a
    budget (`--budget-fraction off`) is another run, named."""
    full = tmp_path / "full.json"
    assert eval_cli(full, "--adaptive") == 0
    document = json.loads(full.read_text())
    assert document["config"]["search"]["budget_fraction"] == SearchConfig().budget_fraction
    assert all("budget_tokens" in p["stop"] for p in document["problems"])
    out = tmp_path / "results.json"
    journal = Journal.open(journal_path(out), document["config"])
    for record in document["problems"][:3]:
        journal.add(record, 1.0, {})
    journal.close()
    assert eval_cli(out, "--adaptive", "--budget-fraction", "off") == 2
    assert f"search.budget_fraction: {SearchConfig().budget_fraction} in the file, None now" in capsys.readouterr().err
    assert eval_cli(out, "--adaptive", "--resume") == 0
    assert "3 of 8 problems done" in capsys.readouterr().err
    resumed = json.loads(out.read_text())
    assert resumed["problems"][:3] == document["problems"][:3] and len(resumed["problems"]) == 8
    assert not journal_path(out).exists()
