"""The server with its engines in an engine-core process (what `treeserve serve` runs).

Answers equal the in-process server's (greedy and seeded, logprobs, echo, streaming,
`/v1/search`), so the deltas rebuild every output exactly. Fault tests: an injected failing
step fails only its request (500); kill -9 of the core mid-load answers in-flight requests
503, `/health` says 503 until the core is back, later requests succeed and the new core
holds no page; SIGTERM with streams open exits 0 within the shutdown timeout; a 10 MB JSON
body, a slow-loris client and 1,000 dropped connections leave `/health` answering.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL, LiveServer, start_server
from tests.server.test_failures import AUTH, CHAT, post
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.server.launch import build_core_served
from treeserve.server.settings import ServerSettings

SETTINGS = dict(
    generator=ModelSettings(DEFAULT_GENERATOR),
    prm=ModelSettings(DEFAULT_PRM),
    served_model_name=MODEL,
    api_key=API_KEY,
    runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
)
SEARCH = {"problem": "Compute (12 + 7) * 3.", "n": 4, "beam_width": 2, "seed": 3}


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def metric(server: LiveServer, name: str, model: str | None = None) -> float:
    text = httpx.get(server.base_url + "/metrics", headers=AUTH, timeout=10).text
    label = f'{{model="{model}"}}' if model else ""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + label + " "))


def wait_healthy(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError("the server did not become healthy")


@pytest.fixture(scope="module")
def core_server() -> Iterator[LiveServer]:
    live = start_server(ServerSettings(**SETTINGS), build=build_core_served)  # started: the core is up
    yield live
    live.stop()
    assert not live.served.runtime.process.is_alive()  # the core stopped with the server


def idle(server: LiveServer) -> None:
    """No request live in the core and no page held by one (the prefix cache may keep some)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(server, "treeserve_kv_pages_used") == 0 and metric(server, "treeserve_num_requests_running") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("pages still held after the test")


BODIES = [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "temperature": 0.0}),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 24,
            "temperature": 0.9,
            "seed": 5,
            "n": 2,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    (
        "/v1/completions",
        {"prompt": "Compute 3 + 4.", "max_tokens": 12, "echo": True, "logprobs": 1, "stop": ["="], "seed": 1},
    ),
    ("/v1/search", SEARCH),
]


def strip_ids(body: object) -> object:
    """The body without its ids and times, floats to 5 significant digits (two processes may
    run a different number of threads: log-probabilities can differ in the last bits)."""
    if isinstance(body, dict):
        return {k: strip_ids(v) for k, v in body.items() if k not in ("id", "created", "timing")}
    if isinstance(body, list):
        return [strip_ids(v) for v in body]
    return float(f"{body:.5g}") if isinstance(body, float) else body


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_answers_equal_the_in_process_server(core_server, server, path, body):
    want = post(server, path, body)
    got = post(core_server, path, body)
    assert got.status_code == want.status_code == 200
    assert strip_ids(got.json()) == strip_ids(want.json())
    idle(core_server)


STREAMED = [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "temperature": 0.9, "seed": 5, "n": 2}),
    (
        "/v1/completions",
        {
            "prompt": "Compute 3 + 4.",
            "max_tokens": 16,
            "temperature": 0.9,
            "seed": 2,
            "n": 2,
            "logprobs": 1,
            "prompt_logprobs": 1,
            "stop": [" 7"],
        },
    ),
]


@pytest.mark.parametrize(("path", "body"), STREAMED)
def test_streams_equal_the_in_process_server(core_server, server, path, body):
    """Per choice, the chunks put together: text, logprobs and their offsets, the finish, and
    the prompt's logprobs of its first chunk (the core sends deltas; the chunks may split
    differently, as each process's consumer keeps up)."""

    def gathered(live: LiveServer) -> dict[int, dict]:
        out: dict[int, dict] = {}
        with httpx.stream("POST", live.base_url + path, json={**body, "stream": True}, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                for choice in json.loads(line[6:])["choices"] if line.startswith("data: {") else []:
                    seen = out.setdefault(choice["index"], {"text": "", "first": choice.get("prompt_logprobs")})
                    seen["text"] += choice.get("text") or choice.get("delta", {}).get("content", "")
                    lp = choice.get("logprobs") or {}
                    for key in ("token_logprobs", "text_offset"):
                        seen[key] = seen.get(key, []) + lp.get(key, [])
                    seen["finish"] = choice["finish_reason"] or seen.get("finish")
        return out

    assert strip_ids(gathered(core_server)) == strip_ids(gathered(server))
    idle(core_server)


def test_a_traced_search_in_the_core_is_kept_by_the_api_process(core_server):
    out = post(core_server, "/v1/search", {**SEARCH, "trace": True})
    assert out.status_code == 200 and out.json()["trace"]["nodes"]
    kept = httpx.get(f"{core_server.base_url}/v1/search/{out.json()['id']}/trace", headers=AUTH, timeout=10)
    assert kept.status_code == 200 and kept.json()["trace"] == out.json()["trace"]
    idle(core_server)


def test_bad_input_is_answered_by_the_api_process(core_server):
    bad = post(core_server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**6})
    assert bad.status_code == 400 and "maximum context length" in bad.json()["error"]["message"]
    bad_search = post(core_server, "/v1/search", {**SEARCH, "strategy": "alphago"})
    assert bad_search.status_code == 400


