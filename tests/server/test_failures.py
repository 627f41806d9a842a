"""Failure behaviour over HTTP: auth, bad input (4xx with an OpenAI error body, never 5xx),
client disconnects (requests aborted, pool back at baseline), and too little KV memory
(requests queue or are preempted and still give the same answers)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL, LiveServer, start_server
from treeserve import LLM, SamplingParams
from treeserve.eval.runner import DEFAULT_GENERATOR
from treeserve.kv.arena import KVArena
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.server.settings import ServerSettings

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Compute ((12 + 7) * 3) - 15."}]
JSON = {"type": "json_object"}
NO_INTEGER = {"type": "integer", "minimum": 5, "maximum": 3}
NO_INTEGER_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": NO_INTEGER}}


def post(server: LiveServer, path: str, body: object, **kwargs: object) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=60, **kwargs)


def generated(server: LiveServer) -> int:
    return server.served.runtime.engine("generator").num_generated_tokens


def test_every_route_but_health_needs_the_key(server: LiveServer) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.base_url + path).status_code == 401
        bad = httpx.get(server.base_url + path, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
        assert httpx.get(server.base_url + path, headers=AUTH).status_code == 200
    no_key = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi"})
    assert no_key.status_code == 401


BAD_INPUTS = [
    ("/v1/completions", "{not json", 400),
    ("/v1/completions", {"prompt": 123}, 400),
    ("/v1/completions", {"prompt": "hi", "n": "many"}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404),
    ("/v1/completions", {"prompt": [5] * 600}, 400),  # longer than the context
    ("/v1/completions", {"prompt": [10**9]}, 400),  # token id outside the vocabulary
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "repetition_penalty": 5e-324}, 400),  # found by the fuzz test
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 200}}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"five": 1}}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400),  # outside the vocabulary
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400),  # above the server's cap
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),  # only with echo
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": -2.1}, 400),
    ("/v1/completions", '{"prompt": "a\\ud800b"}', 400),  # a lone surrogate cannot be tokenized
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 100_000}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400),  # no json_schema
    ("/v1/chat/completions", {"messages": CHAT, "response_format": NO_INTEGER_FORMAT}, 400),  # unsatisfiable
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": {"type": "bogus"}}}, 400),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "(a"}}, 400),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": "start: ("}}, 400),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a{500}"}, "max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": ["x" * 99, "y" * 99]}, "max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a"}, "response_format": JSON}, 400),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "strategy": "alphago"}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "n": 6, "beam_width": 4}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "strategy": "majority", "lookahead": 1}, 400),  # no steps
    ("/v1/search", {"problem": "Compute 1 + 2.", "lookahead": -1}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "answer_regex": "(unclosed"}, 400),  # checked before the search
    ("/v1/search", {"problem": "x", "messages": CHAT}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "adaptive": True, "certainty": 2}, 400),  # SearchConfig's checks
    ("/v1/search", {"problem": "Compute 1 + 2.", "adaptive": True, "certainty": 0}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "adaptive": True, "first_width": 0}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "adaptive": True, "first_width": 3, "beam_width": 2}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "budget_tokens": 500}, 400),  # a budget needs adaptive
    ("/v1/search", {"problem": "Compute 1 + 2.", "prompt_format": "no question"}, 400),
    ("/v1/search", {"messages": CHAT, "strategy": "majority", "prompt_format": "Q: {question}"}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "stop": ["ok", ""]}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "stop": 7}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "deadline_s": 0}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "deadline_s": -1.5}, 400),
    ("/v1/search", {}, 400),
    ("/v1/search", {"problem": "Compute 1 + 2.", "model": "other"}, 404),
]


@pytest.mark.parametrize(("path", "body", "status"), BAD_INPUTS)
def test_bad_input_is_a_4xx_with_an_openai_error_body(server: LiveServer, path: str, body: object, status: int) -> None:
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("certainty", 2), ("certainty", 0), ("first_width", 0), ("deadline_s", 0), ("budget_tokens", 0)],
)
def test_bad_adaptive_values_are_refused_naming_the_field(server: LiveServer, field: str, value: float) -> None:
    before = generated(server)
    response = post(server, "/v1/search", {"problem": "Compute 1 + 2.", "adaptive": True, field: value})
    assert response.status_code == 400 and field in response.json()["error"]["message"], response.text
    assert generated(server) == before  # refused before anything started


def test_bad_requests_leave_a_running_request_alone(server: LiveServer) -> None:
    """A stream runs while bad requests arrive; it finishes with the text it has when alone."""
    body = {"model": MODEL, "messages": CHAT, "temperature": 0, "max_tokens": 200}
    alone = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    result: dict = {}

    def run() -> None:
        result["text"] = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]

    thread = threading.Thread(target=run)
    thread.start()
    for path, bad, status in BAD_INPUTS:
        assert post(server, path, bad).status_code == status
    thread.join()
    assert result["text"] == alone


def test_the_server_steps_overlapped(server: LiveServer) -> None:
    """The suite's servers overlap their steps (tests/conftest.py), so the disconnects below meet
    steps in flight."""
    assert all(engine.async_scheduling for engine in server.served.runtime.engines.values())


def test_disconnect_mid_stream_aborts_and_returns_the_pages(server: LiveServer) -> None:
    full = 4 * 400
    body = {"model": MODEL, "prompt": "Compute 1 + 2.", "max_tokens": 400, "n": 4, "ignore_eos": True, "stream": True}
    before = generated(server)
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    assert server.idle()
    assert generated(server) - before < full  # aborted, not run to the end
    server.served.runtime.check_pages_idle()


def test_disconnect_while_waiting_for_a_whole_response_aborts(server: LiveServer) -> None:
    full = 4 * 400
    body = json.dumps({"model": MODEL, "prompt": "Compute 1 + 2.", "max_tokens": 400, "n": 4, "ignore_eos": True})
    host, port = server.base_url.removeprefix("http://").split(":")
    before = generated(server)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
            ).encode()
        )
        deadline = time.monotonic() + 30  # close only once the engine generates for this request
        while generated(server) == before and time.monotonic() < deadline:
            time.sleep(0.005)
    assert server.idle()
    assert generated(server) - before < full
    server.served.runtime.check_pages_idle()


def test_disconnect_from_a_streamed_search_cancels_it(server: LiveServer) -> None:
    body = {"problem": "Compute ((((9 * 4) - 6) + 11) - 8) * 2.", "n": 16, "beam_width": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/search", json=body, headers=AUTH, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["object"] == "search.progress"
    assert server.idle()
    server.served.runtime.check_pages_idle()


def test_metrics_count_requests_tokens_and_pages(server: LiveServer) -> None:
    post(server, "/v1/completions", {"prompt": "Compute 1 + 2.", "max_tokens": 5})
    post(server, "/v1/completions", {"prompt": "hi", "n": 0})
    text = httpx.get(server.base_url + "/metrics", headers=AUTH).text
    for name in (
        'treeserve_http_requests_total{route="/v1/completions",status="200"}',
        'treeserve_http_requests_total{route="/v1/completions",status="400"}',
        "treeserve_generation_tokens_total",
        "treeserve_time_to_first_token_seconds_count",
        "treeserve_inter_token_latency_seconds_count",
        'treeserve_num_requests_running{model="prm"}',
        'treeserve_kv_pages_used{model="generator"}',
        'treeserve_kv_pages_cached{model="generator"}',
        'treeserve_prefix_cache_hit_rate{model="generator"}',
        'treeserve_kv_evictions_total{model="prm"}',
        'treeserve_kv_thrash_total{model="generator"}',
        'treeserve_prefix_cache_tail_hits_total{model="generator"}',
    ):
        assert name in text, name


def test_too_little_kv_memory_queues_and_preempts_without_changing_answers() -> None:
    offline = LLM(DEFAULT_GENERATOR, dtype="float32", kv_cache_memory=16 << 20, max_model_len=128)
    cfg = offline.engine.model_config
    page = KVArena.page_bytes(
        cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, offline.engine.config.device_config.torch_dtype
    )
    settings = ServerSettings(
        ModelSettings.from_flat(DEFAULT_GENERATOR, max_model_len=128),
        served_model_name=MODEL,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=12 * page),
    )  # one 128-token sequence needs 9 pages
    server = start_server(settings)
    try:
        prompts = [f"Compute (({a} + 7) * 3) - {a}." for a in range(2, 10)]
        params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
        want = [o.outputs[0].text for o in offline.generate(prompts, params)]
        got: dict[int, str] = {}

        def run(i: int) -> None:
            body = {"prompt": prompts[i], "temperature": 0, "max_tokens": 90, "ignore_eos": True}
            response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
            got[i] = response.json()["choices"][0]["text"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[i] for i in range(len(prompts))] == want
        assert server.served.runtime.engine("generator").scheduler.num_preemptions > 0
        server.check_baseline()
    finally:
        server.stop()
