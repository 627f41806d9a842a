"""`treeserve view`: the page's data (index and per-problem records), escaping, and its bad
input. What the page does in a browser is tested in tests/browser/."""

from __future__ import annotations

import base64
import copy
import gzip
import json
import re
from pathlib import Path

import pytest

from treeserve.cli import main
from treeserve.eval.report import write_results
from treeserve.eval.view import build_page, stop_line

HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">&amp;'


def make_traced_results(folder: Path, name: str = "traced.json", **search: object) -> Path:
    """A traced beam search (n=8) of four problems on the step world, in fp32, as a results file;
    `search`: more SearchConfig fields (adaptive search's)."""
    from tests.search.step_world import build_step_world
    from tests.search.test_search_equivalence import RECORDS
    from treeserve.eval.runner import EvalSettings, run_eval
    from treeserve.runtime.model_settings import ModelSettings
    from treeserve.runtime.runtime_settings import RuntimeSettings
    from treeserve.search.config import SearchConfig

    generator, prm = build_step_world(str(folder / "world"))
    settings = EvalSettings(
        generator=ModelSettings(generator),
        prm=ModelSettings(prm),
        progress=False,
        page_logs=True,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )
    config = SearchConfig(n=8, beam_width=2, num_iterations=5, max_tokens=24, trace=True, **search)
    run_eval(settings, config, inline=[dict(r) for r in RECORDS], output=folder / name)
    return folder / name


@pytest.fixture(scope="module")
def traced_results(tmp_path_factory) -> Path:
    return make_traced_results(tmp_path_factory.mktemp("view"))


def hostile_copy(results: Path, out: Path) -> tuple[Path, str]:
    """`results` with a step (node 3 of its first problem) and a problem text that are markup;
    returns the path and that node's id."""
    doc = json.loads(results.read_text())
    problem = doc["problems"][0]
    problem["problem"] = HOSTILE
    text = problem["trace"]["fields"].index("text")
    problem["trace"]["nodes"][3][text] = HOSTILE
    write_results(doc, out)
    return out, 3


def page_data(html: str) -> tuple[dict, dict[str, dict]]:
    index = json.loads(re.search(r'<script id="index" type="application/json">(.*?)</script>', html, re.S).group(1))
    blobs = {
        m.group(1): json.loads(gzip.decompress(base64.b64decode(m.group(2))))
        for m in re.finditer(r'<script type="application/octet-stream" id="(p\d+_\d+)">(.*?)</script>', html, re.S)
    }
    return index, blobs


def test_the_page_holds_every_problem_and_its_record(traced_results, tmp_path):
    out = tmp_path / "report.html"
    assert main(["view", str(traced_results), "--output", str(out)]) == 0
    html = out.read_text()
    doc = json.loads(traced_results.read_text())
    index, blobs = page_data(html)
    assert index["order"] == [p["unique_id"] for p in doc["problems"]]
    assert index["runs"][0]["traced"] is True
    for i, p in enumerate(doc["problems"]):
        entry = index["runs"][0]["problems"][p["unique_id"]]
        assert (entry["correct"], entry["pred"], entry["answer"]) == (p["correct"], p["pred"], p["answer"])
        assert entry["tokens"] == p["trace"]["generated_tokens"] and entry["seconds"] == p["trace"]["seconds"]
        assert blobs[f"p0_{i}"] == p  # the whole record: completions and trace
    titles = [plot["title"] for plot in index["plots"]]
    assert titles[0] == "accuracy vs N" and any("pages" in t for t in titles)  # page logs were kept
    assert all(plot["src"].startswith("data:image/png;base64,") for plot in index["plots"])
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")  # nothing to fetch


def test_markup_in_results_never_reaches_the_page_as_markup(traced_results, tmp_path):
    hostile, _ = hostile_copy(traced_results, tmp_path / "hostile.json")
    html = build_page([("hostile.json", json.loads(hostile.read_text()))])
    assert "window.pwned" not in html.split('<script id="index"')[0]
    index_json = re.search(r'<script id="index" type="application/json">(.*?)</script>', html, re.S).group(1)
    assert "<" not in index_json and HOSTILE in json.loads(index_json)["runs"][0]["problems"]["q0"]["problem"]
    assert html.count("<script") == html.count("</script>") == 2 + 4  # index, script, one blob per problem


def test_one_problem_and_two_files_side_by_side(traced_results, tmp_path):
    out = tmp_path / "one.html"
    assert main(["view", str(traced_results), "--problem", "q2", "--output", str(out)]) == 0
    index, blobs = page_data(out.read_text())
    assert index["order"] == ["q2"] and list(blobs) == ["p0_2"]
    other = tmp_path / "other" / "traced.json"
    doc = json.loads(traced_results.read_text())
    doc["problems"] = doc["problems"][1:]  # B lacks q0
    write_results(doc, other)
    both = tmp_path / "both.html"
    assert main(["view", str(traced_results), str(other), "--output", str(both)]) == 0
    index, blobs = page_data(both.read_text())
    assert [run["name"] for run in index["runs"]] == [str(traced_results), str(other)]  # same file names: paths
    assert index["order"] == ["q0", "q1", "q2", "q3"] and "q0" not in index["runs"][1]["problems"]
    assert blobs["p1_0"]["unique_id"] == "q1"


