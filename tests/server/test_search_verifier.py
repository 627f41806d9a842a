"""A verifier (an outcome reward model) from every front end: `treeserve eval --verifier`, `/v1/search`
of a server started with one (`"verify"`), and `SearchContext(verifier=...)` in Python. The shipped
arithmetic generator and PRM search, a tiny Qwen2.5-Math-RM-style ORM re-ranks; the three give the
same completions, scores and answer, the verifier's scores are its own, and every page is back after.
Asking for what the server cannot do (`"verify"` with no verifier, `"reasoning"` on a generator
without think tokens) is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from tests.search.prm_fixtures import build_qwen_reward_model, build_token_classification, build_value_head
from tests.server.conftest import API_KEY, start_server
from treeserve.cli import main
from treeserve.eval.report import read_results
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import load_prm
from treeserve.search.run import search_problems
from treeserve.server.settings import ServerSettings, build_served

QUESTION = "Compute 3 * (25 - 7) + 40."  # also its unique id: seeds follow (seed, problem id, beam path)
SEARCH = {"strategy": "beam_search", "n": 4, "beam_width": 2, "num_iterations": 3, "max_tokens": 48, "seed": 3}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
KV = 48 << 20


@pytest.fixture(scope="module")
def orm_dir(tmp_path_factory) -> str:
    return build_qwen_reward_model(str(tmp_path_factory.mktemp("orm") / "orm"))


@pytest.fixture(scope="module")
def verified_server(orm_dir):
    settings = ServerSettings(
        ModelSettings(DEFAULT_GENERATOR),
        ModelSettings(DEFAULT_PRM),
        verifier=ModelSettings(orm_dir),
        served_model_name="arith",
        api_key=API_KEY,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=KV),
    )
    server = start_server(settings)
    yield server
    server.stop()


def search_http(server, body: dict) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/search", json={"problem": QUESTION, **SEARCH, **body}, headers=AUTH, timeout=120
    )


def signature(completions: list[dict], approx: bool = False) -> list:
    """Texts and step scores (with `approx`, within 1e-5: a score's last bits follow what the prefix
    cache held)."""
    return [(c["text"], pytest.approx(c["step_scores"], abs=1e-5) if approx else c["step_scores"]) for c in completions]


def python_api(orm_dir: str, verify: bool) -> list:
    runtime = RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=KV)
    generator, prm, verifier = ModelSettings(DEFAULT_GENERATOR), ModelSettings(DEFAULT_PRM), ModelSettings(orm_dir)
    runtime.check(generator, prm, verifier)
    rt = runtime.load(generator, prm, verifier)

    async def body():
        try:
            ctx = SearchContext(
                SearchConfig(**SEARCH),
                rt,
                "generator",
                load_prm(rt, "prm"),
                verifier=load_prm(rt, "verifier") if verify else None,
            )
            [result] = await search_problems(ctx, [(QUESTION, QUESTION)])
            return [{"text": b.text, "step_scores": b.scores} for b in result.beams]
        finally:
            await rt.close()

    out = asyncio.run(body())
    rt.check_pages_idle()
    return out


def test_the_same_verified_answer_from_the_cli_http_and_python(orm_dir, verified_server, tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"problem": QUESTION, "answer": "94", "unique_id": QUESTION}) + "\n")
    output = tmp_path / "verified.json"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SEARCH.items()]
    code = main(
        [
            "eval",
            "--dataset",
            str(data),
            "--output",
            str(output),
            "--dtype",
            "float32",
            "--kv-cache-memory",
            str(KV),
            "--verifier",
            orm_dir,
            *flags,
        ]
    )
    assert code == 0  # run_eval checked that every page was back
    results = read_results(output)
    assert results["config"]["verifier"]["path"] == orm_dir
    cli = results["problems"][0]["completions"]

    served = search_http(verified_server, {})  # verify: true by default when a verifier is served
    assert served.status_code == 200, served.text
    http = served.json()
    assert http["verified"] is True
    plain = search_http(verified_server, {"verify": False}).json()
    assert plain["verified"] is False
    assert http["usage"]["verifier_tokens"] > 0 and plain["usage"]["verifier_tokens"] == 0  # what it read, counted
    verified_server.check_baseline()

    python = python_api(orm_dir, verify=True)
    assert signature(http["completions"]) == signature(cli, approx=True)
    assert signature(python) == signature(cli, approx=True)
    assert results["problems"][0]["pred"] == http["answers_by_rule"]["weighted"]
    # the verifier's scores, not the PRM's: the same beams, re-scored and sorted by their last score
    assert sorted(c["text"] for c in plain["completions"]) == sorted(c["text"] for c in python)
    assert [c["step_scores"] for c in plain["completions"]] != [c["step_scores"] for c in python]
    finals = [c["step_scores"][-1] for c in python]
    assert finals == sorted(finals, reverse=True)


def test_models_list_the_verifier_with_its_role(verified_server, orm_dir):
    orm = os.path.basename(orm_dir)  # a verifier's name: its directory's
    cards = httpx.get(verified_server.base_url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [(c["id"], c["role"]) for c in cards] == [("arith", "generator"), ("arith-prm", "prm"), (orm, "verifier")]
    response = httpx.post(
        verified_server.base_url + "/v1/prm/score",
        headers=AUTH,
        timeout=10,
        json={"model": orm, "question": QUESTION, "steps": ["3 * 18 = 54."]},
    )
    assert response.status_code == 400 and "not a PRM" in response.json()["error"]["message"]


def test_verify_without_a_served_verifier_is_a_400(server):
    response = search_http(server, {"verify": True})
    assert response.status_code == 400
    assert "verify" in response.json()["error"]["message"] and "--verifier" in response.json()["error"]["message"]
    assert search_http(server, {"verify": False, "num_iterations": 1}).status_code == 200


def test_reasoning_on_a_generator_without_think_tokens_is_a_400(server):
    response = search_http(server, {"reasoning": True})
    assert response.status_code == 400
    assert "reasoning search needs a generator" in response.json()["error"]["message"]


def test_a_process_prm_is_refused_as_the_verifier_before_loading(tmp_path, capsys):
    prm = build_token_classification(str(tmp_path / "tc"), "qwen2", bias=True)
    code = main(["eval", "--dataset", "arith:level=1,size=1", "--output", str(tmp_path / "r.json"), "--verifier", prm])
    assert code == 2
    err = capsys.readouterr().err
    assert "outcome reward model" in err and "token_classification" in err
    assert not (tmp_path / "r.json").exists()


def test_a_process_prm_its_files_do_not_name_is_refused_once_loaded(tmp_path):
    """A value-head PRM (its style found from its tensors, not its files) as the verifier: the
    server does not start, with the reason (it raised AttributeError before)."""
    prm = build_value_head(str(tmp_path / "vh"))
    settings = ServerSettings(
        ModelSettings(DEFAULT_GENERATOR),
        prm=ModelSettings(DEFAULT_PRM),
        verifier=ModelSettings(prm),
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=KV),
    )
    with pytest.raises(ValueError, match="must be an outcome reward model .style orm., got style 'value_head'"):
        build_served(settings)
