"""Traced searches on the server: `"trace": true` on /v1/search, the bounded ring, GET
/v1/search/{id}/trace, the HTML of /ui and /ui/{id}, and their API key (header or cookie)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import API_KEY, LiveServer
from treeserve.search.trace import nodes
from treeserve.server.traces import TraceRing

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SEARCH = {
    "problem": "Compute (12 + 7) * 3. <script>alert(1)</script>",
    "strategy": "beam_search",
    "n": 4,
    "beam_width": 2,
    "num_iterations": 6,
    "seed": 3,
}


def post(server: LiveServer, body: dict) -> dict:
    response = httpx.post(server.base_url + "/v1/search", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def get(server: LiveServer, path: str, **kwargs) -> httpx.Response:
    return httpx.get(server.base_url + path, timeout=30, **kwargs)


def test_a_traced_search_returns_and_keeps_its_trace(server):
    plain = post(server, SEARCH)
    traced = post(server, {**SEARCH, "trace": True})
    assert "trace" not in plain and "problem" not in plain
    assert traced["problem"] == SEARCH["problem"]
    assert [c["text"] for c in traced["completions"]] == [c["text"] for c in plain["completions"]]
    assert traced["answer"] == plain["answer"]
    trace = traced["trace"]
    assert trace["strategy"] == "beam_search" and trace["n"] == 4
    assert len(trace["completions"]) == len(traced["completions"])
    iterations = {n["iteration"] for n in nodes(trace)}
    assert iterations == set(range(max(iterations) + 1))
    kept = get(server, f"/v1/search/{traced['id']}/trace", headers=AUTH)
    assert kept.status_code == 200 and kept.json()["trace"] == trace
    assert get(server, f"/v1/search/{plain['id']}/trace", headers=AUTH).status_code == 404  # not traced
    assert get(server, f"/v1/search/{traced['id']}/trace").status_code == 401  # auth as everywhere

    listing = get(server, "/ui", headers=AUTH)
    assert listing.status_code == 200 and f'href="/ui/{traced["id"]}"' in listing.text
    assert "<script>alert(1)" not in listing.text and "&lt;script&gt;alert(1)" in listing.text
    page = get(server, f"/ui/{traced['id']}", headers=AUTH)
    assert page.status_code == 200 and "treeserve view" in page.text and "<script>alert(1)" not in page.text
    missing = get(server, "/ui/search-nope", headers=AUTH)
    assert missing.status_code == 404 and "--trace-ring" in missing.json()["error"]["message"]


def test_a_streamed_traced_search_is_kept(server):
    body = {**SEARCH, "trace": True, "stream": True, "seed": 4}
    with httpx.stream("POST", server.base_url + "/v1/search", json=body, headers=AUTH, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    result = json.loads(events[-1])
    assert result["object"] == "search" and result["trace"]["nodes"]
    assert server.served.traces.get(result["id"]) is not None


def test_ui_takes_the_key_once_as_a_token_then_as_a_cookie(server):
    assert get(server, "/ui").status_code == 401
    assert get(server, "/ui?token=wrong").status_code == 401
    first = get(server, "/ui?token=" + API_KEY)
    assert first.status_code == 303 and first.headers["location"] == "/ui"
    cookie = first.cookies.get("treeserve_api_key")
    assert cookie == API_KEY and "httponly" in first.headers["set-cookie"].lower()
    assert get(server, "/ui", cookies={"treeserve_api_key": cookie}).status_code == 200
    # the cookie opens /ui only; the API still wants the header
    assert get(server, "/v1/models", cookies={"treeserve_api_key": cookie}).status_code == 401
    assert get(server, "/v1/models?token=" + API_KEY).status_code == 401


def test_the_ring_keeps_the_newest():
    ring = TraceRing(size=2)
    for i in range(3):
        ring.add({"id": f"s{i}", "problem": f"q{i}", "trace": {"nodes": []}})
    ring.add({"id": "s9", "problem": "untraced"})  # a result without a trace is not kept
    assert list(ring.entries) == ["s1", "s2"]
    assert ring.get("s0") is None and "newest 2" in ring.missing("s0")
    none = TraceRing(size=0)
    none.add({"id": "s", "problem": "q", "trace": {"nodes": []}})
    assert not none.entries  # 0 keeps none


@pytest.mark.parametrize("size", [-1])
def test_a_negative_ring_is_refused(size):
    from treeserve.eval.runner import DEFAULT_GENERATOR
    from treeserve.runtime.model_settings import ModelSettings
    from treeserve.server.settings import ServerSettings

    with pytest.raises(ValueError, match="trace_ring"):
        ServerSettings(ModelSettings(DEFAULT_GENERATOR), trace_ring=size).check()
