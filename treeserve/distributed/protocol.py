"""What passes between rank 0 and a rank > 0, however the rank was started.

Owns `WorkerArgs` (what a rank is started with), `Worker` (what it runs: the caller's, built by a
`WorkerFactory`), `RankHandle` (rank 0's view of one rank: `local_ranks.py::LocalRank`,
`ray_ranks.py::RayRank`), `ParallelSettings` (what the launchers read of the engine's settings)
and `RankGone`. Types and one helper only: nothing here starts a process.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class RankGone(Exception):
    """A message could not reach a rank (it exited)."""


class ParallelSettings(Protocol):
    """What the ranks read of an engine's settings (`config.py::EngineConfig` has these)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    parallel_timeout_s: float
    distributed_executor_backend: str  # "mp" (local processes) or "ray"


@dataclass
class WorkerArgs:
    config: Any  # the engine's settings, handed to the worker as they are
    device: str  # this rank's
    rank: int
    host: str  # where rank 0's TCP store listens
    port: int
    threads: int


class Worker(Protocol):
    """What a rank > 0 runs, built from its `WorkerArgs` (joined to its groups, its part loaded)."""

    load_error: str | None  # why its part could not load (reported to rank 0), else None
    parts: dict  # what it holds, reported to rank 0 when ready (weights' bytes, KV bytes a token)

    def handle(self, message: tuple) -> bool: ...  # run one message; False for "stop"


WorkerFactory = Callable[[WorkerArgs], Worker]  # a picklable callable: a class or a module-level function


class RankHandle(Protocol):
    """Rank 0's view of one other rank, however it was started."""

    def ready(self, timeout_s: float) -> tuple[str, Any]: ...  # ("ready", parts) | ("error", why)
    def send(self, message: tuple) -> None: ...  # RankGone when it cannot be reached
    def exited(self, timeout_s: float = 0.0) -> bool: ...  # waits up to timeout_s for it to exit
    def state(self) -> str: ...
    def stop(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
