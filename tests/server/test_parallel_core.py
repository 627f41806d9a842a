"""A server whose PRM runs on two ranks (tensor parallel) in the engine-core process: it serves,
and when a rank dies the request in its step fails, the core exits, and the supervisor starts
a new core with new ranks that serves again."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

from tests.server.conftest import start_server
from tests.server.test_engine_process import SEARCH, SETTINGS, wait_healthy
from tests.server.test_failures import post
from treeserve.config import ParallelConfig
from treeserve.server.launch import build_core_served
from treeserve.server.settings import ServerSettings

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two cores")


def rank_pids(core_pid: int) -> list[int]:
    """The core's children that multiprocessing spawned (its ranks)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == core_pid and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


@pytest.mark.slow  # ~18s (CI runs the slow step); the default suite keeps to ~10 minutes
def test_a_dead_rank_restarts_the_core_with_new_ranks():
    settings = ServerSettings(
        **{**SETTINGS, "prm": replace(SETTINGS["prm"], parallel_config=ParallelConfig(tensor_parallel_size=2))}
    )
    live = start_server(settings, build=build_core_served)
    try:
        first = post(live, "/v1/search", SEARCH)
        assert first.status_code == 200
        core = live.served.runtime.process
        [rank1] = rank_pids(core.pid)
        os.kill(rank1, signal.SIGKILL)
        failed = post(live, "/v1/search", {**SEARCH, "seed": 4})  # its PRM step meets the dead rank
        assert failed.status_code in (500, 503), failed.text
        assert "rank 1" in failed.text or "engine core" in failed.text
        deadline = time.monotonic() + 60
        while live.served.runtime.process is core and time.monotonic() < deadline:
            time.sleep(0.2)
        assert live.served.runtime.process is not core, "the core was not restarted"
        wait_healthy(live.base_url)
        again = post(live, "/v1/search", SEARCH)
        assert again.status_code == 200 and again.json()["answer"] == first.json()["answer"]
        assert len(rank_pids(live.served.runtime.process.pid)) == 1  # new ranks, and the old ones gone
        assert rank1 not in rank_pids(core.pid)  # the killed rank is gone
    finally:
        live.stop()
