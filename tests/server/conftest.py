"""A real uvicorn server on a loopback port the OS picks, in a thread, over the shipped models.

The shipped arithmetic generator and PRM (3.3M parameters each) are the tiny models here:
they have a chat template and a PRM, so chat and `/v1/search` are exercised for real.
After each test the pool must be back at its baseline: no live requests, every page free
or held by the prefix cache.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import uvicorn

from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.server.app import build_app
from treeserve.server.completions import Served
from treeserve.server.settings import ServerSettings, build_served

API_KEY = "test-key"
MODEL = "arith"


@dataclass
class LiveServer:
    served: Served
    server: uvicorn.Server
    thread: threading.Thread
    base_url: str  # http://127.0.0.1:PORT

    def idle(self, timeout: float = 10.0) -> bool:
        """Wait until no engine holds a request (aborts are processed on the server's loop)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(e.has_unfinished_requests() for e in self.served.runtime.engines.values()):
                return True
            time.sleep(0.02)
        return False

    def check_baseline(self) -> None:
        assert self.idle(), "requests still live after the test"
        self.served.runtime.check_pages_idle()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def start_server(settings: ServerSettings, build: Callable[[ServerSettings], Served] = build_served) -> LiveServer:
    """A live server on a free loopback port; `build_core_served` puts its engines in a core process."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    served = build(settings)
    app = build_app(served, settings.api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    return LiveServer(served, server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}")


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    settings = ServerSettings(
        ModelSettings(DEFAULT_GENERATOR),
        ModelSettings(DEFAULT_PRM),
        served_model_name=MODEL,
        api_key=API_KEY,
        runtime=RuntimeSettings.from_flat(dtype="float32", kv_cache_memory=64 << 20),
    )
    server = start_server(settings)
    yield server
    server.stop()


@pytest.fixture
def server(live_server: LiveServer) -> Iterator[LiveServer]:
    """The shared server, checked for leaked requests and pages after the test."""
    yield live_server
    live_server.check_baseline()
