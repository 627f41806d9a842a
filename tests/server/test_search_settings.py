"""The same search from `treeserve eval`'s flags, `treeserve solve`, `/v1/search` and the Python
API: equal `SearchConfig`s and the same answer, on the shipped arithmetic pair."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import API_KEY, LiveServer
from treeserve.cli import _search_settings, build_parser, main
from treeserve.eval.runner import EvalSettings, run_eval
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.server.protocol import SearchRequest, search_config

QUESTION = "Compute ((12 + 7) * 3) - 15."
SEARCH = {"strategy": "beam_search", "n": 4, "beam_width": 2, "num_iterations": 6, "max_tokens": 48, "seed": 3}
FLAGS = [item for key, value in SEARCH.items() for item in (f"--{key.replace('_', '-')}", str(value))]
RUNTIME = ["--dtype", "float32", "--kv-cache-memory", str(64 << 20)]  # the test server's


def _completions(rows: list[dict]) -> list[tuple[str, list[float]]]:
    """Texts and step scores, sorted: beams that end in one iteration may be listed in either order."""
    return sorted((c["text"], c["step_scores"]) for c in rows)


def test_cli_http_and_python_resolve_to_one_search(server: LiveServer, tmp_path):
    python = SearchConfig(**SEARCH)
    _, from_cli = _search_settings(build_parser().parse_args(["eval", *FLAGS, *RUNTIME]))
    from_http = search_config(SearchRequest(problem=QUESTION, **SEARCH))
    assert from_cli == from_http == python

    response = httpx.post(
        server.base_url + "/v1/search",
        json={"problem": QUESTION, **SEARCH},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    over_http = response.json()
    # a search's seeds follow (seed, problem id, beam path); a request's problem id is its text
    record = {"problem": QUESTION, "answer": "48", "unique_id": QUESTION}
    dataset, output = tmp_path / "one.jsonl", tmp_path / "results.json"
    dataset.write_text(json.dumps(record) + "\n")
    assert main(["eval", "--dataset", str(dataset), *FLAGS, *RUNTIME, "--output", str(output)]) == 0
    on_cli = json.loads(output.read_text())["problems"][0]
    settings = EvalSettings(
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20), progress=False
    )
    in_python = run_eval(settings, python, inline=[record])["problems"][0]

    solved = tmp_path / "solve.json"
    assert main(["solve", QUESTION, *FLAGS, *RUNTIME, "--output", str(solved)]) == 0
    on_solve = json.loads(solved.read_text())["problems"][0]

    assert _completions(on_cli["completions"]) == _completions(in_python["completions"])
    assert _completions(over_http["completions"]) == _completions(in_python["completions"])
    assert _completions(on_solve["completions"]) == _completions(in_python["completions"])
    assert over_http["answer"] == on_cli["pred"] == on_solve["pred"] == in_python["pred"] is not None