def test_results_without_traces_get_a_page_that_says_how(traced_results, tmp_path):
    doc = json.loads(traced_results.read_text())
    for p in doc["problems"]:
        del p["trace"]
    plain = write_results(doc, tmp_path / "plain.json")
    out = tmp_path / "plain.html"
    assert main(["view", str(plain), "--output", str(out)]) == 0
    index, _ = page_data(out.read_text())
    assert index["runs"][0]["traced"] is False
    assert "--trace" in out.read_text()  # the page's notice names the flag


def test_bad_input_exits_2(traced_results, tmp_path, capsys):
    truncated = tmp_path / "truncated.json"
    truncated.write_text(traced_results.read_text()[:5000])
    assert main(["view", str(truncated)]) == 2
    assert "not a treeserve results file (not valid JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text('{"hello": "world"}')
    assert main(["view", str(other)]) == 2
    assert "missing 'config'" in capsys.readouterr().err
    assert main(["view", str(tmp_path / "nope.json")]) == 2
    assert "results file not found" in capsys.readouterr().err
    assert main(["view", str(traced_results), "--problem", "q9", "--output", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert "no problem 'q9'" in err and "q0, q1, q2, q3" in err
    assert main(["view", str(traced_results), str(traced_results), str(traced_results)]) == 2
    assert "one results file, or two" in capsys.readouterr().err
    stranger = copy.deepcopy(json.loads(traced_results.read_text()))
    for p in stranger["problems"]:
        p["unique_id"] = "x" + p["unique_id"]
    write_results(stranger, tmp_path / "stranger.json")
    assert main(["view", str(traced_results), str(tmp_path / "stranger.json")]) == 2
    assert "share no problem" in capsys.readouterr().err


def test_the_journal_keeps_traces_for_resumed_runs(traced_results, tmp_path):
    from treeserve.eval.journal import Journal

    doc = json.loads(traced_results.read_text())
    path = tmp_path / "results.partial.jsonl"
    journal = Journal.open(path, doc["config"])
    journal.add(doc["problems"][0], 1.0, {"generator_steps": 1})
    journal.close()
    resumed = Journal.open(path, doc["config"], resume=True)
    assert resumed.records["q0"] == doc["problems"][0] and resumed.records["q0"]["trace"]["nodes"]
    resumed.close()


def test_an_adaptive_run_says_where_each_problem_stopped_and_why(traced_results, tmp_path):
    adaptive = make_traced_results(tmp_path, "adaptive.json", adaptive=True, first_width=2, certainty=0.5)
    out = tmp_path / "adaptive.html"
    assert main(["view", str(adaptive), "--output", str(out)]) == 0
    index, _ = page_data(out.read_text())
    for p in json.loads(adaptive.read_text())["problems"]:
        stop = p["stop"]
        assert p["trace"]["stop"] == stop
        certainty, sign = stop["certainty"][-1], ">=" if stop["reason"] == "settled" else "<"
        want = f"stopped at iteration {stop['iteration']}: {stop['reason']} (certainty {certainty:g} {sign} 0.5)"
        assert index["runs"][0]["problems"][p["unique_id"]]["stopped"].startswith(want + ", widths 2")
    fixed, _ = page_data(build_page([("traced.json", json.loads(traced_results.read_text()))]))
    assert all(entry["stopped"] is None for entry in fixed["runs"][0]["problems"].values())  # a fixed run: no line
    assert "entry.stopped" in out.read_text()  # the panel shows it


def test_the_stop_line_reads_the_record():
    search = {"strategy": "beam_search", "adaptive": True, "certainty": 0.9}
    settled = {"widths": [4, 8, 16, 16], "certainty": [0.2, 0.5, 0.7, 0.93], "iteration": 3, "reason": "settled"}
    assert stop_line(settled, search) == "stopped at iteration 3: settled (certainty 0.93 >= 0.9), widths 4 > 8 > 16"
    wave = {"widths": [2, 4], "certainty": [0.3, 0.6], "iteration": 1, "reason": "exhausted"}
    dvts = {**search, "strategy": "dvts"}
    assert stop_line(wave, dvts) == "stopped at wave 1: exhausted (certainty 0.6 < 0.9), widths 2 > 4"
    assert stop_line(wave, {"strategy": "majority"}) == "stopped at round 1: exhausted (certainty 0.6), widths 2 > 4"
    deadline = {"iteration": 4, "reason": "deadline", "deadline_s": 0.5}  # /v1/search's, a fixed search
    assert stop_line(deadline, {"strategy": "beam_search"}) == "stopped at iteration 4: deadline (0.5 s)"
    assert stop_line(None, search) is None and stop_line({"widths": [4], "certainty": [0.1]}, search) is None
