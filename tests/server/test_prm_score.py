"""`POST /v1/prm/score` over the shipped arithmetic generator + PRM, in both server modes.

Its scores are the PRM adapter's: equal to `PRM.score` offline and to the step scores a
`/v1/search` beam search returns for the same steps (within 1e-6: a score's last bits follow
what the prefix cache held). A repeated prefix is answered from the server's score cache
without a PRM read; concurrent requests for the same steps share one. `/v1/models` gives every
model its role. Each bad body is a 400 naming the field, a PRM input past the context is a 400
with the adapter's message, and every page is back after each test.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL, LiveServer, start_server
from tests.server.test_engine_process import idle
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.prm import load_prm
from treeserve.server.launch import build_core_served
from treeserve.server.prm_api import LRUScores
from treeserve.server.settings import ServerSettings

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PRM_NAME = "arith-prm"  # the PRM directory's name
QUESTION = "Compute (12 + 7) * 3."
SOLUTIONS = [
    ["12 + 7 = 19, leaving 19 * 3.", "19 * 3 = 57.", "The answer is \\boxed{57}."],
    ["12 + 7 = 19, leaving 19 * 3.", "19 * 3 = 54.", "The answer is \\boxed{54}."],
    ["12 + 7 = 18, leaving 18 * 3."],
]
SEARCH = {
    "strategy": "beam_search",
    "n": 4,
    "beam_width": 2,
    "num_iterations": 3,
    "max_tokens": 48,
    "seed": 3,
    "temperature": 1.0,
}
RUNTIME = {"dtype": "float32", "kv_cache_memory": 64 << 20}
LONG_STEPS = [f"{i} + {i} = {2 * i}, leaving {2 * i} + 1." for i in range(60)]  # ~1,700 PRM tokens, past 512


def settings(prm: bool = True) -> ServerSettings:
    return ServerSettings(
        ModelSettings(DEFAULT_GENERATOR),
        ModelSettings(DEFAULT_PRM) if prm else None,
        served_model_name=MODEL,
        api_key=API_KEY,
        runtime=RuntimeSettings.from_flat(**RUNTIME),
    )


def score(server: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/prm/score", json=body, headers=AUTH, timeout=60)


def scored(server: LiveServer, body: dict) -> dict:
    response = score(server, body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def offline() -> Iterator:
    """`PRM.score` on a runtime of the server's settings, run as a search runs it."""
    runtime = RuntimeSettings.from_flat(**RUNTIME)
    generator, prm = ModelSettings(DEFAULT_GENERATOR), ModelSettings(DEFAULT_PRM)
    runtime.check(generator, prm)
    rt = runtime.load(generator, prm)
    adapter = load_prm(rt, "prm")

    def run(question: str, solutions: list[list[str]]) -> list[list[float]]:
        async def body() -> list[list[float]]:
            return [await adapter.score(question, steps) for steps in solutions]

        return asyncio.run(body())

    yield run
    asyncio.run(rt.close())
    rt.check_pages_idle()


@pytest.fixture(scope="module")
def core_server() -> Iterator[LiveServer]:
    live = start_server(settings(), build=build_core_served)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def no_prm_server() -> Iterator[LiveServer]:
    live = start_server(settings(prm=False))
    yield live
    live.stop()


def prm_reads(server: LiveServer) -> int:
    """Prefix-cache lookups of the PRM's engine: every request that reaches it makes some."""
    stats = server.served.runtime.engine("prm").pages.stats
    return stats.hits + stats.misses


