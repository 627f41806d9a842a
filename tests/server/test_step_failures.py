"""An engine step that raises, over HTTP: the requests it was serving get a 500 with an
OpenAI error body (a stream already under way: an error event, then [DONE]); their pages
return to the pool (the `server` fixture checks the baseline) and the next request succeeds."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import LiveServer
from tests.server.test_failures import AUTH, CHAT, post

BODY = {"messages": CHAT, "max_tokens": 8, "temperature": 0.0}


def test_a_failed_step_is_a_500_and_the_next_request_succeeds(server: LiveServer) -> None:
    want = post(server, "/v1/chat/completions", BODY).json()["choices"][0]["message"]["content"]
    server.served.runtime.engine("generator").inject_failure()
    failed = post(server, "/v1/chat/completions", BODY)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == 500 and "injected step failure" in error["message"]
    again = post(server, "/v1/chat/completions", BODY)
    assert again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"] == want


def test_a_stream_ends_with_an_error_event(server: LiveServer) -> None:
    server.served.runtime.engine("generator").inject_failure()
    with httpx.stream(
        "POST", server.base_url + "/v1/chat/completions", json={**BODY, "stream": True}, headers=AUTH, timeout=60
    ) as response:
        assert response.status_code == 200  # sent before the step ran
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 500


def test_a_search_whose_step_fails_is_a_500(server: LiveServer) -> None:
    server.served.runtime.engine("prm").inject_failure()
    failed = post(server, "/v1/search", {"problem": "Compute 1 + 2.", "n": 4, "beam_width": 2, "max_tokens": 16})
    assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
    ok = post(server, "/v1/search", {"problem": "Compute 1 + 2.", "n": 4, "beam_width": 2, "max_tokens": 16})
    assert ok.status_code == 200