def test_a_deadline_before_any_scored_iteration_is_a_400_from_the_core_too(core_server):
    out = post(core_server, "/v1/search", {**SEARCH, "deadline_s": 1e-6})
    assert out.status_code == 400 and "first iteration" in out.json()["error"]["message"], out.text
    idle(core_server)


def test_an_injected_failing_step_fails_only_its_request(core_server):
    core_server.served.runtime.inject_failure("generator")
    time.sleep(0.2)
    failed = post(core_server, "/v1/chat/completions", BODIES[0][1])
    assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
    assert post(core_server, "/v1/chat/completions", BODIES[0][1]).status_code == 200
    idle(core_server)


def test_kill_9_mid_load(core_server):
    client = core_server.served.runtime
    # the core steps overlapped: the kill meets steps in flight
    assert client.settings.generator.scheduler_config.async_scheduling
    restarts = client.restarts
    statuses: list[object] = []

    def stream() -> None:
        body = {"messages": CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream(
                "POST", core_server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60
            ) as r:
                last = [line for line in r.iter_lines() if line.startswith("data: ")][-2]
                statuses.append(r.status_code if r.status_code != 200 else json.loads(last[6:]).get("error"))
        except httpx.HTTPError as e:
            statuses.append(e)

    def whole() -> None:
        body = {"messages": CHAT, "max_tokens": 400, "ignore_eos": True}
        response = post(core_server, "/v1/chat/completions", body)
        statuses.append(response.json()["error"] if response.status_code != 200 else 200)

    threads = [threading.Thread(target=stream) for _ in range(4)] + [threading.Thread(target=whole)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the streams are running
    os.kill(client.process.pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert len(statuses) == 5 and all(isinstance(s, dict) and s["code"] == 503 for s in statuses), statuses
    assert httpx.get(core_server.base_url + "/health", timeout=5).status_code in (200, 503)
    wait_healthy(core_server.base_url)
    assert client.restarts == restarts + 1
    ok = post(core_server, "/v1/chat/completions", BODIES[0][1])
    assert ok.status_code == 200
    assert metric(core_server, "treeserve_engine_core_restarts_total") >= 1
    idle(core_server)  # the new core's pages are all back


def test_hostile_clients_leave_health_answering(core_server):
    huge = '{"messages": [{"role": "user", "content": "' + "x" * (10 << 20) + '"}], "max_tokens": 4}'
    result: list[int] = []
    sender = threading.Thread(target=lambda: result.append(post(core_server, "/v1/chat/completions", huge).status_code))
    port = int(core_server.base_url.rsplit(":", 1)[1])
    loris = socket.create_connection(("127.0.0.1", port))
    loris.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    sender.start()
    dropped = []
    for _ in range(1000):
        s = socket.create_connection(("127.0.0.1", port))
        dropped.append(s)
        if len(dropped) == 100:
            for d in dropped:
                d.close()
            dropped.clear()
        if _ % 200 == 0:
            start = time.monotonic()
            assert httpx.get(core_server.base_url + "/health", timeout=5).status_code == 200
            assert time.monotonic() - start < 2.0
    sender.join(60)
    assert result and result[0] == 400  # the prompt is far past the context
    assert httpx.get(core_server.base_url + "/health", timeout=5).status_code == 200
    loris.close()


def test_sigterm_with_streams_open(tmp_path):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    command = [
        sys.executable,
        "-m",
        "treeserve.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "64M",
        "--shutdown-timeout",
        "2",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        lines: list[str] = []

        def stream() -> None:
            body = {"messages": CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with (
                contextlib.suppress(httpx.HTTPError),
                httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r,
            ):
                lines.extend(r.iter_lines())

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        t.join(30)
        assert lines  # it was streaming when the signal came
        deadline = time.monotonic() + 10  # the core (and multiprocessing's helper) end with the server
        while left := subprocess.run(["pgrep", "-a", "-g", str(proc.pid)], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline, f"processes left behind: {left}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