def test_models_give_every_model_its_role(server):
    cards = httpx.get(server.base_url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    generator = {
        "id": MODEL,
        "object": "model",
        "created": 0,
        "owned_by": "treeserve",
        "max_model_len": server.served.max_model_len,
        "role": "generator",
    }
    assert cards[0] == generator
    assert [(c["id"], c["role"]) for c in cards[1:]] == [(PRM_NAME, "prm")]
    assert cards[1]["max_model_len"] == server.served.runtime.engine("prm").max_model_len


def test_single_and_batch_scores_equal_prm_score_offline(server, offline):
    want = offline(QUESTION, SOLUTIONS)
    one = scored(server, {"model": PRM_NAME, "question": QUESTION, "steps": SOLUTIONS[0]})
    assert one["object"] == "prm.score" and one["model"] == PRM_NAME and one["id"].startswith("prmscore-")
    assert one["scores"] == pytest.approx(want[0], abs=1e-6)
    batch = scored(server, {"question": QUESTION, "solutions": SOLUTIONS})
    assert len(batch["scores"]) == len(SOLUTIONS)
    for got, expected in zip(batch["scores"], want, strict=True):
        assert got == pytest.approx(expected, abs=1e-6)
    assert batch["scores"][0] == one["scores"]  # from the cache: the same numbers
    assert want[1][1] < 0.1 < 0.5 < want[0][1]  # the PRM tells the wrong step apart


def test_scores_equal_a_beam_searchs_step_scores(server, offline):
    search = httpx.post(
        server.base_url + "/v1/search", json={"problem": QUESTION, **SEARCH}, headers=AUTH, timeout=120
    ).json()
    completions = search["completions"]
    solutions = [c["steps"] for c in completions]
    got = scored(server, {"question": QUESTION, "solutions": solutions})["scores"]
    for scores, c in zip(got, completions, strict=True):
        assert scores == pytest.approx(c["step_scores"], abs=1e-6)
    for scores, expected in zip(got, offline(QUESTION, solutions), strict=True):
        assert scores == pytest.approx(expected, abs=1e-6)


def test_a_repeated_prefix_reads_nothing_new(server):
    question = "Compute (8 + 5) * 2."
    steps = ["8 + 5 = 13, leaving 13 * 2.", "13 * 2 = 26. The answer is \\boxed{26}."]
    first = scored(server, {"question": question, "steps": steps[:1]})
    assert first["usage"]["prompt_tokens"] > 0 and first["usage"]["cached_steps"] == 0
    assert first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"]

    grown = scored(server, {"question": question, "steps": steps})  # the first step's score from the cache
    assert grown["scores"][0] == first["scores"][0]
    assert grown["usage"]["cached_steps"] == 1 and grown["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]

    reads = prm_reads(server)
    again = scored(server, {"question": question, "solutions": [steps, steps[:1]]})
    assert again["scores"] == [grown["scores"], first["scores"]]
    assert again["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0, "cached_steps": 3}
    assert prm_reads(server) == reads  # no request reached the PRM's engine


def test_concurrent_requests_for_the_same_steps_read_once(server):
    body = {"question": "Compute 6 * 7 - 2.", "steps": ["6 * 7 = 42, leaving 42 - 2.", "42 - 2 = 40."]}
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(scored(server, body))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({tuple(r["scores"]) for r in results}) == 1
    built = sorted(r["usage"]["prompt_tokens"] for r in results)
    assert built[:3] == [0, 0, 0] and built[3] > 0  # one request read them; the others shared or found them


BAD = [
    ({"steps": ["a"]}, "question"),
    ({"question": "", "steps": ["a"]}, "question must not be empty"),
    ({"question": "  ", "solutions": [["a"]]}, "question must not be empty"),
    ({"question": QUESTION}, "exactly one of 'steps'"),
    ({"question": QUESTION, "steps": ["a"], "solutions": [["a"]]}, "exactly one of 'steps'"),
    ({"question": QUESTION, "steps": []}, "steps"),
    ({"question": QUESTION, "steps": ["a", 3]}, "steps.1"),
    ({"question": QUESTION, "steps": "a"}, "steps"),
    ({"question": QUESTION, "solutions": []}, "solutions"),
    ({"question": QUESTION, "solutions": [["a"], []]}, "solutions.1"),
    ({"question": QUESTION, "solutions": [["a"], [None]]}, "solutions.1.0"),
    ({"question": 7, "steps": ["a"]}, "question"),
    ({"question": QUESTION, "step": ["a"]}, "step"),
    ({"model": MODEL, "question": QUESTION, "steps": ["a"]}, "model"),
]


@pytest.mark.parametrize(("body", "field"), BAD)
def test_a_bad_body_is_a_400_naming_the_field(server, body, field):
    response = score(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] and error["type"] == "invalid_request_error"


def test_an_unknown_model_is_a_404(server):
    response = score(server, {"model": "nope", "question": QUESTION, "steps": ["a"]})
    assert response.status_code == 404 and PRM_NAME in response.json()["error"]["message"]


def test_an_input_past_the_prms_context_is_a_400(server, offline):
    too_long = score(server, {"question": QUESTION, "steps": LONG_STEPS})
    assert too_long.status_code == 400
    assert "steps: the PRM input needs" in too_long.json()["error"]["message"]
    assert "reads at most 512" in too_long.json()["error"]["message"]
    batch = score(server, {"question": QUESTION, "solutions": [SOLUTIONS[0], LONG_STEPS]})
    assert batch.status_code == 400 and "solutions[1]: the PRM input needs" in batch.json()["error"]["message"]
    assert server.idle()
    server.served.runtime.check_pages_idle()
    fine = scored(server, {"question": QUESTION, "steps": LONG_STEPS[:10]})  # the server goes on
    assert fine["scores"] == pytest.approx(offline(QUESTION, [LONG_STEPS[:10]])[0], abs=1e-6)


def test_a_client_that_leaves_aborts_its_reads(server):
    solutions = [[f"{i} * {j} = {i * j}." for j in range(1, 12)] for i in range(64)]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            server.base_url + "/v1/prm/score",
            json={"question": "Compute it.", "solutions": solutions},
            headers=AUTH,
            timeout=0.05,
        )
    # the `server` fixture checks that no request is left and every page is back


def test_a_server_without_a_prm_says_how_to_start_one(no_prm_server):
    response = score(no_prm_server, {"question": QUESTION, "steps": ["a"]})
    assert response.status_code == 400 and "--prm DIR" in response.json()["error"]["message"]
    cards = httpx.get(no_prm_server.base_url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [(c["id"], c["role"]) for c in cards] == [(MODEL, "generator")]
    no_prm_server.check_baseline()


def test_the_engine_core_process_scores_the_same(core_server, server):
    cards = httpx.get(core_server.base_url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [(c["id"], c["role"]) for c in cards] == [(MODEL, "generator"), (PRM_NAME, "prm")]
    want = scored(server, {"question": QUESTION, "solutions": SOLUTIONS})["scores"]
    got = scored(core_server, {"question": QUESTION, "solutions": SOLUTIONS})
    for scores, expected in zip(got["scores"], want, strict=True):
        assert scores == pytest.approx(expected, abs=1e-5)  # two processes' thread counts: the last bits may differ
    assert got["usage"]["prompt_tokens"] > 0
    again = scored(core_server, {"question": QUESTION, "steps": SOLUTIONS[1]})
    assert again["scores"] == got["scores"][1] and again["usage"]["prompt_tokens"] == 0
    too_long = score(core_server, {"question": QUESTION, "solutions": [LONG_STEPS]})
    assert too_long.status_code == 400 and "solutions[0]: the PRM input needs" in too_long.json()["error"]["message"]
    assert score(core_server, {"question": QUESTION, "steps": []}).status_code == 400
    assert score(core_server, {"model": "nope", "question": QUESTION, "steps": ["a"]}).status_code == 404
    idle(core_server)


def test_the_lru_keeps_a_prefixs_first_steps_longest():
    cache = LRUScores(capacity=4)
    cache.store([1, 2, 3], [0.1, 0.2, 0.3])
    cache.store([1, 4], [0.1, 0.4])  # four entries: 1 newest, then 4, 2, 3
    assert cache.known([1, 2, 3]) == [0.1, 0.2, 0.3]
    cache.store([5], [0.5])  # over capacity: the oldest (4) goes
    assert cache.known([1, 4]) == [0.1] and len(cache.scores) == 4
    assert cache.known([1, 2, 3]) == [0.1, 0.2, 0.3]
