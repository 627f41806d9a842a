"""Dataset specs and JSONL loading: the arith spec grammar, validation errors naming file and line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from treeserve.eval.datasets import load_dataset, load_jsonl, parse_arith_spec

MATH500 = Path("/work/shared/data/math500.jsonl")


def test_builtin_default_is_the_fixed_test_split():
    records = load_dataset("arith")
    assert len(records) == 500
    assert Counter(r["level"] for r in records) == {1: 100, 2: 100, 3: 100, 4: 100, 5: 100}
    assert {r["grader"] for r in records} == {"arith"}
    assert len({r["unique_id"] for r in records}) == 500
    assert set(records[0]) >= {"problem", "solution", "answer", "level", "subject", "unique_id", "grader"}


def test_builtin_options_levels_size_seed():
    records = load_dataset("arith:level=4,5,size=10,seed=1")
    assert len(records) == 10
    assert Counter(r["level"] for r in records) == {4: 5, 5: 5}
    assert records == load_dataset("arith:levels=4,5,size=10,seed=1")  # alias, reproducible
    assert [r["problem"] for r in records] != [r["problem"] for r in load_dataset("arith:level=4,5,size=10,seed=0")]
    uneven = load_dataset("arith:size=10,level=1,2,3")
    assert Counter(r["level"] for r in uneven) == {1: 4, 2: 3, 3: 3}


def test_builtin_spec_defaults():
    assert parse_arith_spec("arith") == {"level": (1, 2, 3, 4, 5), "size": 500, "seed": 0}
    assert parse_arith_spec("arith:seed=7") == {"level": (1, 2, 3, 4, 5), "size": 500, "seed": 7}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("arith:levle=3", "unknown arith option 'levle'"),
        ("arith:size=ten", "size must be an integer"),
        ("arith:level=6", "level must be one of"),
        ("arith:size=0", "size must be >= 1"),
        ("arith:seed=1,seed=2", "given twice"),
        ("arith:4", "expected key=value"),
        ("arith:size=5,6", "expected key=value"),
        ("arith:level=2,2", "levels repeat"),
        ("", "non-empty"),
    ],
    ids=["unknown-key", "bad-int", "bad-level", "zero-size", "twice", "no-key", "stray-value", "repeat", "empty"],
)
def test_bad_builtin_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        load_dataset(spec)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_loads_with_defaults(tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [
            json.dumps({"problem": "What is 1+1?", "answer": "2", "level": 1, "unique_id": "a", "subject": "X"}),
            "",
            json.dumps({"problem": "Half of 1?", "answer": "\\frac{1}{2}"}),
            json.dumps({"problem": "Compute 2 * 3.", "answer": "6", "grader": "arith"}),
        ],
    )
    records = load_dataset(str(path))
    assert [r["unique_id"] for r in records] == ["a", "line-3", "line-4"]
    assert [r["grader"] for r in records] == ["math", "math", "arith"]
    assert records[0]["subject"] == "X" and records[1]["level"] is None


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"problem": "p", "answer": ', "not valid JSON"),
        ('["problem", "answer"]', "expected a JSON object"),
        ('{"problem": "p"}', "missing required key 'answer'"),
        ('{"problem": 3, "answer": "1"}', "'problem' must be a non-empty string"),
        ('{"problem": "p", "answer": ""}', "'answer' must be a non-empty string"),
        ('{"problem": "p", "answer": "1", "level": "Level 3"}', "'level' must be an integer"),
        ('{"problem": "p", "answer": "1", "unique_id": 5}', "'unique_id' must be"),
        ('{"problem": "p", "answer": "1", "grader": "exact"}', "'grader' must be one of"),
        ('{"problem": "p", "answer": "1", "unique_id": "first"}', "already used on line 1"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"problem": "p", "answer": "1", "unique_id": "first"})
    path = _write(tmp_path / "bad.jsonl", [good, json.dumps({"problem": "q", "answer": "2"}), bad_line, good])
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(str(path))
    assert f"{path}:3:" in str(info.value)


def test_jsonl_missing_empty_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        load_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="no records"):
        load_jsonl(_write(tmp_path / "empty.jsonl", [""]))
    with pytest.raises(ValueError, match="not a file"):
        load_jsonl(tmp_path)


@pytest.mark.skipif(not MATH500.exists(), reason="shared MATH-500 file not present")
def test_math500_loads():
    records = load_dataset(str(MATH500))
    assert len(records) == 500
    assert {r["grader"] for r in records} == {"math"}
    assert Counter(r["level"] for r in records) == {1: 43, 2: 90, 3: 105, 4: 128, 5: 134}
