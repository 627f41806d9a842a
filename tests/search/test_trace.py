"""Search traces (search/trace.py): what they record on fixed-seed searches, and that recording
them changes no beam and no answer."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from tests.search.step_world import build_step_world
from tests.search.test_search_equivalence import CONFIGS, RECORDS, signature
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.search.trace import FATES, nodes


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_step_world(str(tmp_path_factory.mktemp("step_world")))


def run(world, config: SearchConfig, reference: bool = False) -> dict:
    generator, prm = world
    settings = EvalSettings(
        generator=ModelSettings(generator),
        prm=ModelSettings(prm),
        reference=reference,
        progress=False,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )
    return run_eval(settings, config, inline=[dict(r) for r in RECORDS])


@pytest.fixture(scope="module")
def traced(world) -> dict[str, dict]:
    return {name: run(world, replace(config, trace=True)) for name, config in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tracing_changes_no_beam_and_no_answer(world, traced, name):
    plain = run(world, CONFIGS[name])
    assert signature(traced[name]) == signature(plain)
    assert all("trace" not in p for p in plain["problems"])
    assert all(p["trace"]["strategy"] == CONFIGS[name].strategy for p in traced[name]["problems"])


def by_iteration(trace: dict) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for node in nodes(trace):
        out.setdefault(node["iteration"], []).append(node)
    return out


def path_text(trace: dict, node_id: int | None) -> str:
    rows = nodes(trace)
    steps = []
    while node_id is not None:
        steps.append(rows[node_id]["text"])
        node_id = rows[node_id]["parent"]
    return "\n\n".join(reversed(steps))


@pytest.mark.parametrize("name", ["beam_spec", "beam_prod_dedup"])
def test_beam_search_trace(traced, name):
    config = CONFIGS[name]
    for problem in traced[name]["problems"]:
        trace = problem["trace"]
        assert all(n["fate"] in FATES for n in nodes(trace))
        iterations = by_iteration(trace)
        assert len(iterations) >= 2 and sorted(iterations) == list(range(len(iterations)))
        for it, rows in iterations.items():
            assert len(rows) == config.n  # every iteration expands n beams
            if it == 0:
                assert all(n["parent"] is None for n in rows)
                continue
            kept = {n["id"] for n in iterations[it - 1] if n["fate"] == "kept"}
            assert {n["parent"] for n in rows} == kept  # the search continued exactly the kept beams
        for rows in list(iterations.values())[:-1]:
            alive = [n for n in rows if n["fate"] in ("kept", "pruned")]
            assert sum(n["fate"] == "kept" for n in rows) == min(config.n // config.beam_width, len(alive))
            if alive:  # kept beams rank at least as high as pruned ones
                kept = [n["score"] for n in alive if n["fate"] == "kept"]
                pruned = [n["score"] for n in alive if n["fate"] == "pruned"]
                assert not pruned or min(kept) >= max(pruned)
        assert all(n["fate"] != "kept" for n in iterations[max(iterations)])
        # every completion is a finished node whose path spells its text and whose step scores are its own
        rows = nodes(trace)
        assert len(trace["completions"]) == len(problem["completions"])
        for node_id, completion in zip(trace["completions"], problem["completions"], strict=True):
            assert rows[node_id]["fate"] == "finished"
            assert path_text(trace, node_id) == completion["text"]
            assert rows[node_id]["step_scores"] == pytest.approx(completion["step_scores"][-1:], abs=1e-6)
        assert trace["generated_tokens"] == sum(n["tokens"] for n in rows) > 0


def test_trace_flags_speculation_and_score_sources(world, traced):
    spec = Counter(n["decoded_ahead"] for p in traced["beam_spec"]["problems"] for n in nodes(p["trace"]))
    assert spec[True] > 0 and spec[False] > 0  # later steps came from text decoded past the boundary
    plain = run(world, replace(CONFIGS["dvts"], trace=True), reference=True)
    assert {n["cache"] for p in plain["problems"] for n in nodes(p["trace"])} == {"prm"}  # no score cache
    majority = traced["majority"]["problems"]
    assert {n["cache"] for p in majority for n in nodes(p["trace"])} == {""}  # no PRM


def test_arithmetic_trace_marks_shared_scores_and_duplicates():
    """The shipped arithmetic pair writes many identical steps: beams share PRM requests, and
    filter_duplicates drops twins, each of which has a surviving twin of the same text."""
    config = SearchConfig(n=8, beam_width=2, num_iterations=6, filter_duplicates=True, trace=True, seed=1)
    settings = EvalSettings(
        dataset="arith:level=4,size=2,seed=0",
        progress=False,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )
    doc = run_eval(settings, config)
    rows = [n for p in doc["problems"] for n in nodes(p["trace"])]
    sources, fates = Counter(n["cache"] for n in rows), Counter(n["fate"] for n in rows)
    assert sources["prm"] > 0 and sources["cache"] + sources["shared"] > 0, sources
    assert fates["duplicate"] > 0, fates
    for problem in doc["problems"]:
        trace = problem["trace"]
        for node in (n for n in nodes(trace) if n["fate"] == "duplicate"):
            text = path_text(trace, node["id"])
            peers = by_iteration(trace)[node["iteration"]]
            assert [n for n in peers if n["fate"] in ("kept", "pruned") and path_text(trace, n["id"]) == text]


def test_dvts_trace(traced):
    config = CONFIGS["dvts"]
    for problem in traced["dvts"]["problems"]:
        trace = problem["trace"]
        iterations = by_iteration(trace)
        assert len(iterations[0]) == config.n
        for it, rows in iterations.items():
            # a subtree reports its beam_width candidates at once: at iteration 0 they are
            # consecutive (children of the prompt), later they share the kept parent
            if it == 0:
                groups = [rows[k : k + config.beam_width] for k in range(0, len(rows), config.beam_width)]
            else:
                groups = [[n for n in rows if n["parent"] == parent] for parent in {n["parent"] for n in rows}]
                assert all(nodes(trace)[n["parent"]]["fate"] == "kept" for n in rows)
            assert len(groups) <= config.n // config.beam_width
            for siblings in groups:
                assert len(siblings) == config.beam_width
                kept = [n for n in siblings if n["fate"] == "kept"]
                if kept:  # within a subtree the kept candidate is the best-ranked one
                    assert len(kept) == 1 and kept[0]["score"] == max(n["score"] for n in siblings)
                    assert all(n["fate"] == "pruned" for n in siblings if n is not kept[0])
                else:
                    assert all(n["fate"] == "finished" for n in siblings)
        finished = {n["id"] for n in nodes(trace) if n["fate"] == "finished"}
        assert set(trace["completions"]) == finished and len(finished) == config.n


def test_best_of_n_trace_is_a_flat_list(traced):
    config = CONFIGS["best_of_n"]
    for problem in traced["best_of_n"]["problems"]:
        rows = nodes(problem["trace"])
        assert len(rows) == config.n
        assert all(n["iteration"] == 0 and n["parent"] is None and n["fate"] == "finished" for n in rows)
        for node_id, completion in zip(problem["trace"]["completions"], problem["completions"], strict=True):
            assert rows[node_id]["text"] == completion["text"]
            assert rows[node_id]["step_scores"] == pytest.approx(completion["step_scores"], abs=1e-6)
