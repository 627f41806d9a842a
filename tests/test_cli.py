"""The command line: the generate demo runs, and bad input gets a clear error (exit 2)."""

from __future__ import annotations

import json

import pytest

from treeserve.cli import main


def test_generate_runs(llama_dir, capsys):
    code = main(["generate", "--model", llama_dir, "--raw", "hello", "--n", "2", "--max-tokens", "5",
                 "--kv-cache-memory", str(8 << 20), "--dtype", "float32"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0
    assert "=== hello" in out.out and "completion 1" in out.out and "tok/s" in out.err


def test_bad_input_exits_2(llama_dir, capsys):
    assert main(["generate", "--model", "/does/not/exist"]) == 2
    assert "model not found" in capsys.readouterr().err
    assert main(["generate", "--model", llama_dir, "--n", "0", "x", "--kv-cache-memory", str(8 << 20)]) == 2
    assert "n must be" in capsys.readouterr().err
    assert main(["generate", "--model", llama_dir, "--speculative-config", '{"method": "eagle"}', "x"]) == 2
    assert "method must be one of" in capsys.readouterr().err


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.search.step_world import build_step_world

    return build_step_world(str(tmp_path_factory.mktemp("cli_world")))


def test_eval_plot_solve(world, tmp_path, capsys):
    generator, prm = world
    jsonl = tmp_path / "tiny.jsonl"
    jsonl.write_text('{"problem": "Compute 1+2.", "answer": "3", "level": 1, "unique_id": "a"}\n'
                     '{"problem": "Compute 2*2.", "answer": "4", "level": 2, "unique_id": "b"}\n')  # fmt: skip
    common = ["--generator", generator, "--prm", prm, "--n", "4", "--beam-width", "2", "--num-iterations", "3",
              "--max-tokens", "16", "--dtype", "float32", "--kv-cache-memory", str(64 << 20)]  # fmt: skip
    out = tmp_path / "results.json"
    assert main(["eval", "--dataset", str(jsonl), "--output", str(out), *common]) == 0
    doc = json.loads(out.read_text())
    assert {"accuracy", "problems_per_s", "accuracy_by_level"} <= set(doc["summary"])
    assert [p["unique_id"] for p in doc["problems"]] == ["a", "b"]
    assert "problems/min" in capsys.readouterr().out
    png = tmp_path / "plot.png"
    assert main(["plot", str(out), "--output", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["solve", "Compute 1+2.", *common]) == 0
    assert "[step 1, PRM" in capsys.readouterr().out
    solved = tmp_path / "solve.json"
    assert main(["solve", "Compute 1+2.", *common, "--trace", "--output", str(solved)]) == 0
    assert f"treeserve view {solved}" in capsys.readouterr().out
    assert json.loads(solved.read_text())["problems"][0]["trace"]["nodes"]
    assert main(["view", str(solved), "--output", str(tmp_path / "solve.html")]) == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--strategy", "astar"], "unknown strategy"),
        (["--n", "6", "--beam-width", "4"], "divisible"),
        (["--generator", "/nope"], "generator model not found"),
        (["--dataset", "BADJSONL"], "bad.jsonl:2: not valid JSON"),
        (["--dataset", "arith:level=9"], "level"),
        (["--speculative-config", "{bad"], "not valid JSON"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'], "integer >= 1"),
        (["--speculative-config", '{"model": "/nope", "num_speculative_tokens": 2}'], "draft model directory"),
    ],
)
def test_eval_bad_input(world, tmp_path, capsys, extra, message):
    generator, prm = world
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x", "answer": "1"}\n{not json}\n')
    args = ["eval", "--generator", generator, "--prm", prm, "--output", str(tmp_path / "r.json")]
    args += [str(bad) if a == "BADJSONL" else a for a in extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
