"""What passes between rank 0 and a rank > 0, however started: types and one helper only."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class RankGone(Exception):
    """A message could not reach a rank (it exited)."""


class ParallelSettings(Protocol):
    tensor_parallel_size: int
    pipeline_parallel_size: int
    parallel_timeout_s: float
    distributed_executor_backend: str  # "mp" (local processes) or "ray"


class ParallelEngine(Protocol):
    """The settings a parallel engine hands its ranks (EngineConfig): the split in `parallel_config`."""

    parallel_config: ParallelSettings


@dataclass
class WorkerArgs:
    config: Any
    device: str
    rank: int
    host: str  # rank 0's TCP store
    port: int
    threads: int


class Worker(Protocol):
    """What a rank > 0 runs, joined to its groups and its part loaded."""

    load_error: str | None
    parts: dict  # reported when ready: weights' bytes, KV bytes a token

    def handle(self, message: tuple) -> bool: ...  # False for "stop"


WorkerFactory = Callable[[WorkerArgs], Worker]  # picklable


class RankHandle(Protocol):
    def ready(self, timeout_s: float) -> tuple[str, Any]: ...  # ("ready", parts) | ("error", why)
    def send(self, message: tuple) -> None: ...  # RankGone when it cannot be reached
    def exited(self, timeout_s: float = 0.0) -> bool: ...
    def state(self) -> str: ...
    def stop(self) -> None: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
